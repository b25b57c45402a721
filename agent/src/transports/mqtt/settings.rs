//! Plain settings for MQTT sessions, receivers and senders.
//!
//! The runtime fills these from the validated bridge configuration. They are
//! checked once more here, where the rules of the client library apply
//! (rumqttc panics on some values), so that a bad value is an error at
//! construction, never a panic in the event loop.

use std::path::PathBuf;
use std::time::Duration;

use ferry_shared::config::Secret;
use ferry_shared::config::transport::unix_socket_path;
use ferry_shared::mqtt_string;

/// The largest packet MQTT can carry (the variable byte integer limit).
pub const MQTT_MAX_PACKET_BYTES: u32 = 268_435_455;

/// MQTT protocol version of a session.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Protocol {
    /// MQTT 5 (the default): user properties, message expiry, receive maximum.
    #[default]
    V5,
    /// MQTT 3.1.1: no properties, so headers, content type, expiry and the
    /// message id header neither arrive nor leave.
    V311,
}

/// Quality of service of a subscription or a publish.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum Qos {
    /// At most once: no acknowledgement.
    AtMostOnce,
    /// At least once: PUBACK (the default, and what Ferry's guarantees need).
    #[default]
    AtLeastOnce,
    /// Exactly once (PUBREC/PUBREL/PUBCOMP). Received messages are settled
    /// with the PUBREC.
    ExactlyOnce,
}

/// A connection to one MQTT broker.
#[derive(Clone, Debug)]
pub struct MqttSessionSettings {
    /// The session's name in the configuration; becomes the envelope's
    /// `source.session_id`.
    pub name: String,
    /// `tcp://host:port` or `mqtt://` (plain, default port 1883),
    /// `ssl://host:port` or `mqtts://` (TLS, default port 8883), or
    /// `unix:///path` (the Unix socket of a broker on the same host).
    pub broker_url: String,
    /// MQTT client id; must be unique per broker, and stable for a persistent
    /// session.
    pub client_id: String,
    /// Keep-alive interval, whole seconds from 5 s to 65 535 s.
    pub keep_alive: Duration,
    /// User name, if the broker requires one.
    pub username: Option<String>,
    /// Password (needs a user name); prints as `***`.
    pub password: Option<Secret>,
    /// Allows a user name / password on a plain (non-TLS) connection.
    pub allow_plaintext_credentials: bool,
    /// Protocol version.
    pub protocol: Protocol,
    /// Clean start (v5) / clean session (v3.1.1). Off for receivers, so the
    /// broker keeps their QoS 1 messages while the agent is down.
    pub clean_start: bool,
    /// How long the broker keeps the session after a disconnect (v5 session
    /// expiry interval, whole seconds; ignored by v3.1.1, where the broker's own
    /// setting applies).
    pub session_expiry: Duration,
    /// PEM file of the CA certificates to trust for TLS; the system's roots
    /// when unset.
    pub ca_file: Option<PathBuf>,
    /// Time allowed for the connection (TCP and TLS, or the Unix socket) and
    /// CONNECT/CONNACK, whole seconds.
    pub connect_timeout: Duration,
    /// First reconnect delay; doubles per failed attempt (with jitter).
    pub reconnect_initial: Duration,
    /// Longest reconnect delay.
    pub reconnect_max: Duration,
    /// Largest MQTT packet written (further limited by the broker's CONNACK
    /// maximum packet size). A session with a receiver reads any packet up to
    /// the MQTT maximum and announces that in v5, so the broker never discards
    /// a message for it silently; a session without one announces and reads
    /// this limit.
    pub max_packet_bytes: u32,
    /// Most QoS 1/2 publishes of this session awaiting their acknowledgement at
    /// once (the pipelining window of senders).
    pub max_outgoing_inflight: u16,
}

impl MqttSessionSettings {
    /// Settings with Ferry's defaults: v5, persistent session (clean start off,
    /// one hour expiry), keep-alive 30 s, TLS per URL scheme, reconnect
    /// 100 ms → 10 s, 1 MiB packets.
    pub fn new(
        name: impl Into<String>,
        broker_url: impl Into<String>,
        client_id: impl Into<String>,
    ) -> Self {
        Self {
            name: name.into(),
            broker_url: broker_url.into(),
            client_id: client_id.into(),
            keep_alive: Duration::from_secs(30),
            username: None,
            password: None,
            allow_plaintext_credentials: false,
            protocol: Protocol::V5,
            clean_start: false,
            session_expiry: Duration::from_secs(3600),
            ca_file: None,
            connect_timeout: Duration::from_secs(10),
            reconnect_initial: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(10),
            max_packet_bytes: 1024 * 1024,
            max_outgoing_inflight: 100,
        }
    }

