//! The envelope: one message inside Ferry (DESIGN §4.1).
//!
//! Receivers build it, routes and drainers carry it, the outbox and the DLQ
//! store it, and the gRPC API shows it. All of them share one wire form, the
//! generated [`api::v1::Envelope`](crate::api::v1::Envelope) message; the
//! storage encoding ([`Envelope::encode`]) is that message behind a one-byte
//! format version, so a future layout can be told apart from today's rows.
//!
//! Decoding never panics: bytes that are not a valid envelope of a known
//! format return an [`EnvelopeError`].

use std::time::SystemTime;

use prost::Message;
use prost::bytes::Bytes;

use crate::api::v1 as pb;

/// Header carrying the stable message id on every outgoing copy, so the next
/// hop or the consumer can deduplicate. An incoming message keeps the id it
/// carries only where its receiver trusts it (`trust_message_id`, a hop from
/// another Ferry agent); elsewhere it gets a fresh one.
pub const MESSAGE_ID_HEADER: &str = "ferry-message-id";
/// The prefix of the headers Ferry writes itself; an untrusted receiver drops
/// incoming headers with it.
pub const RESERVED_HEADER_PREFIX: &str = "ferry-";

/// The first byte of [`Envelope::encode`]'s output: the layout that follows.
const FORMAT_V1: u8 = 1;

/// One message inside Ferry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Envelope {
    /// Stable message id: a UUIDv7 assigned at receive, or the incoming
    /// `ferry-message-id` header where the receiver trusts it. Never empty.
    pub id: String,
    /// Ordered header pairs (MQTT v5 user properties, SQS message
    /// attributes); keys may repeat.
    pub headers: Vec<(String, String)>,
    /// The message body, untouched.
    pub payload: Bytes,
    /// MIME type of the payload when the source declared one.
    pub content_type: Option<String>,
    /// Where and when the message entered Ferry.
    pub source: Source,
    /// When the message stops being worth delivering; `None` never expires.
    pub expires_at: Option<SystemTime>,
    /// W3C trace context of the delivery.
    pub trace: TraceContext,
}

/// The origin of an envelope.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    /// Transport the message came in on: `mqtt`, `sqs`, ...
    pub transport: String,
    /// Id of the session that received it.
    pub session_id: String,
    /// Topic or queue it was received from.
    pub address: String,
    /// When the receiver took it off the wire.
    pub received_at: SystemTime,
}

impl Source {
    /// A message's origin: the transport, the receiving session, the topic or queue, and when.
    pub fn new(transport: &str, session_id: &str, address: &str, received_at: SystemTime) -> Self {
        Source {
            transport: transport.to_owned(),
            session_id: session_id.to_owned(),
            address: address.to_owned(),
            received_at,
        }
    }
}

/// W3C trace context (`traceparent` / `tracestate`); both absent when the
/// message is not traced.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TraceContext {
    /// The `traceparent` value.
    pub traceparent: Option<String>,
    /// The `tracestate` value.
    pub tracestate: Option<String>,
}

/// Why bytes or a protobuf message are not a valid envelope.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    /// Nothing to decode.
    #[error("empty envelope encoding")]
    Empty,
    /// The format byte names a layout this build does not know.
    #[error("unknown envelope format version {0}")]
    UnknownFormat(u8),
    /// The protobuf body does not decode.
    #[error("undecodable envelope: {0}")]
    Decode(String),
    /// A required field is missing or empty.
    #[error("envelope field `{0}` is missing")]
    Missing(&'static str),
    /// A timestamp is outside what `SystemTime` can hold.
    #[error("envelope field `{0}` is not a valid timestamp")]
    BadTimestamp(&'static str),
}

impl Envelope {
    /// A message with `id`, `payload` and its `source`, and nothing else yet: no headers,
    /// content type, expiry or trace context (set them, or use struct-update syntax).
    pub fn new(id: impl Into<String>, payload: impl Into<Bytes>, source: Source) -> Self {
        Envelope {
            id: id.into(),
            headers: Vec::new(),
            payload: payload.into(),
            content_type: None,
            source,
            expires_at: None,
            trace: TraceContext::default(),
        }
    }

    /// The envelope with `headers` appended, in order.
    pub fn with_headers(mut self, headers: &[(&str, &str)]) -> Self {
        self.headers.extend(
            headers
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        );
        self
    }

    /// The first value of header `key` (exact, case-sensitive match).
    pub fn header(&self, key: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// True when the envelope has an expiry and `now` has reached it.
    pub fn is_expired(&self, now: SystemTime) -> bool {
        self.expires_at.is_some_and(|at| at <= now)
    }

    /// The storage encoding: a format byte, then the protobuf message.
    pub fn encode(&self) -> Vec<u8> {
        encode_v1(&pb::Envelope::from(self))
    }

    /// [`Envelope::encode`] of an envelope not needed afterwards: its text
    /// fields move into the encoding instead of being copied (the outbox's
    /// append, once per message).
    pub fn into_encoded(self) -> Vec<u8> {
        encode_v1(&pb::Envelope::from(self))
    }

    /// Decodes [`Envelope::encode`]'s output.
    pub fn decode(bytes: &[u8]) -> Result<Self, EnvelopeError> {
        let (&format, body) = bytes.split_first().ok_or(EnvelopeError::Empty)?;
        if format != FORMAT_V1 {
            return Err(EnvelopeError::UnknownFormat(format));
        }
        let message =
            pb::Envelope::decode(body).map_err(|e| EnvelopeError::Decode(e.to_string()))?;
        Envelope::try_from(message)
    }
}

impl From<&Envelope> for pb::Envelope {
    fn from(e: &Envelope) -> Self {
        pb::Envelope::from(e.clone())
    }
}

impl From<Envelope> for pb::Envelope {
    fn from(e: Envelope) -> Self {
        pb::Envelope {
            id: e.id,
            headers: e
                .headers
                .into_iter()
                .map(|(key, value)| pb::Header { key, value })
                .collect(),
            payload: Vec::from(e.payload),
            content_type: e.content_type.unwrap_or_default(),
            source: Some(pb::Source {
                transport: e.source.transport,
                session_id: e.source.session_id,
                address: e.source.address,
                received_at: Some(e.source.received_at.into()),
            }),
            expires_at: e.expires_at.map(Into::into),
            trace: Some(pb::TraceContext {
                traceparent: e.trace.traceparent.unwrap_or_default(),
                tracestate: e.trace.tracestate.unwrap_or_default(),
            }),
        }
    }
}

/// The storage encoding of `message`: the format byte, then the protobuf.
fn encode_v1(message: &pb::Envelope) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + message.encoded_len());
    out.push(FORMAT_V1);
    // Writing into a Vec cannot run out of space, so this cannot fail;
    // `encode_raw` states that without a Result.
    message.encode_raw(&mut out);
    out
}

