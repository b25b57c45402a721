//! Routes: what happens to a delivery between its receiver and its settle.
//!
//! - [`direct_hold`]: one binding; receive → send → settle. The source is held
//!   open until the destination accepted the message or its DLQ entry is
//!   durable.
//! - [`shared_outbox`]: receive → one outbox record per binding in one append
//!   → settle; the [`drainer`](crate::drainer) sends.
//!
//! Both apply the same policy to what cannot be forwarded: an expired message
//! goes to `on_expired`, a defective one (oversized, invalid topic) or a
//! permanent failure to `on_permanent_failure` — a DLQ entry confirmed durable
//! before the source is settled, or a counted drop. When the DLQ write fails
//! the delivery stays unsettled and the source redelivers it (DESIGN §4.5).
//!
//! Metrics: a message counts as `received` for a binding when Ferry takes
//! responsibility for it there — when its outbox record is durable
//! (`shared_outbox`) or when it reaches its terminal state (`direct_hold`).
//! A delivery left unsettled comes back from the source, so counting it at
//! arrival would count it twice and break the conservation law.

pub mod direct_hold;
mod hold;
pub mod redrive;
mod retry;
pub mod shared_outbox;

use std::sync::Arc;
use std::time::SystemTime;

use ferry_shared::config::FailureAction;
use ferry_shared::envelope::Envelope;
use tokio_util::sync::CancellationToken;

use hold::StoreHold;

use crate::metrics::{BindingMetrics, Terminal};
use crate::spans;
use crate::stores::{BoxFuture, DlqEntry, DlqReason, DlqStore, StoreError};
use crate::transports::{Outcome, SendError};

pub use redrive::Redrive;
pub use retry::RetryBackoff;

/// Who a route is, for DLQ entries, logs and metrics.
#[derive(Clone, Debug)]
pub struct RouteIdentity {
    /// `bridge.id`.
    pub bridge_id: String,
    /// The route id.
    pub route_id: String,
    /// The agent writing DLQ entries.
    pub agent_id: String,
}

/// One binding of a route: its id, address and counters.
#[derive(Clone, Debug)]
pub struct RouteBinding {
    /// The binding id.
    pub id: String,
    /// Where its sender publishes.
    pub address: String,
    /// Its conservation counters.
    pub metrics: BindingMetrics,
}

/// The DLQ id of a message that failed on a binding without an outbox record
/// (direct_hold, or before the outbox append):
/// `{message id}/{binding}/{content digest}`.
///
/// Contract: deterministic for one delivery, so a retried write of the same
/// envelope stores it once (`ON CONFLICT DO NOTHING`); different per message,
/// even when two messages share an id (a trusted `ferry-message-id` that was
/// forged or reused), so the second is never silently dropped. The digest is
/// the first 64 bits of a SHA-256 (the `sha2` crate the workspace already
/// uses; stable across builds and restarts, unlike `std`'s `DefaultHasher`)
/// over the source address, the headers and the payload, each length-prefixed.
/// Two messages with the same id *and* the same content are the same message.
pub fn delivery_dlq_id(envelope: &Envelope, binding: &str) -> String {
    format!("{}/{binding}/{}", envelope.id, content_digest(envelope))
}

