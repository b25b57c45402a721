//! The envelope of a received publish, from its MQTT v5 properties.
//!
//! Every user property becomes a header, in order, except that a
//! receiver that does not trust message ids (the default) drops every
//! `ferry-*` one and gives the message a new UUIDv7 id. A receiver with
//! `trust_message_id` (a hop from another Ferry agent) keeps them all and
//! makes `ferry-message-id` the envelope id (a new UUIDv7 when absent or
//! empty). Why not trust by default: the id is what consumers deduplicate by
//! and what DLQ ids are built from, so a forged header, or a consumer
//! republishing what it received, would make two different messages share
//! one id and the second be dropped as a duplicate.
//! `traceparent` / `tracestate` become the trace context; content type and
//! message expiry interval become `content_type` and `expires_at`.
//!
//! The way back, from an envelope to the properties of a publish Ferry sends,
//! is `publish`.

use std::time::{Duration, SystemTime};

use ferry_shared::envelope::{
    Envelope, MESSAGE_ID_HEADER, RESERVED_HEADER_PREFIX, Source, TraceContext,
};
use prost::bytes::Bytes;

use super::protocol::Received;
use crate::transports::Defect;

pub use crate::transports::headers::{TRACEPARENT_HEADER, TRACESTATE_HEADER};

/// Builds the envelope of a received publish, and its defect if it cannot be
/// forwarded as it is.
pub(crate) fn envelope_from(
    received: Received,
    session_id: &str,
    max_payload_bytes: usize,
    trust_message_id: bool,
    now: SystemTime,
) -> (Envelope, Option<Defect>) {
    let mut defect = None;
    let address = match String::from_utf8(received.topic.to_vec()) {
        Ok(topic) if !topic.is_empty() => topic,
        Ok(_) => {
            defect = Some(Defect::InvalidTopic("the topic is empty".into()));
            String::new()
        }
        Err(e) => {
            let lossy = String::from_utf8_lossy(e.as_bytes()).into_owned();
            defect = Some(Defect::InvalidTopic(format!("{lossy:?} is not UTF-8")));
            lossy
        }
    };
    if received.payload.len() > max_payload_bytes {
        defect = Some(Defect::Oversized {
            size: received.payload.len(),
            limit: max_payload_bytes,
        });
    }
    let properties = received.properties.unwrap_or_default();
    let mut headers = properties.user_properties;
    if !trust_message_id {
        headers.retain(|(k, _)| !k.starts_with(RESERVED_HEADER_PREFIX));
    }
    let first = |key: &str| {
        headers
            .iter()
            .find(|(k, v)| k == key && !v.is_empty())
            .map(|(_, v)| v.clone())
    };
    let id = first(MESSAGE_ID_HEADER).unwrap_or_else(crate::ids::new_id);
    let trace = TraceContext {
        traceparent: first(TRACEPARENT_HEADER),
        tracestate: first(TRACESTATE_HEADER),
    };
    let expires_at = properties
        .message_expiry_interval
        .and_then(|secs| now.checked_add(Duration::from_secs(u64::from(secs))));
    let envelope = Envelope {
        id,
        headers,
        // A copy, not the received view: that view shares the connection's
        // read buffer (32 KiB or more per read), and a delivery waiting in
        // the receiver's queue would keep the whole buffer alive — a few
        // packets per read made each waiting delivery cost kilobytes
        // (`docs/benchmarks.md`, 2026-12-02, session 27).
        payload: Bytes::copy_from_slice(&received.payload),
        content_type: properties.content_type.filter(|c| !c.is_empty()),
        source: Source {
            transport: "mqtt".into(),
            session_id: session_id.to_owned(),
            address,
            received_at: now,
        },
        expires_at,
        trace,
    };
    (envelope, defect)
}

#[cfg(test)]
mod tests {
    use rumqttc::v5::mqttbytes::v5::PublishProperties;

    use super::*;
    use crate::transports::mqtt::settings::Qos;

    fn received(properties: Option<PublishProperties>) -> Received {
        Received {
            topic: Bytes::from_static(b"sensors/1"),
            qos: Qos::AtLeastOnce,
            pkid: 7,
            dup: false,
            payload: Bytes::from_static(b"hello"),
            properties,
        }
    }

