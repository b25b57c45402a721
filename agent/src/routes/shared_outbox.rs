//! The `shared_outbox` writer: receive → one record per binding in one
//! append → settle the source (DESIGN §4.3, §4.5).
//!
//! Invariants:
//!
//! - **The source is settled `Persisted` only after the append returned**
//!   (durable). A failed append leaves the delivery unsettled
//!   (`StoreFailure`): the source redelivers it, and no replay budget is
//!   spent.
//! - **One append per message** carries every binding's record, so the
//!   records of one message exist for all bindings or for none.
//! - **Back-pressure never drops.** The writer stops reading its receiver
//!   while `max_in_flight` appends are unsettled or the partition holds
//!   `max_outbox_depth` records; the broker keeps the rest (MQTT v5 receive
//!   maximum = `max_in_flight`). The depth is an [`OutboxDepth`] counter the
//!   writer raises and the drainer lowers, re-read from the store's `stats`
//!   while intake is stopped.
//! - After each append the drainer is woken at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use ferry_shared::config::Policy;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{Failure, RouteBinding, RouteIdentity, delivery_dlq_id, dispose, with_ttl};
use crate::metrics::RouteMetrics;
use crate::stores::{DlqReason, DlqStore, NewRecord, OutboxStore};
use crate::transports::{Delivery, Outcome, Receiver};

/// How often a stopped writer re-reads the partition depth from the store.
const DEPTH_RESYNC: Duration = Duration::from_millis(200);

/// Records in a partition, kept cheaply in memory for back-pressure.
#[derive(Debug, Default)]
pub struct OutboxDepth {
    depth: AtomicU64,
    space: Notify,
}

impl OutboxDepth {
    /// The current count.
    pub fn get(&self) -> u64 {
        self.depth.load(Ordering::Relaxed)
    }

    /// `n` records appended.
    pub fn add(&self, n: u64) {
        self.depth.fetch_add(n, Ordering::Relaxed);
    }

    /// `n` records completed.
    pub fn sub(&self, n: u64) {
        let _ = self
            .depth
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |d| {
                Some(d.saturating_sub(n))
            });
        self.space.notify_waiters();
    }

    /// The count as the store reports it.
    pub fn set(&self, n: u64) {
        self.depth.store(n, Ordering::Relaxed);
        self.space.notify_waiters();
    }
}

/// The writer of one `shared_outbox` route.
pub struct OutboxWriter {
    /// Bridge, route, agent.
    pub identity: RouteIdentity,
    /// `{bridge}/{route}`.
    pub partition: String,
    /// Every binding of the route, in the route's order.
    pub bindings: Vec<RouteBinding>,
    /// The outbox.
    pub outbox: Arc<dyn OutboxStore>,
    /// The DLQ, when configured.
    pub dlq: Option<Arc<dyn DlqStore>>,
    /// The route's policy.
    pub policy: Policy,
    /// Settle latency.
    pub route_metrics: RouteMetrics,
    /// Wakes the drainer.
    pub wake: Arc<Notify>,
    /// Shared with the drainer.
    pub depth: Arc<OutboxDepth>,
}

impl OutboxWriter {
    /// Takes deliveries until `shutdown`; then lets appends in progress
    /// finish within `grace`. Deliveries still unsettled after that are left
    /// to the source.
    pub async fn run(
        self,
        mut receiver: Box<dyn Receiver>,
        shutdown: CancellationToken,
        grace: Duration,
    ) {
        let this = Arc::new(self);
        let max_in_flight = this.policy.max_in_flight as usize;
        let max_depth = this.policy.max_outbox_depth;
        let mut in_flight = FuturesUnordered::new();
        let mut resync = tokio::time::interval(DEPTH_RESYNC);
        // Polled only while intake is stopped: no burst of catch-up ticks.
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut stopped = false;
        loop {
            let full = this.depth.get() >= max_depth;
            if full != stopped {
                stopped = full;
                let depth = this.depth.get();
                if full {
                    tracing::warn!(route = %this.identity.route_id, depth, "outbox full; intake stopped");
                } else {
                    tracing::info!(route = %this.identity.route_id, depth, "intake resumed");
                }
            }
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                Some(()) = in_flight.next(), if !in_flight.is_empty() => {}
                () = this.depth.space.notified(), if full => {}
                _ = resync.tick(), if full => {
                    if let Ok(stats) = this.outbox.stats(&this.partition).await {
                        this.depth.set(stats.total.depth);
                    }
                }
                delivery = receiver.recv(), if !full && in_flight.len() < max_in_flight => {
                    match delivery {
                        Some(d) => in_flight.push(Arc::clone(&this).handle(d)),
                        None => break,
                    }
                }
            }
        }
        if tokio::time::timeout(grace, async { while in_flight.next().await.is_some() {} })
            .await
            .is_err()
        {
            tracing::warn!(route = %this.identity.route_id, "appends still running after the grace period; left to the source");
        }
    }

    async fn handle(self: Arc<Self>, delivery: Delivery) {
        let Delivery {
            envelope,
            defect,
            settle,
        } = delivery;
        let envelope = with_ttl(envelope, self.policy.ttl.map(|d| d.get()));
        let received_at = envelope.source.received_at;
        let now = SystemTime::now();
        let failure = if let Some(defect) = defect {
            Some((
                self.policy.on_permanent_failure,
                Failure {
                    reason: DlqReason::PermanentError,
                    error: defect.to_string(),
                    attempts: 0,
                    first_attempt_at: None,
                    last_attempt_at: None,
                },
            ))
        } else if envelope.is_expired(now) {
            Some((
                self.policy.on_expired,
                Failure {
                    reason: DlqReason::Expired,
                    error: "expired before it was persisted".into(),
                    attempts: 0,
                    first_attempt_at: None,
                    last_attempt_at: None,
                },
            ))
        } else {
            None
        };
        let outcome = match failure {
            Some((action, failure)) => {
                let mut outcome = Outcome::StoreFailure;
                for b in &self.bindings {
                    match dispose(
                        &self.identity,
                        self.dlq.as_ref(),
                        action,
                        b,
                        delivery_dlq_id(&envelope.id, &b.id),
                        &envelope,
                        failure.clone(),
                        received_at,
                        true,
                    )
                    .await
                    {
                        Ok(o) => outcome = o,
                        Err(error) => {
                            // Per attempt: the store observer logs the change of state.
                            tracing::debug!(route = %self.identity.route_id, %error, "dlq write failed; left to the source");
                            outcome = Outcome::StoreFailure;
                            break;
                        }
                    }
                }
                outcome
            }
            None => self.append(&envelope).await,
        };
        settle.settle(outcome);
        self.route_metrics.settled_after(
            SystemTime::now()
                .duration_since(received_at)
                .unwrap_or_default(),
        );
    }

    async fn append(&self, envelope: &ferry_shared::envelope::Envelope) -> Outcome {
        let now = SystemTime::now();
        let records: Vec<NewRecord> = self
            .bindings
            .iter()
            .map(|b| NewRecord::new(b.id.clone(), b.address.clone(), envelope.clone(), now))
            .collect();
        let n = records.len() as u64;
        match self.outbox.append(&self.partition, records).await {
            Ok(_) => {
                for b in &self.bindings {
                    b.metrics.received(1);
                }
                self.depth.add(n);
                self.wake.notify_one();
                Outcome::Persisted
            }
            Err(error) => {
                // Per attempt: the store observer logs the change of state.
                tracing::debug!(route = %self.identity.route_id, message_id = %envelope.id, %error, "outbox append failed; left to the source");
                Outcome::StoreFailure
            }
        }
    }
}
