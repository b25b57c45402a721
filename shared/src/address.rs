//! Binding addresses: templates filled from the envelope, and the address shapes of the
//! transports whose address is more than a topic (RabbitMQ, NATS).
//!
//! A binding address may name envelope headers: `orders.{header:aggregate_id}` or
//! `events/{header:site}`. [`AddressTemplate::fill`] replaces each placeholder with the first
//! value of that header, in one pass over the template. Invariants:
//!
//! - the only placeholder is `{header:NAME}`; `{{` and `}}` are a literal brace, any other
//!   brace is a syntax error (found when the configuration is validated);
//! - a header that is absent or empty fails the fill: there is no address to send that message
//!   to, so the sender reports a permanent error and the route dead-letters it;
//! - a value carrying a wildcard of any transport (`#`, `+`, `*`, `>`) fails the fill: a
//!   message must never widen into a pattern (an MQTT publish to `a/#` is refused by the
//!   broker, a NATS subject with `>` is not publishable, and a RabbitMQ routing key with `*`
//!   would read as a pattern to whoever copies it into a binding).
//!
//! The envelope has no aggregate-id field: an aggregate's id travels as a header, so
//! `orders.{header:aggregate_id}` is how an address names it.

use crate::envelope::Envelope;

/// The characters that are wildcards in some transport's addresses.
pub const WILDCARDS: [char; 4] = ['#', '+', '*', '>'];

/// Why an address template does not parse, or cannot be filled for one message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// The template text is malformed.
    #[error("address template \"{template}\": {problem}")]
    Syntax {
        /// The template as written.
        template: String,
        /// What is wrong with it.
        problem: String,
    },
    /// The message has no (or an empty) header the template names.
    #[error("the address names header \"{0}\", which this message does not carry")]
    MissingHeader(String),
    /// A header value would put a wildcard into the address.
    #[error(
        "header \"{header}\" = \"{value}\" would put a wildcard ('#', '+', '*', '>') into the address"
    )]
    Wildcard {
        /// The header.
        header: String,
        /// Its value.
        value: String,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Part {
    Literal(String),
    Header(String),
}

/// A parsed binding address: literal text and `{header:NAME}` placeholders.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AddressTemplate {
    parts: Vec<Part>,
}

impl AddressTemplate {
    /// Parses `text`. An address without braces is one literal.
    pub fn parse(text: &str) -> Result<Self, TemplateError> {
        let syntax = |problem: String| TemplateError::Syntax {
            template: text.to_owned(),
            problem,
        };
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut rest = text;
        while let Some(i) = rest.find(['{', '}']) {
            literal.push_str(&rest[..i]);
            let brace = &rest[i..];
            if let Some(after) = brace.strip_prefix("{{") {
                literal.push('{');
                rest = after;
            } else if let Some(after) = brace.strip_prefix("}}") {
                literal.push('}');
                rest = after;
            } else if brace.starts_with('}') {
                return Err(syntax(
                    "a '}' without its '{' (write '}}' for a literal brace)".into(),
                ));
            } else {
                let Some(end) = brace.find('}') else {
                    return Err(syntax("a '{' without its '}'".into()));
                };
                let inner = &brace[1..end];
                let name = inner.strip_prefix("header:").ok_or_else(|| {
                    syntax(format!(
                        "unknown placeholder {{{inner}}}; the placeholder is {{header:NAME}} (write '{{{{' for a literal brace)"
                    ))
                })?;
                if name.is_empty() || name.contains('{') {
                    return Err(syntax(format!(
                        "placeholder {{{inner}}} needs a header name"
                    )));
                }
                if !literal.is_empty() {
                    parts.push(Part::Literal(std::mem::take(&mut literal)));
                }
                parts.push(Part::Header(name.to_owned()));
                rest = &brace[end + 1..];
            }
        }
        literal.push_str(rest);
        if !literal.is_empty() {
            parts.push(Part::Literal(literal));
        }
        Ok(Self { parts })
    }

    /// True when the address names at least one header.
    pub fn is_template(&self) -> bool {
        self.parts.iter().any(|p| matches!(p, Part::Header(_)))
    }

    /// The address for `envelope`.
    pub fn fill(&self, envelope: &Envelope) -> Result<String, TemplateError> {
        self.render(|name| {
            let value = envelope
                .header(name)
                .filter(|v| !v.is_empty())
                .ok_or_else(|| TemplateError::MissingHeader(name.to_owned()))?;
            if value.contains(WILDCARDS) {
                return Err(TemplateError::Wildcard {
                    header: name.to_owned(),
                    value: value.to_owned(),
                });
            }
            Ok(value)
        })
    }

    /// The address with every placeholder replaced by `x`: what the literal parts look like
    /// to a transport's shape check at validation time.
    pub fn sample(&self) -> String {
        self.render(|_| Ok::<_, TemplateError>("x"))
            .unwrap_or_default()
    }

    fn render<'v, E>(
        &self,
        mut value: impl FnMut(&str) -> Result<&'v str, E>,
    ) -> Result<String, E> {
        let mut out = String::new();
        for part in &self.parts {
            match part {
                Part::Literal(text) => out.push_str(text),
                Part::Header(name) => out.push_str(value(name)?),
            }
        }
        Ok(out)
    }
}

/// The longest AMQP exchange name and routing key (a short string), in bytes.
const AMQP_SHORT_STRING: usize = 255;

