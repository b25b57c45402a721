//! Envelope → AMQP basic properties: persistent delivery mode, the Ferry message id as
//! `message_id`, the content type, the remaining time to live as `expiration`, the receive
//! time as `timestamp`, and the outgoing headers (`headers::outgoing`, with
//! `ferry-message-id` and `traceparent`) as the AMQP header table. A header key that repeats
//! becomes an array of its values; a key longer than AMQP's 255 bytes is a permanent error.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use ferry_shared::envelope::Envelope;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};

use crate::transports::SendError;
use crate::transports::headers::{outgoing, remaining};

/// AMQP delivery mode 2: the broker writes the message to disk (on a durable queue).
const PERSISTENT: u8 = 2;

fn short(what: &str, value: &str) -> Result<ShortString, SendError> {
    ShortString::try_new(value).map_err(|_| {
        SendError::Permanent(format!(
            "{what} is {} bytes long, AMQP allows at most 255",
            value.len()
        ))
    })
}

/// The properties of `envelope` sent at `now`.
pub(crate) fn properties_for(
    envelope: &Envelope,
    now: SystemTime,
) -> Result<BasicProperties, SendError> {
    let mut table: BTreeMap<ShortString, AMQPValue> = BTreeMap::new();
    for (key, value) in outgoing(envelope) {
        let key = short(&format!("header {key:?}"), key)?;
        let value = AMQPValue::LongString(LongString::from(value.as_bytes().to_vec()));
        match table.remove(&key) {
            None => table.insert(key, value),
            Some(AMQPValue::FieldArray(mut values)) => {
                values.push(value);
                table.insert(key, AMQPValue::FieldArray(values))
            }
            Some(first) => table.insert(
                key,
                AMQPValue::FieldArray(FieldArray::from(vec![first, value])),
            ),
        };
    }
    let mut properties = BasicProperties::default()
        .with_delivery_mode(PERSISTENT)
        .with_message_id(short("the message id", &envelope.id)?)
        .with_headers(FieldTable::from(table));
    if let Some(content_type) = &envelope.content_type {
        properties = properties.with_content_type(short("the content type", content_type)?);
    }
    if let Some(left) = remaining(envelope, now)? {
        // Milliseconds, rounded up so a message is never cut shorter than it had left.
        let millis = left.as_millis() + u128::from(left.subsec_nanos() % 1_000_000 > 0);
        properties = properties.with_expiration(short("the expiration", &millis.to_string())?);
    }
    if let Ok(received) = envelope.source.received_at.duration_since(UNIX_EPOCH) {
        properties = properties.with_timestamp(received.as_secs());
    }
    Ok(properties)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use ferry_shared::envelope::{MESSAGE_ID_HEADER, Source};
    use prost::bytes::Bytes;

    use super::*;

    const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    fn envelope() -> Envelope {
        let at = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let mut e = Envelope::new("id-1", Bytes::new(), Source::new("mqtt", "s", "in", at))
            .with_headers(&[
                ("site", "eu"),
                ("tag", "a"),
                ("tag", "b"),
                (MESSAGE_ID_HEADER, "forged"),
            ]);
        e.content_type = Some("application/json".into());
        e.trace.traceparent = Some(TRACEPARENT.into());
        e
    }

    fn header<'a>(p: &'a BasicProperties, key: &str) -> Option<&'a AMQPValue> {
        p.headers().as_ref().and_then(|h| h.inner().get(key))
    }

    #[test]
    fn ids_headers_and_trace_context_are_carried() {
        let p = properties_for(&envelope(), SystemTime::now()).expect("properties");
        assert_eq!(p.delivery_mode(), &Some(PERSISTENT));
        assert_eq!(
            p.message_id().as_ref().map(ShortString::as_str),
            Some("id-1")
        );
        assert_eq!(p.timestamp(), &Some(1_700_000_000));
        let text = |v: Option<&AMQPValue>| match v {
            Some(AMQPValue::LongString(s)) => {
                Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
            }
            _ => None,
        };
        assert_eq!(text(header(&p, MESSAGE_ID_HEADER)).as_deref(), Some("id-1"));
        assert_eq!(text(header(&p, "site")).as_deref(), Some("eu"));
        assert!(text(header(&p, "traceparent")).is_some());
        assert!(
            matches!(header(&p, "tag"), Some(AMQPValue::FieldArray(a)) if a.as_slice().len() == 2)
        );
    }

    #[test]
    fn expiry_becomes_a_ttl_and_an_expired_message_fails() {
        let now = SystemTime::now();
        let mut e = envelope();
        e.expires_at = Some(now + Duration::from_millis(1500));
        let p = properties_for(&e, now).expect("properties");
        assert_eq!(
            p.expiration().as_ref().map(ShortString::as_str),
            Some("1500")
        );
        e.expires_at = Some(now - Duration::from_secs(1));
        assert!(properties_for(&e, now).is_err_and(|e| e.is_permanent()));
    }
}
