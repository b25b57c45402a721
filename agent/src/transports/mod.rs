//! Transports: the sessions, receivers and senders routes and drainers use.
//!
//! Three roles, one contract per role, so a route or a drainer never names a
//! broker (DESIGN §6):
//!
//! - a [`Session`] is a connection to a broker or service. It publishes its
//!   connected state on a `watch` channel (the drainer's gate, readiness) and
//!   counts its reconnects;
//! - a [`Receiver`] yields [`Delivery`]s. Each carries a [`SettleHandle`]; the
//!   route settles it with an [`Outcome`] once Ferry's work for the message is
//!   finished (or must be given up). Only an outcome for which
//!   [`Outcome::acknowledges`] is true lets the source be acknowledged; every
//!   other outcome leaves the message with the source, which redelivers it;
//! - a [`Sender`] sends one envelope to one [`Address`] and resolves only when
//!   the destination has accepted it, with a [`SendError`] that says whether a
//!   retry can help.
//!
//! Binding addresses may be templates (`orders.{header:aggregate_id}`): the runtime wraps
//! every sender in [`address::Templated`], which fills them per message, so a sender always
//! receives a plain address. `headers` holds what every sender writes besides the payload
//! (the outgoing header list, the remaining time to live); `backoff` the reconnect delays.
//!
//! The traits are dyn-compatible (futures are boxed) so a runtime can hold
//! `Arc<dyn Sender>` per binding and `Box<dyn Receiver>` per route whatever the
//! transport.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use ferry_shared::envelope::Envelope;
use tokio::sync::watch;

pub mod address;
pub mod aws;
pub(crate) mod backoff;
pub(crate) mod headers;
pub mod mqtt;
pub mod nats;
pub mod outbox_table;
pub mod rabbitmq;

/// The future [`Sender::send`] returns.
pub type SendFuture<'a> = Pin<Box<dyn Future<Output = Result<(), SendError>> + Send + 'a>>;

/// The future [`Receiver::recv`] returns.
pub type RecvFuture<'a> = Pin<Box<dyn Future<Output = Option<Delivery>> + Send + 'a>>;

/// A connection to a broker or service.
pub trait Session: Send + Sync {
    /// The connected state: `true` while the session can send and receive.
    /// Readiness and the drainer's gate watch it.
    fn connected(&self) -> watch::Receiver<bool>;

    /// How many times the session connected again after its first connection.
    fn reconnects(&self) -> u64;
}

/// Yields the messages of one subscription (MQTT topic filters, an SQS queue).
pub trait Receiver: Send {
    /// The next delivery, in receive order; `None` once the session stopped.
    ///
    /// Cancel-safe: dropping the future loses no delivery.
    fn recv(&mut self) -> RecvFuture<'_>;
}

/// Sends envelopes on one session.
pub trait Sender: Send + Sync {
    /// Sends `envelope` to `address` and resolves once the destination accepted
    /// it (MQTT QoS 1: the PUBACK). Sends started one after the other on the
    /// same sender leave in that order, so a caller may pipeline them.
    fn send<'a>(&'a self, envelope: &'a Envelope, address: &'a Address) -> SendFuture<'a>;

    /// The connected state of the session the sender publishes on.
    fn connected(&self) -> watch::Receiver<bool>;
}

/// Where a sender puts a message: a topic, a queue name or a queue URL.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Address(Arc<str>);

impl Address {
    /// An address as the binding names it; shared, not copied, when it
    /// already is an `Arc<str>` (a stored record's address).
    pub fn new(address: impl Into<Arc<str>>) -> Self {
        Self(address.into())
    }

    /// The address as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for Address {
    fn from(address: &str) -> Self {
        Self::new(address)
    }
}

impl From<String> for Address {
    fn from(address: String) -> Self {
        Self::new(address)
    }
}

/// Why a send failed, and whether trying again can help.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// The destination may accept the message later (disconnected, connection
    /// lost before the acknowledgement, quota exceeded). The message may or may
    /// not have arrived: a retry can produce a duplicate, never a loss.
    #[error("transient send failure: {0}")]
    Transient(String),
    /// No acknowledgement within the send timeout. Transient, and the message
    /// may or may not have arrived.
    #[error("no acknowledgement within {0:?}")]
    Timeout(Duration),
    /// The destination will never accept this message as it is (not
    /// authorized, invalid topic, too large). It certainly was not accepted.
    #[error("permanent send failure: {0}")]
    Permanent(String),
    /// The message is larger than the destination accepts (its maximum packet
    /// size): permanent, dead-lettered as `oversized`. It certainly was not
    /// accepted.
    #[error("too large for the destination: {0}")]
    Oversized(String),
}