    /// Checks every setting; returns the broker endpoint to connect to.
    pub(crate) fn validate(&self) -> Result<Endpoint, SettingsError> {
        let endpoint = parse_broker_url(&self.broker_url)?;
        if self.client_id.is_empty() {
            return Err(SettingsError::Invalid("client_id must not be empty".into()));
        }
        if self.client_id.len() > usize::from(u16::MAX) {
            return Err(SettingsError::Invalid("client_id is too long".into()));
        }
        let keep_alive = self.keep_alive.as_secs();
        if self.keep_alive.subsec_nanos() != 0 || !(5..=u64::from(u16::MAX)).contains(&keep_alive) {
            return Err(SettingsError::Invalid(format!(
                "keep_alive must be whole seconds between 5s and 65535s, got {:?}",
                self.keep_alive
            )));
        }
        if self.password.is_some() && self.username.is_none() {
            return Err(SettingsError::Invalid("a password needs a username".into()));
        }
        if (self.username.is_some() || self.password.is_some())
            && endpoint.plaintext()
            && !self.allow_plaintext_credentials
        {
            return Err(SettingsError::PlaintextCredentials(self.broker_url.clone()));
        }
        if self.ca_file.is_some() && !endpoint.tls() {
            return Err(SettingsError::Invalid(format!(
                "ca_file is set but {} is not a TLS URL (use ssl:// or mqtts://)",
                self.broker_url
            )));
        }
        if u32::try_from(self.session_expiry.as_secs()).is_err() {
            return Err(SettingsError::Invalid(
                "session_expiry must be at most 4294967295s".into(),
            ));
        }
        if self.connect_timeout.as_secs() == 0 {
            return Err(SettingsError::Invalid(
                "connect_timeout must be at least 1s".into(),
            ));
        }
        if self.reconnect_initial.is_zero() || self.reconnect_max < self.reconnect_initial {
            return Err(SettingsError::Invalid(
                "reconnect delays must be positive with reconnect_max >= reconnect_initial".into(),
            ));
        }
        if !(128..=MQTT_MAX_PACKET_BYTES).contains(&self.max_packet_bytes) {
            return Err(SettingsError::Invalid(format!(
                "max_packet_bytes must be between 128 and {MQTT_MAX_PACKET_BYTES}"
            )));
        }
        if self.max_outgoing_inflight == 0 {
            return Err(SettingsError::Invalid(
                "max_outgoing_inflight must be at least 1".into(),
            ));
        }
        Ok(endpoint)
    }
}

/// What a receiver subscribes to and how much it holds at once.
#[derive(Clone, Debug)]
pub struct MqttReceiverSettings {
    /// Topic filters and their QoS, subscribed on every new session.
    pub filters: Vec<(String, Qos)>,
    /// Most unsettled deliveries at once: the route's `max_in_flight`, sent to
    /// the broker as v5 receive maximum so it stops sending when the window is
    /// full. The delivery channel holds sixteen such windows.
    pub max_in_flight: u16,
    /// Payloads larger than this are delivered with [`Defect::Oversized`]
    /// (must not exceed the session's `max_packet_bytes`).
    ///
    /// [`Defect::Oversized`]: crate::transports::Defect::Oversized
    pub max_payload_bytes: usize,
    /// Keep an incoming `ferry-message-id` as the envelope id (a hop from
    /// another Ferry agent). When false, incoming `ferry-*` user properties
    /// are dropped and every message gets a fresh UUIDv7.
    pub trust_message_id: bool,
}

impl MqttReceiverSettings {
    /// A receiver of `filters` with `max_in_flight` 100, 256 KiB payloads and
    /// untrusted message ids.
    pub fn new(filters: Vec<(String, Qos)>) -> Self {
        Self {
            filters,
            max_in_flight: 100,
            max_payload_bytes: 256 * 1024,
            trust_message_id: false,
        }
    }

    pub(crate) fn validate(&self, session: &MqttSessionSettings) -> Result<(), SettingsError> {
        if self.filters.is_empty() {
            return Err(SettingsError::Invalid(
                "a receiver needs at least one topic filter".into(),
            ));
        }
        for (filter, _) in &self.filters {
            if !valid_filter(filter) {
                return Err(SettingsError::Invalid(format!(
                    "invalid topic filter {filter:?}"
                )));
            }
        }
        if self.max_in_flight == 0 {
            return Err(SettingsError::Invalid(
                "max_in_flight must be at least 1".into(),
            ));
        }
        if self.max_payload_bytes == 0 || self.max_payload_bytes > session.max_packet_bytes as usize
        {
            return Err(SettingsError::Invalid(format!(
                "max_payload_bytes must be between 1 and the session's max_packet_bytes ({})",
                session.max_packet_bytes
            )));
        }
        Ok(())
    }
}

