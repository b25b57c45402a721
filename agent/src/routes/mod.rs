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
mod retry;
pub mod shared_outbox;

use std::sync::Arc;
use std::time::SystemTime;

use ferry_shared::config::FailureAction;
use ferry_shared::envelope::Envelope;

use crate::metrics::{BindingMetrics, Terminal};
use crate::stores::{DlqEntry, DlqReason, DlqStore, StoreError};
use crate::transports::Outcome;

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

/// The deterministic DLQ id of a message that failed on a binding without an
/// outbox record (direct_hold, or before the outbox append): writing it twice
/// stores it once.
pub fn delivery_dlq_id(message_id: &str, binding: &str) -> String {
    format!("{message_id}/{binding}")
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
