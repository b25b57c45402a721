//! Shape checks shared by the rules: URLs, MQTT topics, SQS queue names. Each returns the
//! problem as a message.

use super::super::secret::mask_url;
use super::super::transport::unix_socket_path;

/// The parts of a `scheme://host[:port][/path]` URL that the rules look at.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Url<'a> {
    pub scheme: String,
    pub host: &'a str,
    pub port: Option<u16>,
    pub path: &'a str,
}

/// Parses `scheme://host[:port][/path]` without user info, query or fragment. A URL that
/// carries a password (refused) is named in the message with the password masked.
pub(super) fn url(s: &str) -> Result<Url<'_>, String> {
    parse_url(s).map_err(|message| message.replace(s, &mask_url(s)))
}

fn parse_url(s: &str) -> Result<Url<'_>, String> {
    let Some((scheme, rest)) = s.split_once("://") else {
        return Err(format!(
            "\"{s}\" is not a URL (expected scheme://host[:port])"
        ));
    };
    if scheme.is_empty()
        || !scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '+')
    {
        return Err(format!("\"{s}\" has an invalid scheme \"{scheme}\""));
    }
    if rest.contains(['?', '#']) {
        return Err(format!("\"{s}\" must not have a query or fragment"));
    }
    let (authority, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    if authority.contains('@') {
        return Err(format!(
            "\"{s}\" must not carry credentials in the URL (use the username and password options)"
        ));
    }
    let (host, port) = if let Some(bracketed) = authority.strip_prefix('[') {
        let Some((host, after)) = bracketed.split_once(']') else {
            return Err(format!("\"{s}\" has an unclosed IPv6 address"));
        };
        if host.is_empty()
            || !host
                .chars()
                .all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.')
        {
            return Err(format!("\"{s}\" has an invalid IPv6 address"));
        }
        match after {
            "" => (host, None),
            p => match p.strip_prefix(':') {
                Some(p) => (host, Some(p)),
                None => return Err(format!("\"{s}\" has junk after the IPv6 address")),
            },
        }
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    if !authority.starts_with('[')
        && (host.is_empty()
            || !host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_')))
    {
        return Err(format!("\"{s}\" has no valid host"));
    }
    let port = match port {
        None => None,
        Some(p) => match p.parse::<u16>() {
            Ok(0) | Err(_) => return Err(format!("\"{s}\" has an invalid port \"{p}\"")),
            Ok(n) => Some(n),
        },
    };
    Ok(Url {
        scheme: scheme.to_ascii_lowercase(),
        host,
        port,
        path,
    })
}

/// An `http://` or `https://` endpoint.
pub(super) fn http_url(s: &str) -> Result<Url<'_>, String> {
    let u = url(s)?;
    if u.scheme != "http" && u.scheme != "https" {
        return Err(format!(
            "\"{s}\" must be an http:// or https:// URL, not {}://",
            u.scheme
        ));
    }
    Ok(u)
}

/// The MQTT broker URL schemes over the network, and whether each is TLS (the agent's MQTT
/// client speaks TCP and TLS, not WebSocket).
pub(super) const MQTT_SCHEMES: [(&str, bool); 4] = [
    ("tcp", false),
    ("mqtt", false),
    ("ssl", true),
    ("mqtts", true),
];

/// How an MQTT broker URL reaches its broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BrokerLink {
    /// Over the network without TLS: `tcp://`, `mqtt://`.
    Plain,
    /// Over the network with TLS: `ssl://`, `mqtts://`.
    Tls,
    /// A Unix socket of a broker on the same host, `unix:///path`: nothing crosses a network,
    /// and there is no TLS.
    UnixSocket,
}