/// How a sender publishes.
#[derive(Clone, Debug)]
pub struct MqttSenderSettings {
    /// QoS of every publish (QoS 1 resolves on PUBACK; QoS 0 once written).
    pub qos: Qos,
    /// Publishes with the retain flag.
    pub retain: bool,
    /// Bound on one send, from the call to the acknowledgement.
    pub send_timeout: Duration,
}

impl Default for MqttSenderSettings {
    fn default() -> Self {
        Self {
            qos: Qos::AtLeastOnce,
            retain: false,
            send_timeout: Duration::from_secs(30),
        }
    }
}

/// A session, receiver or sender setting that cannot work.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SettingsError {
    /// The broker URL does not parse.
    #[error("invalid broker_url {url:?}: {reason}")]
    BrokerUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Credentials would travel unencrypted.
    #[error(
        "username/password over plaintext {0} refused: use ssl:// or mqtts:// (or unix:// for a broker on this host), or set allow_plaintext_credentials"
    )]
    PlaintextCredentials(String),
    /// The TLS configuration cannot be built (CA file unreadable, no roots).
    #[error("tls: {0}")]
    Tls(String),
    /// Any other invalid value.
    #[error("{0}")]
    Invalid(String),
}

/// Where to connect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Endpoint {
    /// A host and port, with or without TLS.
    Tcp { host: String, port: u16, tls: bool },
    /// The Unix socket of a broker on the same host (`unix:///path`).
    Unix(PathBuf),
}

impl Endpoint {
    /// Whether the connection runs TLS.
    pub fn tls(&self) -> bool {
        matches!(self, Endpoint::Tcp { tls: true, .. })
    }

    /// Whether credentials sent on it cross a network unencrypted.
    fn plaintext(&self) -> bool {
        matches!(self, Endpoint::Tcp { tls: false, .. })
    }
}

pub(crate) fn parse_broker_url(url: &str) -> Result<Endpoint, SettingsError> {
    let error = |reason: &str| SettingsError::BrokerUrl {
        url: url.to_owned(),
        reason: reason.to_owned(),
    };
    if let Some(path) = unix_socket_path(url) {
        return path
            .map(|path| Endpoint::Unix(PathBuf::from(path)))
            .map_err(|reason| error(&reason));
    }
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| error("expected scheme://host[:port] or unix:///path"))?;
    let (tls, default_port) = match scheme.to_ascii_lowercase().as_str() {
        "tcp" | "mqtt" => (false, 1883),
        "ssl" | "mqtts" => (true, 8883),
        _ => return Err(error("the scheme must be tcp, mqtt, ssl, mqtts or unix")),
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains('/') || rest.contains('?') || rest.contains('@') {
        return Err(error(
            "only host and port are allowed (credentials go in username/password)",
        ));
    }
    let (host, port) = if let Some(bracketed) = rest.strip_prefix('[') {
        let (host, after) = bracketed
            .split_once(']')
            .ok_or_else(|| error("unclosed [ in an IPv6 address"))?;
        match after {
            "" => (host, None),
            _ => (
                host,
                Some(
                    after
                        .strip_prefix(':')
                        .ok_or_else(|| error("expected :port after ]"))?,
                ),
            ),
        }
    } else {
        match rest.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (rest, None),
        }
    };
    if host.is_empty() {
        return Err(error("the host is missing"));
    }
    let port = match port {
        None => default_port,
        Some(port) => port
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| error("the port must be a number from 1 to 65535"))?,
    };
    Ok(Endpoint::Tcp {
        host: host.to_owned(),
        port,
        tls,
    })
}

/// MQTT topic filter rules: not empty, `#` only as the whole last level, `+`
/// only as a whole level, no NUL.
pub(crate) fn valid_filter(filter: &str) -> bool {
    if filter.is_empty() || filter.len() > usize::from(u16::MAX) || filter.contains('\0') {
        return false;
    }
    let levels: Vec<&str> = filter.split('/').collect();
    let last = levels.len() - 1;
    levels.iter().enumerate().all(|(i, level)| {
        (*level == "#" && i == last)
            || *level == "+"
            || (!level.contains('#') && !level.contains('+'))
    })
}

