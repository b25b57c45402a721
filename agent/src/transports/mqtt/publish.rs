//! Outgoing PUBLISH packets, encoded by their sender straight from the
//! envelope, for both protocol versions.
//!
//! Before, a send built rumqttc's `PublishProperties` (an owned copy of every
//! header, the content type and the topic) and the event loop encoded that;
//! now the sender writes the packet once, and the event loop copies it into
//! its write buffer with the packet id filled in (`docs/benchmarks.md`,
//! issue 15, session 35).
//!
//! Invariants:
//!
//! - **The bytes are rumqttc's.** A packet is what rumqttc's encoder writes
//!   for the same publish (v5 properties in its order: message expiry
//!   interval, user properties, content type), with the packet id 0 until
//!   [`Publish::write`] fills it in; the tests compare the two byte for byte.
//! - **Nothing malformed is written.** Every string (header key and value,
//!   content type) passes `ferry_shared::mqtt_string::problem` — at most 65 535 bytes,
//!   no NUL, no control character or non-character, which Mosquitto refuses
//!   as malformed — and the remaining length fits its four bytes. A message
//!   that breaks one of these can never be sent, so it is a permanent error
//!   naming the header: the DLQ takes it. (rumqttc's encoder wrapped a longer
//!   string's length and checked no characters, and the broker closed the
//!   connection on the packet, at every retry.) The topic is checked by the
//!   sender (`settings::topic_problem`).
//! - **The size is exact.** [`Publish::len`] is what the packet takes on the
//!   wire, the figure checked against the maximum packet size.
//! - The payload is shared with the envelope, copied only into the write
//!   buffer.

use std::time::SystemTime;

use ferry_shared::envelope::Envelope;
use ferry_shared::mqtt_string;
use prost::bytes::{BufMut, Bytes, BytesMut};

use super::settings::Qos;
use crate::transports::SendError;
use crate::transports::headers::{outgoing, remaining};

/// The largest remaining length MQTT can express (four bytes of 7 bits).
const MAX_REMAINING: usize = 268_435_455;
const MESSAGE_EXPIRY_INTERVAL: u8 = 0x02;
const CONTENT_TYPE: u8 = 0x03;
const USER_PROPERTY: u8 = 0x26;

/// A PUBLISH packet waiting for its packet id.
#[derive(Debug)]
pub(crate) struct Publish {
    /// The fixed header, the topic, the packet id slot (QoS 1 and 2) and the
    /// v5 properties.
    head: Vec<u8>,
    /// Where the packet id sits in `head`; `None` for QoS 0.
    pkid_at: Option<usize>,
    pub qos: Qos,
    payload: Bytes,
}

impl Publish {
    /// A v5 publish of `envelope` on `topic`, its properties from the
    /// envelope: the outgoing headers as user properties, the content type,
    /// and the time it has left at `now` (rounded up, so a message is never
    /// cut shorter than it had left) as message expiry interval. An expired
    /// envelope is a permanent error: it can never be delivered in time.
    pub fn v5(
        topic: &str,
        qos: Qos,
        retain: bool,
        envelope: &Envelope,
        now: SystemTime,
    ) -> Result<Self, SendError> {
        let expiry = remaining(envelope, now)?.map(|left| {
            let secs = left.as_secs() + u64::from(left.subsec_nanos() > 0);
            u32::try_from(secs).unwrap_or(u32::MAX)
        });
        let headers = outgoing(envelope);
        let content_type = envelope.content_type.as_deref();
        let mut properties = expiry.map_or(0, |_| 1 + 4);
        for (key, value) in headers.clone() {
            properties += 1
                + string_len(key, || format!("the header key {}", shown(key)))?
                + string_len(value, || format!("the value of header {}", shown(key)))?;
        }
        if let Some(c) = content_type {
            properties += 1 + string_len(c, || "the content type".to_owned())?;
        }
        let payload = envelope.payload.len();
        let mut head = Head::new(
            topic,
            qos,
            retain,
            varint_len(properties) + properties,
            payload,
        )?;
        put_varint(&mut head.bytes, properties);
        if let Some(secs) = expiry {
            head.bytes.push(MESSAGE_EXPIRY_INTERVAL);
            head.bytes.put_u32(secs);
        }
        for (key, value) in headers {
            head.bytes.push(USER_PROPERTY);
            put_string(&mut head.bytes, key);
            put_string(&mut head.bytes, value);
        }
        if let Some(c) = content_type {
            head.bytes.push(CONTENT_TYPE);
            put_string(&mut head.bytes, c);
        }
        Ok(head.finish(&envelope.payload))
    }