/// An MQTT broker URL; returns how it reaches its broker.
pub(super) fn broker_url(s: &str) -> Result<BrokerLink, String> {
    if let Some(path) = unix_socket_path(s) {
        return path
            .map(|_| BrokerLink::UnixSocket)
            .map_err(|problem| format!("\"{s}\" {problem}"));
    }
    let u = url(s)?;
    let Some(&(_, tls)) = MQTT_SCHEMES.iter().find(|(scheme, _)| *scheme == u.scheme) else {
        let websocket = if matches!(u.scheme.as_str(), "ws" | "wss") {
            " (the agent does not speak MQTT over WebSocket)"
        } else {
            ""
        };
        return Err(format!(
            "\"{s}\" has scheme \"{}\"; an MQTT broker URL is tcp://, mqtt://, ssl://, mqtts:// or unix://{websocket}",
            u.scheme
        ));
    };
    if !u.path.is_empty() && u.path != "/" {
        return Err(format!("\"{s}\" has a path; a broker URL takes none"));
    }
    Ok(if tls {
        BrokerLink::Tls
    } else {
        BrokerLink::Plain
    })
}

/// A subscription topic filter (wildcards allowed, `$share/{group}/{filter}` allowed).
pub(super) fn topic_filter(f: &str) -> Result<(), String> {
    basic_topic(f)?;
    let filter = match f.strip_prefix("$share/") {
        Some(rest) => {
            let Some((group, filter)) = rest.split_once('/') else {
                return Err(format!(
                    "shared subscription \"{f}\" needs the form $share/{{group}}/{{filter}}"
                ));
            };
            if group.is_empty() || group.contains(['+', '#']) {
                return Err(format!(
                    "shared subscription \"{f}\" needs a group name without wildcards"
                ));
            }
            if filter.is_empty() {
                return Err(format!("shared subscription \"{f}\" has an empty filter"));
            }
            filter
        }
        None => f,
    };
    let levels: Vec<&str> = filter.split('/').collect();
    for (i, level) in levels.iter().enumerate() {
        if level.contains('#') && (*level != "#" || i + 1 != levels.len()) {
            return Err(format!(
                "topic filter \"{f}\": '#' must be a whole level and the last one"
            ));
        }
        if level.contains('+') && *level != "+" {
            return Err(format!("topic filter \"{f}\": '+' must be a whole level"));
        }
    }
    Ok(())
}

/// A topic to publish to: no wildcards, not a `$` system topic.
pub(super) fn publish_topic(t: &str) -> Result<(), String> {
    basic_topic(t)?;
    if t.contains(['+', '#']) {
        return Err(format!(
            "\"{t}\" contains a wildcard ('+' or '#'); a topic to publish to must be a plain topic"
        ));
    }
    if t.starts_with('$') {
        return Err(format!(
            "\"{t}\" starts with '$', which brokers reserve for their own topics"
        ));
    }
    Ok(())
}

fn basic_topic(t: &str) -> Result<(), String> {
    if t.is_empty() {
        return Err("topic must not be empty".to_owned());
    }
    match crate::mqtt_string::problem(t) {
        Some(problem) => Err(format!("topic {problem}")),
        None => Ok(()),
    }
}

/// An SQS queue name: 1–80 of `[A-Za-z0-9_-]`, optionally ending in `.fifo`.
pub(super) fn queue_name(name: &str) -> Result<(), String> {
    let stem = name.strip_suffix(".fifo").unwrap_or(name);
    if name.is_empty()
        || name.len() > 80
        || stem.is_empty()
        || !stem
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(format!(
            "\"{name}\" is not an SQS queue name (1-80 letters, digits, '-' or '_', optionally ending in .fifo)"
        ));
    }
    Ok(())
}

/// Whether `s` is written as a URL rather than a bare name.
pub(super) fn looks_like_url(s: &str) -> bool {
    s.contains("://")
}

/// An SQS queue URL (`https://sqs.{region}.amazonaws.com/{account}/{name}`, or an emulator's);
/// returns the queue name, its last path segment.
pub(super) fn queue_url(s: &str) -> Result<&str, String> {
    let u = http_url(s)?;
    let name = u
        .path
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or("");
    if name.is_empty() {
        return Err(format!("queue URL \"{s}\" has no queue name in its path"));
    }
    queue_name(name).map_err(|e| format!("queue URL \"{s}\": {e}"))?;
    Ok(name)
}