/// MQTT topic name rules for a publish: not empty, no wildcards, and an MQTT
/// string ([`mqtt_string::problem`]).
pub(crate) fn topic_problem(topic: &str) -> Option<String> {
    // One pass over the bytes for what nearly every topic is: printable
    // ASCII without a wildcard (this runs for every send).
    let plain = |b| mqtt_string::printable(b) && b != b'+' && b != b'#';
    if !topic.is_empty()
        && topic.len() <= usize::from(u16::MAX)
        && mqtt_string::all_bytes(topic, plain)
    {
        return None;
    }
    if topic.is_empty() {
        Some("the topic is empty".into())
    } else if topic.contains(['+', '#']) {
        Some("the topic contains a wildcard".into())
    } else {
        mqtt_string::problem(topic).map(|problem| format!("the topic {problem}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(host: &str, port: u16, tls: bool) -> Endpoint {
        Endpoint::Tcp {
            host: host.into(),
            port,
            tls,
        }
    }

    #[test]
    fn broker_urls() {
        assert_eq!(
            parse_broker_url("tcp://127.0.0.1:1884"),
            Ok(endpoint("127.0.0.1", 1884, false))
        );
        assert_eq!(
            parse_broker_url("mqtt://broker"),
            Ok(endpoint("broker", 1883, false))
        );
        assert_eq!(
            parse_broker_url("mqtts://broker.example/"),
            Ok(endpoint("broker.example", 8883, true))
        );
        assert_eq!(
            parse_broker_url("ssl://[::1]:9000"),
            Ok(endpoint("::1", 9000, true))
        );
        assert_eq!(
            parse_broker_url("unix:///run/mosquitto/mqtt.sock"),
            Ok(Endpoint::Unix("/run/mosquitto/mqtt.sock".into()))
        );
        // `sun_path` holds 108 bytes with the terminating NUL.
        let longest = format!("/{}", "s".repeat(106));
        assert_eq!(
            parse_broker_url(&format!("unix://{longest}")),
            Ok(Endpoint::Unix(longest.clone().into()))
        );
        assert!(parse_broker_url(&format!("unix://{longest}s")).is_err());
        for bad in [
            "broker:1883",
            "http://broker",
            "tcp://",
            "tcp://broker:0",
            "tcp://broker:x",
            "tcp://u:p@broker",
            "tcp://broker/path",
            "unix://relative.sock",
            "unix://",
            "unix:///run/mosquitto/",
        ] {
            assert!(parse_broker_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn plaintext_credentials_are_refused_unless_allowed() {
        let mut s = MqttSessionSettings::new("in", "tcp://127.0.0.1:1883", "c");
        s.username = Some("u".into());
        s.password = Some("p".into());
        assert!(matches!(
            s.validate(),
            Err(SettingsError::PlaintextCredentials(_))
        ));
        s.allow_plaintext_credentials = true;
        assert!(s.validate().is_ok());
        s.allow_plaintext_credentials = false;
        s.broker_url = "mqtts://127.0.0.1".into();
        assert!(s.validate().is_ok());
        // Credentials on a Unix socket stay on the host.
        s.broker_url = "unix:///run/mqtt.sock".into();
        assert!(s.validate().is_ok());
        s.ca_file = Some("/ca.pem".into());
        assert!(s.validate().is_err(), "no TLS on a Unix socket");
    }

    #[test]
    fn values_rumqttc_would_panic_on_are_errors() {
        let mut s = MqttSessionSettings::new("in", "tcp://127.0.0.1:1883", "c");
        s.keep_alive = Duration::from_secs(2);
        assert!(s.validate().is_err());
        s.keep_alive = Duration::from_millis(5500);
        assert!(s.validate().is_err());
        s.keep_alive = Duration::from_secs(5);
        s.client_id.clear();
        assert!(s.validate().is_err());
    }

    #[test]
    fn filters_and_topics() {
        for good in ["a", "a/b", "+", "#", "a/+/c", "a/#", "+/+", "/"] {
            assert!(valid_filter(good), "{good}");
        }
        for bad in ["", "a#", "a/#/b", "a+/b", "a/b+"] {
            assert!(!valid_filter(bad), "{bad}");
        }
        for good in ["a/b", "a b/~", "é/€", &"x".repeat(65_535)] {
            assert_eq!(topic_problem(good), None, "{good}");
        }
        assert!(topic_problem("a/+").is_some());
        assert!(topic_problem("#").is_some());
        assert!(topic_problem("é/#").is_some());
        assert!(topic_problem("").is_some());
        assert_eq!(
            topic_problem(&"x".repeat(65_536)).as_deref(),
            Some("the topic is 65536 bytes, more than an MQTT string holds (65535)")
        );
        assert_eq!(
            topic_problem("a\nb").as_deref(),
            Some("the topic contains a control character (U+000A)")
        );
    }
}