    /// A v3.1.1 publish of `envelope` on `topic`: no properties, so only the
    /// payload travels (and an expired envelope is a permanent error, as in
    /// v5).
    pub fn v311(
        topic: &str,
        qos: Qos,
        retain: bool,
        envelope: &Envelope,
        now: SystemTime,
    ) -> Result<Self, SendError> {
        remaining(envelope, now)?;
        let payload = envelope.payload.len();
        Ok(Head::new(topic, qos, retain, 0, payload)?.finish(&envelope.payload))
    }

    /// The packet's size on the wire.
    pub fn len(&self) -> usize {
        self.head.len() + self.payload.len()
    }

    /// Appends the packet with packet id `pkid` (0 for QoS 0 only).
    pub fn write(&self, pkid: u16, buf: &mut BytesMut) {
        debug_assert_eq!(
            pkid == 0,
            self.pkid_at.is_none(),
            "a packet id for QoS 1 and 2 only"
        );
        buf.reserve(self.len());
        let start = buf.len();
        buf.extend_from_slice(&self.head);
        if let Some(at) = self.pkid_at {
            buf[start + at..start + at + 2].copy_from_slice(&pkid.to_be_bytes());
        }
        buf.extend_from_slice(&self.payload);
    }
}

/// A packet's head being written: the fixed header, the topic and the
/// packet id slot, then (v5) the properties.
struct Head {
    bytes: Vec<u8>,
    pkid_at: Option<usize>,
    qos: Qos,
}

impl Head {
    /// Starts a packet whose properties (their length included; 0 in v3.1.1)
    /// take `properties` bytes and whose payload takes `payload`.
    fn new(
        topic: &str,
        qos: Qos,
        retain: bool,
        properties: usize,
        payload: usize,
    ) -> Result<Head, SendError> {
        debug_assert!(
            topic.len() <= usize::from(u16::MAX),
            "checked by the sender"
        );
        let pkid = if qos == Qos::AtMostOnce { 0 } else { 2 };
        let remaining = 2 + topic.len() + pkid + properties + payload;
        if remaining > MAX_REMAINING {
            return Err(SendError::Oversized(format!(
                "a publish of {remaining} bytes after its fixed header exceeds MQTT's limit of \
                 {MAX_REMAINING}"
            )));
        }
        let mut bytes = Vec::with_capacity(1 + varint_len(remaining) + remaining - payload);
        bytes.push(0x30 | (qos_bits(qos) << 1) | u8::from(retain));
        put_varint(&mut bytes, remaining);
        put_string(&mut bytes, topic);
        let pkid_at = (pkid > 0).then_some(bytes.len());
        bytes.extend_from_slice(&[0, 0][..pkid]);
        Ok(Head {
            bytes,
            pkid_at,
            qos,
        })
    }

    fn finish(self, payload: &Bytes) -> Publish {
        Publish {
            head: self.bytes,
            pkid_at: self.pkid_at,
            qos: self.qos,
            payload: payload.clone(),
        }
    }
}

fn qos_bits(qos: Qos) -> u8 {
    match qos {
        Qos::AtMostOnce => 0,
        Qos::AtLeastOnce => 1,
        Qos::ExactlyOnce => 2,
    }
}

/// The encoded length of `s` as an MQTT string, or why it cannot be one
/// ([`mqtt_string::problem`]); `what` names it in the error.
fn string_len(s: &str, what: impl Fn() -> String) -> Result<usize, SendError> {
    match mqtt_string::problem(s) {
        None => Ok(2 + s.len()),
        Some(problem) => Err(SendError::Permanent(format!("{} {problem}", what()))),
    }
}