/// A queue given as a bare name or a URL; returns the name.
pub(super) fn queue_ref(s: &str) -> Result<&str, String> {
    if looks_like_url(s) {
        queue_url(s)
    } else {
        queue_name(s).map(|()| s)
    }
}

/// An SNS topic name: 1–256 of `[A-Za-z0-9_-]`, optionally ending in `.fifo`.
pub(super) fn sns_topic_name(name: &str) -> Result<(), String> {
    let stem = name.strip_suffix(".fifo").unwrap_or(name);
    if name.len() > 256
        || stem.is_empty()
        || !stem
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(format!(
            "\"{name}\" is not an SNS topic name (1-256 letters, digits, '-' or '_', optionally ending in .fifo)"
        ));
    }
    Ok(())
}

/// An SNS topic ARN (`arn:{partition}:sns:{region}:{account}:{name}`); returns the topic name.
pub(super) fn topic_arn(arn: &str) -> Result<&str, String> {
    let parts: Vec<&str> = arn.split(':').collect();
    match parts.as_slice() {
        ["arn", partition, "sns", region, account, name]
            if !partition.is_empty() && !region.is_empty() && !account.is_empty() =>
        {
            sns_topic_name(name).map_err(|e| format!("topic ARN \"{arn}\": {e}"))?;
            Ok(name)
        }
        _ => Err(format!(
            "\"{arn}\" is not an SNS topic ARN (arn:PARTITION:sns:REGION:ACCOUNT:NAME)"
        )),
    }
}

/// A `message_group_id`: a fixed id (1–128 printable ASCII characters) or `{header:NAME}`.
pub(super) fn group_id(g: &str) -> Result<(), String> {
    match crate::config::transport::GroupId::parse(g) {
        crate::config::transport::GroupId::Header(name) if name.is_empty() => {
            Err("{header:NAME} needs a header name".to_owned())
        }
        crate::config::transport::GroupId::Header(_) => Ok(()),
        crate::config::transport::GroupId::Fixed(id) => {
            if id.is_empty() || id.len() > 128 || !id.chars().all(|c| c.is_ascii_graphic()) {
                Err(format!(
                    "\"{id}\" is not a message group id (1-128 letters, digits or punctuation)"
                ))
            } else {
                Ok(())
            }
        }
    }
}

