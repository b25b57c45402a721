//! Envelope ⇄ SQS / SNS message: body, message attributes, FIFO ids, size.
//!
//! Outgoing (both services):
//!
//! - the body is the payload, which must be UTF-8 text (SQS and SNS carry
//!   text); anything else is a permanent error;
//! - at most [`MAX_ATTRIBUTES`] `String` attributes, in this priority:
//!   `ferry-message-id` (the envelope id, always), `traceparent`,
//!   `tracestate`, then the headers in order. A header is left out when its
//!   name was already used (the first of repeated keys wins), when the name
//!   is not a valid attribute name (1–256 of `A-Za-z0-9_-.`, no leading,
//!   trailing or doubled period, no `AWS.`/`Amazon.` prefix) or its value is
//!   empty, and once the limit is reached. Left-out headers are counted in a
//!   debug log line, the message is still sent;
//! - body plus attributes (name, type and value) must fit in
//!   [`MAX_MESSAGE_BYTES`]; a larger message is [`SendError::Oversized`];
//! - FIFO: the group id from `message_group_id` (fixed, or the value of the
//!   header `{header:NAME}` names; a message without that header is a
//!   permanent error) and the envelope id as deduplication id, so a resend
//!   within SQS's five-minute window is dropped by the service;
//! - an envelope whose expiry has passed is a permanent error, as for MQTT.
//!
//! Incoming (SQS): every `String` and `Number` attribute becomes a header,
//! sorted by name (SQS does not keep their order); `Binary` attributes are
//! skipped. `ferry-*` attributes are dropped, as by an MQTT receiver that does
//! not trust message ids: the envelope id is the SQS message id, which stays
//! the same on every redelivery of a message. `traceparent` / `tracestate`
//! become the trace context (and stay headers, as for MQTT).

use std::time::SystemTime;

use ferry_shared::config::GroupId;
use ferry_shared::envelope::{Envelope, MESSAGE_ID_HEADER, RESERVED_HEADER_PREFIX, TraceContext};

use crate::transports::SendError;
use crate::transports::mqtt::{TRACEPARENT_HEADER, TRACESTATE_HEADER};

/// Most message attributes SQS and SNS accept per message.
pub const MAX_ATTRIBUTES: usize = 10;

/// The largest message (body and attributes) SQS and SNS accept, and the
/// largest total of one batch call.
pub const MAX_MESSAGE_BYTES: usize = 256 * 1024;

/// The data type of every attribute Ferry writes.
pub(crate) const STRING: &str = "String";

/// A message ready for a batch entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Outgoing {
    pub body: String,
    pub attributes: Vec<(String, String)>,
    pub group_id: Option<String>,
    pub dedup_id: Option<String>,
    /// Body plus attributes, as the services count it.
    pub size: usize,
}

/// Builds the message of `envelope`; `fifo`: the queue or topic is FIFO.
pub(crate) fn outgoing(
    envelope: &Envelope,
    fifo: bool,
    group: Option<&GroupId>,
    now: SystemTime,
) -> Result<Outgoing, SendError> {
    if envelope.is_expired(now) {
        return Err(SendError::Permanent(
            "the message expired before it was sent".into(),
        ));
    }
    let body = std::str::from_utf8(&envelope.payload)
        .map_err(|e| {
            SendError::Permanent(format!(
                "the payload is not UTF-8 text, which SQS and SNS require: {e}"
            ))
        })?
        .to_owned();
    let (attributes, left_out) = attributes(envelope);
    if left_out > 0 {
        tracing::debug!(
            message_id = %envelope.id,
            left_out,
            "headers left out of the message attributes"
        );
    }
    let size = body.len()
        + attributes
            .iter()
            .map(|(k, v)| k.len() + STRING.len() + v.len())
            .sum::<usize>();
    if size > MAX_MESSAGE_BYTES {
        return Err(SendError::Oversized(format!(
            "{size} bytes of body and attributes exceed the limit of {MAX_MESSAGE_BYTES}"
        )));
    }
    let (group_id, dedup_id) = if fifo {
        let group = match group {
            Some(GroupId::Fixed(id)) => id.clone(),
            Some(GroupId::Header(name)) => envelope
                .header(name)
                .filter(|v| !v.is_empty())
                .ok_or_else(|| {
                    SendError::Permanent(format!(
                        "the message has no header {name:?} to take its FIFO group id from"
                    ))
                })?
                .to_owned(),
            None => {
                return Err(SendError::Permanent(
                    "a FIFO destination needs message_group_id".into(),
                ));
            }
        };
        (Some(group), Some(envelope.id.clone()))
    } else {
        (None, None)
    };
    Ok(Outgoing {
        body,
        attributes,
        group_id,
        dedup_id,
        size,
    })
}