/// 16 lowercase hex digits: the first 8 bytes of a SHA-256 over the
/// envelope's source address, headers and payload.
fn content_digest(envelope: &Envelope) -> String {
    use sha2::{Digest, Sha256};
    let mut hash = Sha256::new();
    let mut field = |bytes: &[u8]| {
        hash.update((bytes.len() as u64).to_le_bytes());
        hash.update(bytes);
    };
    field(envelope.source.address.as_bytes());
    for (k, v) in &envelope.headers {
        field(k.as_bytes());
        field(v.as_bytes());
    }
    field(&envelope.payload);
    hash.finalize()
        .iter()
        .take(8)
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// The DLQ reason and error text of a send error: `oversized` for
/// [`SendError::Oversized`], `permanent_error` for anything else (callers
/// pass permanent errors; a transient one here is filed as permanent).
pub fn permanent_failure(error: SendError) -> (DlqReason, String) {
    match error {
        SendError::Oversized(e) => (DlqReason::Oversized, e),
        SendError::Permanent(e) => (DlqReason::PermanentError, e),
        other => (DlqReason::PermanentError, other.to_string()),
    }
}

/// What to do with a message that cannot be delivered.
#[derive(Clone, Debug)]
pub struct Failure {
    /// Why.
    pub reason: DlqReason,
    /// The last error.
    pub error: String,
    /// Delivery attempts made.
    pub attempts: u32,
    /// First attempt, if any.
    pub first_attempt_at: Option<SystemTime>,
    /// Last attempt, if any.
    pub last_attempt_at: Option<SystemTime>,
}

/// Applies `action` to `envelope` on `binding`: writes a DLQ entry with
/// `dlq_id` (durable on return) or drops it, and counts the terminal state.
/// `count_received` adds the message to `received` first (a delivery that
/// had no outbox record). Returns the outcome to settle the source with;
/// `Err` when the DLQ write failed (nothing counted, the caller leaves the
/// delivery or record as is).
#[allow(clippy::too_many_arguments)]
pub async fn dispose(
    identity: &RouteIdentity,
    dlq: Option<&Arc<dyn DlqStore>>,
    action: FailureAction,
    binding: &RouteBinding,
    dlq_id: String,
    envelope: &Envelope,
    failure: Failure,
    latency_from: SystemTime,
    count_received: bool,
) -> Result<Outcome, StoreError> {
    let now = SystemTime::now();
    let (terminal, outcome) =
        write_disposal(identity, dlq, action, binding, dlq_id, envelope, failure).await?;
    if count_received {
        binding.metrics.received(1);
    }
    binding
        .metrics
        .finished(terminal, 1, now.duration_since(latency_from).ok());
    Ok(outcome)
}

/// [`dispose`] of a delivery that has no outbox record (so it is counted as
/// received too), in its disposal span. A DLQ write that fails holds the
/// delivery and is retried by `hold`, from `first_delay` on, until it
/// succeeds (`Some`) or `shutdown` (`None`: the source redelivers it).
///
/// Boxed: the routes await it for the rare message they cannot forward, and
/// unboxed its future would be part of every delivery's, which their run
/// loops move into the set in flight for every message (issue 15).
#[allow(clippy::too_many_arguments)]
fn dispose_held<'a>(
    hold: &'a StoreHold,
    first_delay: std::time::Duration,
    shutdown: &'a CancellationToken,
    identity: &'a RouteIdentity,
    dlq: Option<&'a Arc<dyn DlqStore>>,
    action: FailureAction,
    binding: &'a RouteBinding,
    envelope: &'a Envelope,
    failure: &'a Failure,
) -> BoxFuture<'a, Option<Outcome>> {
    Box::pin(
        hold.retry(&identity.route_id, first_delay, shutdown, move || {
            let span = spans::dispose(
                spans::disposal_name(failure.reason),
                &binding.id,
                failure.reason.as_str(),
                &envelope.trace,
            );
            span.instrument(dispose(
                identity,
                dlq,
                action,
                binding,
                delivery_dlq_id(envelope, &binding.id),
                envelope,
                failure.clone(),
                envelope.source.received_at,
                true,
            ))
        }),
    )
}