    /// The envelope owns its payload: a view into the connection's read
    /// buffer would keep the whole buffer alive while the delivery waits.
    #[test]
    fn the_payload_is_copied_out_of_the_read_buffer() {
        let read_buffer = Bytes::from(vec![7_u8; 32 * 1024]);
        let received = Received {
            payload: read_buffer.slice(100..356),
            ..received(None)
        };
        let (envelope, defect) = envelope_from(received, "s", 1024, false, SystemTime::now());
        assert_eq!((envelope.payload.len(), defect), (256, None));
        assert!(
            !read_buffer
                .as_ptr_range()
                .contains(&envelope.payload.as_ptr()),
            "the payload still points into the read buffer"
        );
    }

    #[test]
    fn v5_properties_become_the_envelope() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let props = PublishProperties {
            user_properties: vec![
                ("b".into(), "2".into()),
                (MESSAGE_ID_HEADER.into(), "id-1".into()),
                ("a".into(), "1".into()),
                (TRACEPARENT_HEADER.into(), "00-abc-def-01".into()),
                ("b".into(), "3".into()),
            ],
            content_type: Some("application/json".into()),
            message_expiry_interval: Some(60),
            ..PublishProperties::default()
        };
        let (e, defect) = envelope_from(received(Some(props)), "in", 1024, true, now);
        assert_eq!(defect, None);
        assert_eq!(e.id, "id-1");
        assert_eq!(e.headers.len(), 5);
        assert_eq!(e.headers[0], ("b".into(), "2".into()));
        assert_eq!(e.headers[4], ("b".into(), "3".into()));
        assert_eq!(e.content_type.as_deref(), Some("application/json"));
        assert_eq!(e.expires_at, Some(now + Duration::from_secs(60)));
        assert_eq!(e.trace.traceparent.as_deref(), Some("00-abc-def-01"));
        assert_eq!(e.source.address, "sensors/1");
        assert_eq!(e.source.session_id, "in");
        assert_eq!(e.source.received_at, now);
    }

    #[test]
    fn an_untrusted_receiver_drops_ferry_headers_and_assigns_a_new_id() {
        let now = SystemTime::now();
        let props = || PublishProperties {
            user_properties: vec![
                (MESSAGE_ID_HEADER.into(), "forged".into()),
                ("ferry-other".into(), "x".into()),
                ("a".into(), "1".into()),
                (TRACEPARENT_HEADER.into(), "00-abc-def-01".into()),
            ],
            ..PublishProperties::default()
        };
        let (e1, _) = envelope_from(received(Some(props())), "in", 1024, false, now);
        let (e2, _) = envelope_from(received(Some(props())), "in", 1024, false, now);
        assert_ne!(e1.id, "forged");
        assert_ne!(e1.id, e2.id, "two messages, two ids");
        let keys: Vec<&str> = e1.headers.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["a", TRACEPARENT_HEADER]);
        assert_eq!(e1.trace.traceparent.as_deref(), Some("00-abc-def-01"));
        // Trusted: the id and the ferry-* headers are kept.
        let (t, _) = envelope_from(received(Some(props())), "in", 1024, true, now);
        assert_eq!(t.id, "forged");
        assert_eq!(t.headers.len(), 4);
    }

    #[test]
    fn without_properties_a_new_v7_id() {
        let now = SystemTime::now();
        let (e, _) = envelope_from(received(None), "in", 1024, false, now);
        let id = uuid::Uuid::parse_str(&e.id).ok();
        assert_eq!(id.map(|u| u.get_version_num()), Some(7));
        assert!(e.headers.is_empty());
        assert_eq!(e.expires_at, None);
    }

    #[test]
    fn defects() {
        let now = SystemTime::now();
        let (_, defect) = envelope_from(received(None), "in", 4, false, now);
        assert_eq!(defect, Some(Defect::Oversized { size: 5, limit: 4 }));
        let mut bad = received(None);
        bad.topic = Bytes::from_static(b"a/\xff");
        let (e, defect) = envelope_from(bad, "in", 1024, false, now);
        assert!(matches!(defect, Some(Defect::InvalidTopic(_))));
        assert!(e.source.address.starts_with("a/"));
    }
}