impl TryFrom<pb::Envelope> for Envelope {
    type Error = EnvelopeError;

    fn try_from(m: pb::Envelope) -> Result<Self, Self::Error> {
        if m.id.is_empty() {
            return Err(EnvelopeError::Missing("id"));
        }
        let source = m.source.ok_or(EnvelopeError::Missing("source"))?;
        let received_at = source
            .received_at
            .ok_or(EnvelopeError::Missing("source.received_at"))?;
        let trace = m.trace.unwrap_or_default();
        Ok(Envelope {
            id: m.id,
            headers: m.headers.into_iter().map(|h| (h.key, h.value)).collect(),
            payload: Bytes::from(m.payload),
            content_type: non_empty(m.content_type),
            source: Source {
                transport: source.transport,
                session_id: source.session_id,
                address: source.address,
                received_at: to_system_time(received_at, "source.received_at")?,
            },
            expires_at: m
                .expires_at
                .map(|t| to_system_time(t, "expires_at"))
                .transpose()?,
            trace: TraceContext {
                traceparent: non_empty(trace.traceparent),
                tracestate: non_empty(trace.tracestate),
            },
        })
    }
}

/// Proto3 has no optional strings: empty means absent.
fn non_empty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

fn to_system_time(
    t: prost_types::Timestamp,
    field: &'static str,
) -> Result<SystemTime, EnvelopeError> {
    SystemTime::try_from(t).map_err(|_| EnvelopeError::BadTimestamp(field))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use proptest::prelude::*;

    use super::*;

    fn sample() -> Envelope {
        Envelope {
            id: "0190c0de-0000-7000-8000-000000000001".into(),
            headers: vec![
                ("b".into(), "2".into()),
                ("a".into(), "1".into()),
                ("b".into(), "3".into()),
            ],
            payload: Bytes::from_static(b"\x00hello\xff"),
            content_type: Some("application/json".into()),
            source: Source {
                transport: "mqtt".into(),
                session_id: "mqtt-conn".into(),
                address: "sensors/1".into(),
                received_at: SystemTime::UNIX_EPOCH + Duration::new(1_700_000_000, 123_456_789),
            },
            expires_at: Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000)),
            trace: TraceContext {
                traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
                tracestate: None,
            },
        }
    }

    #[test]
    fn round_trips_with_header_order_and_nanoseconds() {
        let e = sample();
        assert_eq!(Envelope::decode(&e.encode()), Ok(e.clone()));
        assert_eq!(e.header("b"), Some("2"));
    }

    #[test]
    fn bad_bytes_are_errors() {
        assert_eq!(Envelope::decode(&[]), Err(EnvelopeError::Empty));
        assert_eq!(
            Envelope::decode(&[9, 1, 2]),
            Err(EnvelopeError::UnknownFormat(9))
        );
        assert!(matches!(
            Envelope::decode(&[FORMAT_V1, 0xff, 0xff]),
            Err(EnvelopeError::Decode(_))
        ));
        // A valid protobuf without the required fields.
        assert_eq!(
            Envelope::decode(&[FORMAT_V1]),
            Err(EnvelopeError::Missing("id"))
        );
    }

    #[test]
    fn expiry() {
        let e = sample();
        let at = e.expires_at.unwrap_or(SystemTime::UNIX_EPOCH);
        assert!(!e.is_expired(at - Duration::from_nanos(1)));
        assert!(e.is_expired(at));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Envelope::decode(&bytes);
        }

        #[test]
        fn round_trips(
            id in "[a-z0-9-]{1,40}",
            headers in proptest::collection::vec(("[a-z]{0,8}", ".{0,8}"), 0..5),
            payload in proptest::collection::vec(any::<u8>(), 0..64),
            secs in 0u64..4_000_000_000,
            nanos in 0u32..1_000_000_000,
        ) {
            let mut e = sample();
            e.id = id;
            e.headers = headers;
            e.payload = Bytes::from(payload);
            e.source.received_at = SystemTime::UNIX_EPOCH + Duration::new(secs, nanos);
            prop_assert_eq!(Envelope::decode(&e.encode()), Ok(e));
        }
    }
}