/// [`dispose`] without counting: writes the DLQ entry (or logs the drop) and
/// returns the terminal state to count and the outcome. For a caller that
/// counts only once the state is final (the drainer: once the record's
/// completion committed, so a retried disposal is never counted twice).
pub async fn write_disposal(
    identity: &RouteIdentity,
    dlq: Option<&Arc<dyn DlqStore>>,
    action: FailureAction,
    binding: &RouteBinding,
    dlq_id: String,
    envelope: &Envelope,
    failure: Failure,
) -> Result<(Terminal, Outcome), StoreError> {
    let now = SystemTime::now();
    let terminal = |dlq: bool| match failure.reason {
        DlqReason::Expired => Terminal::Expired,
        _ if dlq => Terminal::DeadLettered,
        _ => Terminal::Dropped,
    };
    let outcome_for = |dlq: bool| match failure.reason {
        DlqReason::Expired => Outcome::Expired,
        _ if dlq => Outcome::DeadLettered,
        _ => Outcome::Dropped,
    };
    let use_dlq = action == FailureAction::Dlq;
    if use_dlq {
        let Some(dlq) = dlq else {
            // The validator requires a DLQ store for `dlq`; never reached.
            return Err(StoreError::Invalid("no dlq store configured".into()));
        };
        let entry = DlqEntry {
            id: dlq_id,
            bridge_id: identity.bridge_id.clone(),
            route_id: identity.route_id.clone(),
            binding_id: binding.id.clone(),
            address: binding.address.clone(),
            envelope: envelope.clone(),
            reason: failure.reason,
            last_error: failure.error.clone(),
            attempts: failure.attempts,
            first_attempt_at: failure.first_attempt_at,
            last_attempt_at: failure.last_attempt_at,
            dead_lettered_at: now,
            agent_id: identity.agent_id.clone(),
        };
        dlq.put(entry).await?;
        tracing::warn!(
            route = %identity.route_id,
            binding = %binding.id,
            message_id = %envelope.id,
            reason = ?failure.reason,
            error = %failure.error,
            "dead-lettered"
        );
    } else {
        tracing::warn!(
            route = %identity.route_id,
            binding = %binding.id,
            message_id = %envelope.id,
            reason = ?failure.reason,
            error = %failure.error,
            "dropped by policy"
        );
    }
    Ok((terminal(use_dlq), outcome_for(use_dlq)))
}

/// The envelope with the route's `ttl` applied when it carries no expiry.
pub fn with_ttl(mut envelope: Envelope, ttl: Option<std::time::Duration>) -> Envelope {
    if envelope.expires_at.is_none()
        && let Some(ttl) = ttl
    {
        envelope.expires_at = envelope.source.received_at.checked_add(ttl);
    }
    envelope
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use ferry_shared::envelope::{Envelope, Source};
    use prost::bytes::Bytes;

    use super::delivery_dlq_id;

    fn envelope(id: &str, topic: &str, payload: &'static [u8]) -> Envelope {
        let source = Source::new("mqtt", "in", topic, SystemTime::now());
        Envelope::new(id, Bytes::from_static(payload), source).with_headers(&[("k", "v")])
    }

    #[test]
    fn one_delivery_one_dlq_id() {
        let e = envelope("m1", "a/b", b"hello");
        let id = delivery_dlq_id(&e, "x");
        assert_eq!(id, delivery_dlq_id(&e.clone(), "x"), "a retried write");
        assert!(id.starts_with("m1/x/"), "{id}");
        assert_eq!(id.len(), "m1/x/".len() + 16, "{id}");
        assert_ne!(id, delivery_dlq_id(&e, "y"), "another binding");
    }

    #[test]
    fn two_messages_sharing_an_id_get_two_dlq_ids() {
        let a = envelope("same", "a/b", b"one");
        let b = envelope("same", "a/b", b"two");
        let c = envelope("same", "a/c", b"one");
        let mut d = envelope("same", "a/b", b"one");
        d.headers.push(("k2".into(), "v2".into()));
        let ids = [&a, &b, &c, &d].map(|e| delivery_dlq_id(e, "x"));
        for (i, x) in ids.iter().enumerate() {
            for y in &ids[i + 1..] {
                assert_ne!(x, y);
            }
        }
        // Length prefixes: moving bytes between fields changes the digest.
        let mut e = envelope("same", "a/b", b"one");
        e.headers = vec![("kv".into(), String::new())];
        let mut f = envelope("same", "a/b", b"one");
        f.headers = vec![("k".into(), "v".into())];
        assert_ne!(delivery_dlq_id(&e, "x"), delivery_dlq_id(&f, "x"));
    }
}