impl SendError {
    /// True for [`SendError::Permanent`] and [`SendError::Oversized`]:
    /// retrying cannot help.
    pub fn is_permanent(&self) -> bool {
        matches!(self, SendError::Permanent(_) | SendError::Oversized(_))
    }

    /// True for [`SendError::Timeout`].
    pub fn is_timeout(&self) -> bool {
        matches!(self, SendError::Timeout(_))
    }
}

/// One received message, held at the source until its handle is settled.
#[must_use = "a delivery that is dropped unsettled is redelivered by the source"]
pub struct Delivery {
    /// The message as Ferry carries it. When [`Delivery::defect`] is set this is
    /// a best-effort rendering, fit for a dead-letter entry, not for sending.
    pub envelope: Envelope,
    /// Set when the message cannot be forwarded as it is (too large, invalid
    /// topic): the route applies its policy (dead-letter or drop, counted) and
    /// settles it like any other delivery.
    pub defect: Option<Defect>,
    /// The source marked it as sent before (MQTT DUP flag): an earlier
    /// delivery of it was not acknowledged. Counted, so duplicates caused
    /// upstream of Ferry's sends show as such.
    pub redelivered: bool,
    /// The source schedules retries of its own (an outbox table's `retry_at`): a transient
    /// failure that outlasts `direct_hold`'s `send_retry_budget` settles the delivery
    /// [`Outcome::Failed`] (not acknowledged) instead of applying `on_permanent_failure`, and
    /// the source dead-letters it once its own retries are spent
    /// ([`Defect::RetriesExhausted`]).
    pub source_retries: bool,
    /// Settles the delivery at the source.
    pub settle: SettleHandle,
}

impl fmt::Debug for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delivery")
            .field("id", &self.envelope.id)
            .field("address", &self.envelope.source.address)
            .field("defect", &self.defect)
            .field("redelivered", &self.redelivered)
            .field("source_retries", &self.source_retries)
            .finish_non_exhaustive()
    }
}

/// Why a received message cannot be forwarded as it is.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Defect {
    /// The payload is larger than the receiver's `max_payload_bytes`.
    #[error("payload of {size} bytes exceeds the limit of {limit} bytes")]
    Oversized {
        /// Payload size in bytes.
        size: usize,
        /// The configured limit.
        limit: usize,
    },
    /// The topic is empty or not UTF-8 (the envelope's address is a lossy
    /// rendering).
    #[error("invalid topic: {0}")]
    InvalidTopic(String),
    /// The source handed the message out this many times (SQS
    /// `ApproximateReceiveCount`), past the route's `max_replay_attempts` or
    /// at the queue's own redrive limit: a poison message, dead-lettered by
    /// Ferry before the queue moves it elsewhere.
    #[error("received {receives} times (ApproximateReceiveCount), the limit is {limit}")]
    TooManyReceives {
        /// Receives so far, this one included.
        receives: u32,
        /// The most receives allowed.
        limit: u32,
    },
    /// The source's headers cannot be read (an outbox table's `headers` column is not a JSON
    /// object of strings): the same on every retry, so dead-lettered at once.
    #[error("invalid headers: {0}")]
    InvalidHeaders(String),
    /// The source retried it as often as it allows (an outbox table's `retry_count` reached
    /// `max_retries`): dead-lettered by Ferry so it stops holding back what follows it.
    #[error("failed {retries} times, the limit is {limit}")]
    RetriesExhausted {
        /// Failed deliveries so far.
        retries: u32,
        /// The most failures allowed.
        limit: u32,
    },
}