/// A header's key as an error shows it: in quotes, at most 64 characters.
fn shown(key: &str) -> String {
    let cut: String = key.chars().take(64).collect();
    if cut.len() < key.len() {
        format!("{cut:?}…")
    } else {
        format!("{cut:?}")
    }
}

/// Checked by [`string_len`] (or the sender, for the topic) first: at most
/// 65 535 bytes.
fn put_string(buf: &mut Vec<u8>, s: &str) {
    buf.put_u16(s.len() as u16);
    buf.extend_from_slice(s.as_bytes());
}

fn varint_len(n: usize) -> usize {
    match n {
        0..=127 => 1,
        128..=16_383 => 2,
        16_384..=2_097_151 => 3,
        _ => 4,
    }
}

/// MQTT's variable byte integer; `n` is at most [`MAX_REMAINING`].
fn put_varint(buf: &mut Vec<u8>, mut n: usize) {
    loop {
        let byte = (n % 128) as u8;
        n /= 128;
        if n == 0 {
            buf.push(byte);
            return;
        }
        buf.push(byte | 0x80);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use ferry_shared::envelope::MESSAGE_ID_HEADER;
    use proptest::prelude::*;
    use rumqttc::mqttbytes::v4;
    use rumqttc::v5::mqttbytes::v5;

    use super::*;
    use crate::stores::conformance::envelope;
    use crate::transports::headers::TRACEPARENT_HEADER;

    fn now() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)
    }

    fn written(publish: &Publish, pkid: u16) -> BytesMut {
        let mut buf = BytesMut::from(&b"before"[..]);
        publish.write(pkid, &mut buf);
        assert_eq!(&buf[..6], b"before", "appended, nothing overwritten");
        assert_eq!(buf.len(), 6 + publish.len(), "len is exact");
        buf.split_off(6)
    }

    /// What rumqttc writes for the same publish: the properties as the
    /// sender built them before this module, from the envelope's fields.
    fn rumqttc_v5(topic: &str, qos: Qos, retain: bool, e: &Envelope, pkid: u16) -> BytesMut {
        let expiry = e.expires_at.map(|at| {
            let left = at.duration_since(now()).unwrap_or_default();
            u32::try_from(left.as_secs() + u64::from(left.subsec_nanos() > 0)).unwrap_or(u32::MAX)
        });
        let properties = v5::PublishProperties {
            user_properties: outgoing(e)
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
            content_type: e.content_type.clone(),
            message_expiry_interval: expiry,
            ..v5::PublishProperties::default()
        };
        let qos = match qos {
            Qos::AtMostOnce => rumqttc::v5::mqttbytes::QoS::AtMostOnce,
            Qos::AtLeastOnce => rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
            Qos::ExactlyOnce => rumqttc::v5::mqttbytes::QoS::ExactlyOnce,
        };
        let mut publish = v5::Publish::new(topic, qos, e.payload.clone(), Some(properties));
        publish.retain = retain;
        publish.pkid = pkid;
        let mut buf = BytesMut::new();
        v5::Packet::Publish(publish)
            .write(&mut buf, None)
            .expect("rumqttc encodes it");
        buf
    }

    fn rumqttc_v4(topic: &str, qos: Qos, retain: bool, e: &Envelope, pkid: u16) -> BytesMut {
        let qos = match qos {
            Qos::AtMostOnce => rumqttc::mqttbytes::QoS::AtMostOnce,
            Qos::AtLeastOnce => rumqttc::mqttbytes::QoS::AtLeastOnce,
            Qos::ExactlyOnce => rumqttc::mqttbytes::QoS::ExactlyOnce,
        };
        let mut publish = v4::Publish::from_bytes(topic, qos, e.payload.clone());
        publish.retain = retain;
        publish.pkid = pkid;
        let mut buf = BytesMut::new();
        v4::Packet::Publish(publish)
            .write(&mut buf, usize::MAX)
            .expect("rumqttc encodes it");
        buf
    }

    fn qos() -> impl Strategy<Value = Qos> {
        prop_oneof![
            Just(Qos::AtMostOnce),
            Just(Qos::AtLeastOnce),
            Just(Qos::ExactlyOnce)
        ]
    }

    /// Header text MQTT can carry (no control characters or non-characters:
    /// `\\PC`), sometimes a reserved key.
    fn text() -> impl Strategy<Value = String> {
        prop_oneof![
            "\\PC{0,12}",
            Just(MESSAGE_ID_HEADER.to_owned()),
            Just(TRACEPARENT_HEADER.to_owned()),
        ]
    }

    proptest! {
        #[test]
        fn the_bytes_are_rumqttcs(
            topic in "[a-z/]{1,20}",
            qos in qos(),
            retain in any::<bool>(),
            pkid in 1..=u16::MAX,
            headers in proptest::collection::vec((text(), text()), 0..6),
            content_type in proptest::option::of("\\PC{0,20}"),
            expiry_ms in proptest::option::of(1..5_000_000_u64),
            traceparent in proptest::option::of("[0-9a-f-]{0,55}"),
            payload in proptest::collection::vec(any::<u8>(), 0..300),
        ) {
            let mut e = envelope("a");
            e.headers = headers;
            e.content_type = content_type;
            e.expires_at = expiry_ms.map(|ms| now() + Duration::from_millis(ms));
            e.trace.traceparent = traceparent;
            e.payload = Bytes::from(payload);
            let pkid = if qos == Qos::AtMostOnce { 0 } else { pkid };
            let ours = Publish::v5(&topic, qos, retain, &e, now()).expect("valid");
            prop_assert_eq!(written(&ours, pkid), rumqttc_v5(&topic, qos, retain, &e, pkid));
            let ours = Publish::v311(&topic, qos, retain, &e, now()).expect("valid");
            prop_assert_eq!(written(&ours, pkid), rumqttc_v4(&topic, qos, retain, &e, pkid));
        }
    }

    /// Remaining lengths at each boundary of the variable byte integer, as
    /// rumqttc's decoder reads them back.
    #[test]
    fn remaining_lengths_at_every_width() {
        for payload in [
            0, 100, 121, 122, 16_000, 16_378, 16_379, 2_097_146, 2_097_147,
        ] {
            let mut e = envelope("a");
            e.payload = Bytes::from(vec![1; payload]);
            let p = Publish::v311("t", Qos::AtLeastOnce, false, &e, now()).expect("valid");
            let mut buf = written(&p, 9);
            match v4::Packet::read(&mut buf, usize::MAX) {
                Ok(v4::Packet::Publish(read)) => {
                    assert_eq!((read.pkid, read.payload.len()), (9, payload));
                }
                other => panic!("{payload}: {other:?}"),
            }
            assert!(buf.is_empty(), "{payload}: the whole packet was read");
        }
    }

    #[test]
    fn the_properties_are_the_envelopes() {
        let mut e = envelope("a");
        e.headers = vec![
            ("b".into(), "2".into()),
            (MESSAGE_ID_HEADER.into(), "forged".into()),
            ("a".into(), "1".into()),
        ];
        e.trace.traceparent = Some("00-abc-def-01".into());
        e.content_type = Some("application/json".into());
        e.expires_at = Some(now() + Duration::from_millis(59_500));
        let p = Publish::v5("t", Qos::AtLeastOnce, false, &e, now()).expect("valid");
        let mut buf = written(&p, 3);
        let Ok(v5::Packet::Publish(read)) = v5::Packet::read(&mut buf, None) else {
            panic!("a publish");
        };
        let props = read.properties.unwrap_or_default();
        let pairs: Vec<(&str, &str)> = props
            .user_properties
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        // Reserved keys are written once, from the envelope's fields.
        assert_eq!(
            pairs,
            [
                ("b", "2"),
                ("a", "1"),
                (MESSAGE_ID_HEADER, e.id.as_str()),
                (TRACEPARENT_HEADER, "00-abc-def-01")
            ]
        );
        assert_eq!(props.content_type.as_deref(), Some("application/json"));
        // Rounded up: never cut shorter than it had left.
        assert_eq!(props.message_expiry_interval, Some(60));
    }

    #[test]
    fn an_expired_envelope_is_not_sent() {
        let mut e = envelope("a");
        e.expires_at = Some(now());
        for p in [
            Publish::v5("t", Qos::AtLeastOnce, false, &e, now()),
            Publish::v311("t", Qos::AtLeastOnce, false, &e, now()),
        ] {
            assert!(p.is_err_and(|e| e.is_permanent()));
        }
    }

    /// Property and remaining lengths on both sides of each width of MQTT's
    /// variable byte integer (1 → 2 bytes at 128, 2 → 3 at 16 384), byte for
    /// byte as rumqttc writes them.
    #[test]
    fn lengths_at_every_varint_boundary_are_rumqttcs() {
        let mut e = envelope("a");
        e.trace = Default::default();
        for len in (40..=140).chain(16_250..=16_400) {
            e.headers = vec![("k".into(), "x".repeat(len))];
            let ours = Publish::v5("t", Qos::AtLeastOnce, false, &e, now()).expect("valid");
            assert_eq!(
                written(&ours, 5),
                rumqttc_v5("t", Qos::AtLeastOnce, false, &e, 5),
                "a header value of {len} bytes"
            );
        }
    }

    /// The largest remaining length MQTT can express is accepted, one byte
    /// more is refused as oversized (checked on the head alone: no payload
    /// of 256 MiB is made).
    #[test]
    fn the_remaining_length_limit() {
        // Topic "t" (2 + 1 bytes) and a packet id (2): the payload takes the rest.
        let fits = MAX_REMAINING - 5;
        let head = Head::new("t", Qos::AtLeastOnce, false, 0, fits).map(|h| h.bytes);
        assert_eq!(
            head.ok().map(|b| b[..5].to_vec()),
            Some(vec![0x32, 0xff, 0xff, 0xff, 0x7f])
        );
        assert!(matches!(
            Head::new("t", Qos::AtLeastOnce, false, 0, fits + 1),
            Err(SendError::Oversized(_))
        ));
    }

    /// A string MQTT cannot carry is a permanent error naming it, not a
    /// malformed packet; v3.1.1 carries no headers, so it sends them.
    #[test]
    fn a_header_mqtt_cannot_carry_is_a_permanent_error() {
        let long = "x".repeat(65_536);
        let cases = [
            (
                ("k".to_owned(), long.clone()),
                None,
                "the value of header \"k\" is 65536 bytes",
            ),
            (
                (long.clone(), "v".to_owned()),
                None,
                "the header key \"xxxx",
            ),
            (
                ("a\0b".to_owned(), "v".to_owned()),
                None,
                "the header key \"a\\0b\" contains NUL",
            ),
            (
                ("k".to_owned(), "a\tb".to_owned()),
                None,
                "the value of header \"k\" contains a control character (U+0009)",
            ),
            (
                ("k".to_owned(), "v".to_owned()),
                Some(long.clone()),
                "the content type is 65536",
            ),
            (
                ("k".to_owned(), "v".to_owned()),
                Some("text/\u{ffff}".to_owned()),
                "the content type contains a Unicode non-character (U+FFFF)",
            ),
        ];
        for (header, content_type, error) in cases {
            let mut e = envelope("a");
            e.headers = vec![header];
            e.content_type = content_type;
            match Publish::v5("t", Qos::AtLeastOnce, false, &e, now()) {
                Err(SendError::Permanent(message)) => {
                    assert!(message.starts_with(error), "{message}");
                }
                other => panic!("{error}: {other:?}"),
            }
            assert!(Publish::v311("t", Qos::AtLeastOnce, false, &e, now()).is_ok());
        }
        // Exactly 65 535 bytes is an MQTT string.
        let mut e = envelope("a");
        e.headers = vec![("k".into(), "x".repeat(65_535))];
        assert!(Publish::v5("t", Qos::AtLeastOnce, false, &e, now()).is_ok());
    }
}