/// A RabbitMQ binding address, `EXCHANGE/ROUTING_KEY`, split at the first `/` (an exchange
/// name has no `/`; a routing key may). An empty exchange (`/orders`) or an address without
/// a `/` (`orders`) is the default exchange, which routes to the queue named by the routing
/// key.
pub fn amqp_address(address: &str) -> Result<(&str, &str), String> {
    let (exchange, routing_key) = address.split_once('/').unwrap_or(("", address));
    if exchange.len() > 127 {
        return Err(format!(
            "exchange \"{exchange}\" is {} bytes long, AMQP allows at most 127",
            exchange.len()
        ));
    }
    if !exchange
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'))
    {
        return Err(format!(
            "exchange \"{exchange}\" may hold only letters, digits, '-', '_', '.' and ':' (the address is EXCHANGE/ROUTING_KEY)"
        ));
    }
    if exchange.starts_with("amq.")
        && !matches!(
            exchange,
            "amq.direct" | "amq.topic" | "amq.fanout" | "amq.headers" | "amq.match"
        )
    {
        return Err(format!("exchange \"{exchange}\" is reserved by the broker"));
    }
    if exchange.is_empty() && routing_key.is_empty() {
        return Err("the default exchange needs a routing key (the queue name)".into());
    }
    if routing_key.len() > AMQP_SHORT_STRING {
        return Err(format!(
            "routing key is {} bytes long, AMQP allows at most {AMQP_SHORT_STRING}",
            routing_key.len()
        ));
    }
    Ok((exchange, routing_key))
}

/// The longest NATS subject this check accepts, in bytes (the server's default
/// `max_control_line` leaves room for about that much).
const MAX_SUBJECT_BYTES: usize = 2048;

/// A NATS subject to publish to: dot-separated tokens, none empty, no whitespace, no
/// wildcards (`*`, `>`).
pub fn nats_subject(subject: &str) -> Result<(), String> {
    if subject.is_empty() {
        return Err("subject must not be empty".into());
    }
    if subject.len() > MAX_SUBJECT_BYTES {
        return Err(format!(
            "subject is {} bytes long, at most {MAX_SUBJECT_BYTES} are accepted",
            subject.len()
        ));
    }
    if subject.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!(
            "subject \"{subject}\" contains whitespace or a control character"
        ));
    }
    if subject.split('.').any(str::is_empty) {
        return Err(format!("subject \"{subject}\" has an empty token"));
    }
    if subject.split('.').any(|t| t == "*" || t == ">") {
        return Err(format!(
            "subject \"{subject}\" contains a wildcard ('*' or '>'); a subject to publish to must be plain"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use prost::bytes::Bytes;

    use super::*;
    use crate::envelope::Source;

    fn envelope(headers: &[(&str, &str)]) -> Envelope {
        Envelope::new(
            "m1",
            Bytes::new(),
            Source::new("mqtt", "s", "in", SystemTime::UNIX_EPOCH),
        )
        .with_headers(headers)
    }

    fn fill(template: &str, headers: &[(&str, &str)]) -> Result<String, TemplateError> {
        AddressTemplate::parse(template)?.fill(&envelope(headers))
    }

    #[test]
    fn placeholders_are_filled_from_the_first_header_value() {
        let t = AddressTemplate::parse("orders.{header:aggregate_id}.{header:kind}").expect("ok");
        assert!(t.is_template());
        assert_eq!(
            t.fill(&envelope(&[
                ("kind", "created"),
                ("aggregate_id", "42"),
                ("kind", "x")
            ])),
            Ok("orders.42.created".into())
        );
        assert_eq!(t.sample(), "orders.x.x");
    }

    #[test]
    fn a_plain_address_is_one_literal_and_braces_escape() {
        let t = AddressTemplate::parse("a/b").expect("ok");
        assert!(!t.is_template());
        assert_eq!(t.fill(&envelope(&[])), Ok("a/b".into()));
        assert_eq!(fill("x{{y}}z", &[]), Ok("x{y}z".into()));
    }

    #[test]
    fn malformed_templates_are_refused() {
        for bad in [
            "a/{",
            "a/}",
            "a/{site}",
            "a/{header:}",
            "{aggregate_id}",
            "a{header:b{c}",
        ] {
            assert!(
                matches!(
                    AddressTemplate::parse(bad),
                    Err(TemplateError::Syntax { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_missing_or_empty_header_fails_the_fill() {
        assert_eq!(
            fill("events/{header:site}", &[("other", "1")]),
            Err(TemplateError::MissingHeader("site".into()))
        );
        assert_eq!(
            fill("events/{header:site}", &[("site", "")]),
            Err(TemplateError::MissingHeader("site".into()))
        );
    }

    #[test]
    fn wildcards_in_a_value_are_refused() {
        for value in ["#", "a+b", "*", "x>"] {
            assert!(
                matches!(
                    fill("events/{header:site}", &[("site", value)]),
                    Err(TemplateError::Wildcard { .. })
                ),
                "{value}"
            );
        }
    }

    #[test]
    fn amqp_addresses_split_at_the_first_slash() {
        assert_eq!(
            amqp_address("orders/created/eu"),
            Ok(("orders", "created/eu"))
        );
        assert_eq!(amqp_address("/q1"), Ok(("", "q1")));
        assert_eq!(amqp_address("q1"), Ok(("", "q1")));
        assert_eq!(amqp_address("fan/"), Ok(("fan", "")));
        assert!(amqp_address("/").is_err());
        assert!(amqp_address("bad exchange/k").is_err());
        assert!(amqp_address("amq.gen-1/k").is_err());
        assert!(amqp_address(&format!("/{}", "k".repeat(256))).is_err());
    }

    #[test]
    fn nats_subjects_are_plain_tokens() {
        assert!(nats_subject("orders.eu.42").is_ok());
        for bad in ["", "a..b", ".a", "a.", "a b", "a.*", "a.>"] {
            assert!(nats_subject(bad).is_err(), "{bad}");
        }
    }
}