impl Defect {
    /// The reason a defective message is dead-lettered with: `oversized` for
    /// [`Defect::Oversized`], `replay_exhausted` for
    /// [`Defect::TooManyReceives`] and [`Defect::RetriesExhausted`], `permanent_error` for the
    /// rest.
    pub fn dlq_reason(&self) -> crate::stores::DlqReason {
        match self {
            Defect::Oversized { .. } => crate::stores::DlqReason::Oversized,
            Defect::TooManyReceives { .. } | Defect::RetriesExhausted { .. } => {
                crate::stores::DlqReason::ReplayExhausted
            }
            Defect::InvalidTopic(_) | Defect::InvalidHeaders(_) => {
                crate::stores::DlqReason::PermanentError
            }
        }
    }
}

/// How a delivery ended, as far as the source is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Sent and accepted by the destination (`direct_hold`).
    Sent,
    /// Durably written to the outbox (`shared_outbox`).
    Persisted,
    /// Filtered out by the route.
    Filtered,
    /// Expired before it could be delivered, handled by `on_expired`.
    Expired,
    /// Written to the dead-letter queue (confirmed durable).
    DeadLettered,
    /// Dropped by an explicit policy (counted as dropped).
    Dropped,
    /// Not finished because the agent is shutting down.
    Shutdown,
    /// Not taken because of back-pressure (in-flight limit, full outbox).
    BackPressure,
    /// Not finished because a store (outbox, DLQ) failed.
    StoreFailure,
    /// Sending failed transiently past the route's retry budget, and the source retries it
    /// itself ([`Delivery::source_retries`]).
    Failed,
    /// The handle was dropped without being settled.
    Abandoned,
}

impl Outcome {
    /// True when Ferry's work for the message is finished and the source may
    /// acknowledge it. False means it must stay unacknowledged so the source
    /// redelivers it (for MQTT: on the next connection of the session).
    pub fn acknowledges(self) -> bool {
        match self {
            Outcome::Sent
            | Outcome::Persisted
            | Outcome::Filtered
            | Outcome::Expired
            | Outcome::DeadLettered
            | Outcome::Dropped => true,
            Outcome::Shutdown
            | Outcome::BackPressure
            | Outcome::StoreFailure
            | Outcome::Failed
            | Outcome::Abandoned => false,
        }
    }
}

type SettleFn = Box<dyn FnOnce(Outcome) + Send>;

/// Settles one delivery at its source. Settling is synchronous and cheap; the
/// acknowledgement itself goes out in the background, in the order the
/// protocol requires. Dropping an unsettled handle settles it with
/// [`Outcome::Abandoned`] (not acknowledged).
pub struct SettleHandle {
    settle: Option<SettleFn>,
}

impl SettleHandle {
    /// A handle that runs `settle` once, with the outcome.
    pub fn new(settle: impl FnOnce(Outcome) + Send + 'static) -> Self {
        Self {
            settle: Some(Box::new(settle)),
        }
    }

    /// A handle with nothing to acknowledge (MQTT QoS 0).
    pub fn noop() -> Self {
        Self { settle: None }
    }

    /// Settles the delivery.
    pub fn settle(mut self, outcome: Outcome) {
        if let Some(settle) = self.settle.take() {
            settle(outcome);
        }
    }
}

impl Drop for SettleHandle {
    fn drop(&mut self) {
        if let Some(settle) = self.settle.take() {
            settle(Outcome::Abandoned);
        }
    }
}

impl fmt::Debug for SettleHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SettleHandle")
            .field("settled", &self.settle.is_none())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[test]
    fn outcomes_that_acknowledge() {
        assert!(Outcome::Persisted.acknowledges());
        assert!(Outcome::DeadLettered.acknowledges());
        assert!(!Outcome::Shutdown.acknowledges());
        assert!(!Outcome::BackPressure.acknowledges());
        assert!(!Outcome::StoreFailure.acknowledges());
        assert!(!Outcome::Failed.acknowledges());
        assert!(!Outcome::Abandoned.acknowledges());
    }

    #[test]
    fn a_dropped_handle_is_abandoned_once() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = Arc::clone(&seen);
        drop(SettleHandle::new(move |o| {
            record.lock().map(|mut v| v.push(o)).ok();
        }));
        let record = Arc::clone(&seen);
        SettleHandle::new(move |o| {
            record.lock().map(|mut v| v.push(o)).ok();
        })
        .settle(Outcome::Sent);
        let seen = seen.lock().map(|v| v.clone()).unwrap_or_default();
        assert_eq!(seen, vec![Outcome::Abandoned, Outcome::Sent]);
    }
}