/// A PostgreSQL table: `name` or `schema.name`, each an unquoted identifier (a letter or `_`,
/// then letters, digits or `_`, at most 63 bytes), since the agent puts it into its queries.
/// A plain SQL identifier (what a statement may carry unquoted on PostgreSQL and MySQL).
pub(super) fn identifier(part: &str) -> bool {
    !part.is_empty()
        && part.len() <= 63
        && part.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

pub(super) fn table_name(t: &str) -> Result<(), String> {
    let parts: Vec<&str> = t.split('.').collect();
    if parts.len() <= 2 && parts.iter().all(|p| identifier(p)) {
        Ok(())
    } else {
        Err(format!(
            "\"{t}\" is not a table name (name or schema.name; letters, digits and _)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sns_topics_and_groups() {
        assert_eq!(
            topic_arn("arn:aws:sns:us-east-1:123456789012:orders.fifo"),
            Ok("orders.fifo")
        );
        assert!(topic_arn("arn:aws:sqs:us-east-1:123456789012:orders").is_err());
        assert!(topic_arn("orders").is_err());
        assert!(sns_topic_name("a b").is_err());
        assert!(group_id("sensors").is_ok());
        assert!(group_id("{header:device}").is_ok());
        assert!(group_id("{header:}").is_err());
        assert!(group_id("a b").is_err());
    }

    #[test]
    fn urls() {
        let u = url("tcp://mqtt.example.com:1883").expect("valid");
        assert_eq!(
            (u.scheme.as_str(), u.host, u.port),
            ("tcp", "mqtt.example.com", Some(1883))
        );
        let u = url("wss://[::1]:443/mqtt").expect("valid");
        assert_eq!((u.host, u.port, u.path), ("::1", Some(443), "/mqtt"));
        assert!(url("mqtt.example.com:1883").is_err());
        assert!(url("tcp://:1883").is_err());
        assert!(url("tcp://host:0").is_err());
        assert!(url("tcp://host:99999").is_err());
        assert!(url("tcp://host:port").is_err());
        assert!(url("tcp://user:pw@host").is_err());
        assert!(url("tcp://ho st").is_err());
    }

    #[test]
    fn a_refused_url_is_named_without_its_password() {
        for bad in [
            "mqtt://u:hunter2@h:1883",
            "mqtt://u:hunter2@h:1883/?q",
            "x y://u:hunter2@h",
        ] {
            let message = url(bad).expect_err(bad);
            assert!(
                !message.contains("hunter2") && message.contains("u:***@h"),
                "{message}"
            );
        }
    }

    #[test]
    fn broker_urls() {
        assert_eq!(broker_url("tcp://h:1883"), Ok(BrokerLink::Plain));
        assert_eq!(broker_url("mqtts://h"), Ok(BrokerLink::Tls));
        assert_eq!(broker_url("mqtts://h/"), Ok(BrokerLink::Tls));
        assert!(
            broker_url("wss://h/mqtt")
                .expect_err("no WebSocket")
                .contains("WebSocket")
        );
        assert_eq!(
            broker_url("unix:///run/mosquitto/mqtt.sock"),
            Ok(BrokerLink::UnixSocket)
        );
        assert_eq!(
            broker_url("UNIX:///x"),
            Ok(BrokerLink::UnixSocket),
            "schemes are case-insensitive"
        );
        for (bad, problem) in [
            ("unix://", "absolute path"),
            ("unix:///", "absolute path"),
            ("unix://relative/path", "absolute path"),
            ("unix:///run/mosquitto/", "absolute path"),
            ("unix:///run/mqtt.sock?x=1", "query or fragment"),
            ("unix:///a\0b", "NUL"),
        ] {
            let error = broker_url(bad).expect_err(bad);
            assert!(error.contains(problem), "{bad:?}: {error}");
        }
        let longest = format!("unix:///{}", "s".repeat(106));
        assert_eq!(broker_url(&longest), Ok(BrokerLink::UnixSocket));
        assert!(
            broker_url(&format!("{longest}s"))
                .expect_err("108 bytes of path")
                .contains("at most 107")
        );
        assert!(broker_url("http://h").is_err());
        assert!(broker_url("tcp://h/path").is_err());
    }

    #[test]
    fn topic_filters() {
        for ok in [
            "sensors/#",
            "#",
            "+",
            "a/+/c",
            "a//b",
            "$share/g/sensors/#",
            "$SYS/#",
            "/",
        ] {
            assert!(topic_filter(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "a/#/b",
            "a#",
            "a/b+",
            "$share/g",
            "$share//x",
            "$share/g+/x",
            "a\0b",
        ] {
            assert!(topic_filter(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn publish_topics() {
        assert!(publish_topic("events/sensors").is_ok());
        for bad in ["", "a/+", "a/#", "$SYS/x"] {
            assert!(publish_topic(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn queues() {
        assert!(queue_name("sensor-events").is_ok());
        assert!(queue_name("orders.fifo").is_ok());
        assert!(queue_name(".fifo").is_err());
        assert!(queue_name("a b").is_err());
        assert!(queue_name(&"q".repeat(81)).is_err());
        assert_eq!(
            queue_url("https://sqs.us-east-1.amazonaws.com/123456789012/sensor-events"),
            Ok("sensor-events")
        );
        assert_eq!(queue_url("http://localhost:5000/000000000000/q/"), Ok("q"));
        assert!(queue_url("https://sqs.us-east-1.amazonaws.com/").is_err());
        assert!(queue_url("ftp://x/1/q").is_err());
        assert_eq!(queue_ref("q"), Ok("q"));
    }
}