/// The attributes of `envelope` in priority order, and how many headers were
/// left out.
fn attributes(envelope: &Envelope) -> (Vec<(String, String)>, usize) {
    let mut out: Vec<(String, String)> = Vec::with_capacity(MAX_ATTRIBUTES);
    out.push((MESSAGE_ID_HEADER.to_owned(), envelope.id.clone()));
    let trace = [
        (TRACEPARENT_HEADER, &envelope.trace.traceparent),
        (TRACESTATE_HEADER, &envelope.trace.tracestate),
    ];
    for (key, value) in trace {
        if let Some(v) = value.as_ref().filter(|v| !v.is_empty()) {
            out.push((key.to_owned(), v.clone()));
        }
    }
    let mut left_out = 0;
    for (key, value) in &envelope.headers {
        let reserved =
            key == MESSAGE_ID_HEADER || key == TRACEPARENT_HEADER || key == TRACESTATE_HEADER;
        if reserved {
            continue;
        }
        if out.len() == MAX_ATTRIBUTES
            || value.is_empty()
            || !valid_attribute_name(key)
            || out.iter().any(|(k, _)| k == key)
        {
            left_out += 1;
            continue;
        }
        out.push((key.clone(), value.clone()));
    }
    (out, left_out)
}

/// SQS's and SNS's rule for message attribute names.
fn valid_attribute_name(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    !name.is_empty()
        && name.len() <= 256
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        && !name.starts_with('.')
        && !name.ends_with('.')
        && !name.contains("..")
        && !lower.starts_with("aws.")
        && !lower.starts_with("amazon.")
}

/// Headers and trace context from received attributes (`(name, value)` of
/// the `String` and `Number` ones).
pub(crate) fn incoming(
    attributes: impl IntoIterator<Item = (String, String)>,
) -> (Vec<(String, String)>, TraceContext) {
    let mut headers: Vec<(String, String)> = attributes
        .into_iter()
        .filter(|(k, _)| !k.starts_with(RESERVED_HEADER_PREFIX))
        .collect();
    headers.sort();
    let find = |key: &str| {
        headers
            .iter()
            .find(|(k, v)| k == key && !v.is_empty())
            .map(|(_, v)| v.clone())
    };
    let trace = TraceContext {
        traceparent: find(TRACEPARENT_HEADER),
        tracestate: find(TRACESTATE_HEADER),
    };
    (headers, trace)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use ferry_shared::envelope::Source;
    use prost::bytes::Bytes;

    use super::*;

    fn envelope(headers: &[(&str, &str)], payload: &'static [u8]) -> Envelope {
        let source = Source::new("mqtt", "in", "a/b", SystemTime::UNIX_EPOCH);
        let mut e =
            Envelope::new("id-1", Bytes::from_static(payload), source).with_headers(headers);
        e.trace.traceparent = Some("00-abc-def-01".into());
        e
    }

    #[test]
    fn attributes_in_priority_order_up_to_ten() {
        let mut headers = vec![
            ("traceparent", "ignored"),
            ("bad name", "x"),
            ("empty", ""),
            ("a", "1"),
            ("a", "2"),
        ];
        let names: Vec<String> = (0..12).map(|i| format!("h{i}")).collect();
        headers.extend(names.iter().map(|n| (n.as_str(), "v")));
        let out =
            outgoing(&envelope(&headers, b"hi"), false, None, SystemTime::now()).expect("valid");
        let keys: Vec<&str> = out.attributes.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            [
                "ferry-message-id",
                "traceparent",
                "a",
                "h0",
                "h1",
                "h2",
                "h3",
                "h4",
                "h5",
                "h6"
            ]
        );
        assert_eq!(out.attributes[1].1, "00-abc-def-01");
        assert_eq!(out.attributes[2].1, "1");
        assert_eq!(out.group_id, None);
    }

    #[test]
    fn fifo_group_from_a_header_and_dedup_by_id() {
        let e = envelope(&[("device", "d-7")], b"hi");
        let group = GroupId::Header("device".into());
        let out = outgoing(&e, true, Some(&group), SystemTime::now()).expect("valid");
        assert_eq!(out.group_id.as_deref(), Some("d-7"));
        assert_eq!(out.dedup_id.as_deref(), Some("id-1"));
        let missing = GroupId::Header("zone".into());
        assert!(
            outgoing(&e, true, Some(&missing), SystemTime::now())
                .expect_err("no header")
                .is_permanent()
        );
    }

    #[test]
    fn refused_messages() {
        let now = SystemTime::now();
        assert!(matches!(
            outgoing(&envelope(&[], b"\xff"), false, None, now),
            Err(SendError::Permanent(_))
        ));
        let big: &'static [u8] = Box::leak(vec![b'x'; MAX_MESSAGE_BYTES].into_boxed_slice());
        assert!(matches!(
            outgoing(&envelope(&[], big), false, None, now),
            Err(SendError::Oversized(_))
        ));
        let mut expired = envelope(&[], b"hi");
        expired.expires_at = Some(now - Duration::from_secs(1));
        assert!(outgoing(&expired, false, None, now).is_err());
    }

    #[test]
    fn incoming_attributes_become_sorted_headers() {
        let (headers, trace) = incoming([
            ("z".to_owned(), "1".to_owned()),
            ("ferry-message-id".to_owned(), "forged".to_owned()),
            ("traceparent".to_owned(), "00-abc-def-01".to_owned()),
            ("a".to_owned(), "2".to_owned()),
        ]);
        assert_eq!(
            headers,
            [
                ("a".to_owned(), "2".to_owned()),
                ("traceparent".to_owned(), "00-abc-def-01".to_owned()),
                ("z".to_owned(), "1".to_owned()),
            ]
        );
        assert_eq!(trace.traceparent.as_deref(), Some("00-abc-def-01"));
    }
}
