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
//!   while `max_in_flight` appends are unsettled or the partition would hold
//!   more than `max_outbox_depth` records; the broker keeps the rest (MQTT v5
//!   receive maximum = `max_in_flight`). The depth is an [`OutboxDepth`]
//!   counter the writer raises and the drainer lowers, re-read from the
//!   store's `stats` by the drainer and while intake is stopped.
//! - **`max_outbox_depth` is never exceeded.** A delivery is taken only after
//!   its records (one per binding) are *reserved* in [`OutboxDepth`]: the
//!   stored, reserved and new records together stay within
//!   `max_outbox_depth`. The reservation becomes stored depth when the append
//!   commits and is released when it fails or the delivery needs no append.
//!   Only the writer loop reserves, so the check and the reservation cannot
//!   race.
//! - **Hysteresis.** Once stopped at the limit, intake resumes only when the
//!   depth falls below [`RESUME_BELOW`] of the limit; "intake stopped" and
//!   "intake resumed" are logged once per change of state.
//! - **A failing store holds the delivery and pauses intake** ([`hold`]):
//!   its append (or DLQ write) is retried with backoff until it succeeds or
//!   the route shuts down, while the writer takes nothing more, instead of
//!   having the broker redeliver the whole window into a store that cannot
//!   take it. The failure is logged once when it starts and once when it
//!   clears.
//!
//! [`hold`]: super::hold
//! - After each append the drainer is woken at once.
//! - With tracing on, each message is handled in its `receive` span and its
//!   records store that span's trace context, so its sends join the trace
//!   ([`spans`](crate::spans)).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use ferry_shared::config::{FailureAction, Policy};
use ferry_shared::envelope::Envelope;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::hold::StoreHold;
use super::{Failure, RouteBinding, RouteIdentity, dispose_held, with_ttl};
use crate::metrics::RouteMetrics;
use crate::spans::{self, MessageSpan};
use crate::stores::{DlqReason, DlqStore, NewMessage, NewRecord, OutboxStore};
use crate::transports::{Delivery, Outcome, Receiver};

/// How often a stopped writer re-reads the partition depth from the store,
/// the first time this long after it stopped. A stop at the limit usually
/// ends within a few tens of milliseconds, as completions lower the
/// in-memory count, while a `stats` call scans the whole partition: reading
/// it at once at every stop cost about 11 % of the agent's instructions in a
/// flat-out fan-out that stops often (see `docs/benchmarks.md`, issue 15).
const DEPTH_RESYNC: Duration = Duration::from_millis(200);

/// The low watermark: intake stopped at `max_outbox_depth` resumes once the
/// depth is below this fraction of it (90 %), so that it does not flap
/// between stopped and running with every completed batch.
pub const RESUME_BELOW: f64 = 0.9;

/// Records in a partition, kept cheaply in memory for back-pressure: those
/// stored, and those reserved by appends in progress.
///
/// The stored count is raised by appends and lowered by completions as they
/// commit, and re-read from the store's `stats` now and then. A `stats`
/// answer that raced with an append or a completion would be off by it (the
/// store read before it, the answer applied after it) and could let intake
/// past the limit, so a refresh is applied only if the count did not change
/// since the read began ([`OutboxDepth::changes`], [`OutboxDepth::refresh`]).
#[derive(Debug, Default)]
pub struct OutboxDepth {
    counts: Mutex<DepthCounts>,
    space: Notify,
}

#[derive(Debug, Default, Clone, Copy)]
struct DepthCounts {
    stored: u64,
    reserved: u64,
    /// Appends and completions applied so far (a version for
    /// [`OutboxDepth::refresh`]).
    changes: u64,
}

impl OutboxDepth {
    fn counts(&self) -> std::sync::MutexGuard<'_, DepthCounts> {
        self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The stored count.
    pub fn get(&self) -> u64 {
        self.counts().stored
    }

    /// Stored plus reserved.
    pub fn level(&self) -> u64 {
        let c = self.counts();
        c.stored + c.reserved
    }

    /// Reserves room for `n` records if the level stays within `max` (or the
    /// partition is empty: one message always fits); false otherwise.
    fn try_reserve(&self, n: u64, max: u64) -> bool {
        let mut c = self.counts();
        let level = c.stored + c.reserved;
        if level + n > max && level > 0 {
            return false;
        }
        c.reserved += n;
        true
    }

    /// A reservation of `n` ends: stored when `appended`, else given back.
    fn settle_reservation(&self, n: u64, appended: bool) {
        {
            let mut c = self.counts();
            c.reserved = c.reserved.saturating_sub(n);
            if appended {
                c.stored += n;
                c.changes += 1;
            }
        }
        if !appended {
            self.space.notify_waiters();
        }
    }

    /// `n` records appended.
    pub fn add(&self, n: u64) {
        let mut c = self.counts();
        c.stored += n;
        c.changes += 1;
    }

    /// `n` records completed.
    pub fn sub(&self, n: u64) {
        {
            let mut c = self.counts();
            c.stored = c.stored.saturating_sub(n);
            c.changes += 1;
        }
        self.space.notify_waiters();
    }

    /// The count as the store reports it (at start, before any append).
    pub fn set(&self, n: u64) {
        self.counts().stored = n;
        self.space.notify_waiters();
    }

    /// How many appends and completions were applied so far: read it
    /// before a `stats` call and pass it to [`OutboxDepth::refresh`].
    pub fn changes(&self) -> u64 {
        self.counts().changes
    }

    /// The count as a `stats` call begun when [`OutboxDepth::changes`] was
    /// `changes_before` reports it; ignored if the count changed since (the
    /// in-memory count is exact for this agent's own appends and
    /// completions; the refresh only corrects what it cannot see).
    pub fn refresh(&self, n: u64, changes_before: u64) {
        {
            let mut c = self.counts();
            if c.changes != changes_before {
                return;
            }
            c.stored = n;
        }
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

/// The depth below which stopped intake resumes (when a message also has
/// room): [`RESUME_BELOW`] of `max_depth`, at least 1 so that an empty
/// outbox always resumes.
fn resume_level(max_depth: u64) -> u64 {
    // Exact for any realistic limit (below 2^53).
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let low = (max_depth as f64 * RESUME_BELOW) as u64;
    low.max(1)
}

/// An [`OutboxWriter`] while it runs: the writer and its held deliveries.
struct Running {
    writer: OutboxWriter,
    /// Deliveries held on a failing append or DLQ write.
    hold: StoreHold,
    /// Each binding's id and address, in the route's order, shared by the
    /// records of every message.
    records: Vec<(Arc<str>, Arc<str>)>,
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
        let records = self
            .bindings
            .iter()
            .map(|b| (Arc::from(b.id.as_str()), Arc::from(b.address.as_str())))
            .collect();
        let this = Arc::new(Running {
            writer: self,
            hold: StoreHold::default(),
            records,
        });
        let w = &this.writer;
        let max_in_flight = w.policy.max_in_flight as usize;
        let max_depth = w.policy.max_outbox_depth;
        let resume_below = resume_level(max_depth);
        let per_message = w.bindings.len() as u64;
        let mut in_flight = FuturesUnordered::new();
        let mut resync = tokio::time::interval(DEPTH_RESYNC);
        // Polled only while intake is stopped: no burst of catch-up ticks.
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut stopped = false;
        // Made once: a new one per delivery registers with the token and
        // unregisters again each time.
        let cancelled = shutdown.cancelled();
        tokio::pin!(cancelled);
        loop {
            let level = w.depth.level();
            // Room for one more message (one always fits an empty outbox).
            let room = level + per_message <= max_depth || level == 0;
            let full = if stopped {
                level >= resume_below || !room
            } else {
                !room
            };
            if full != stopped {
                stopped = full;
                if full {
                    resync.reset();
                    tracing::warn!(route = %w.identity.route_id, depth = level, max_outbox_depth = max_depth, "outbox full; intake stopped");
                } else {
                    tracing::info!(route = %w.identity.route_id, depth = level, resume_below, "intake resumed");
                }
            }
            // Re-evaluated whenever a delivery finishes: a held one finishes
            // only once its write went through.
            let taking = !full && !this.hold.active() && in_flight.len() < max_in_flight;
            tokio::select! {
                biased;
                () = &mut cancelled => break,
                Some(()) = in_flight.next(), if !in_flight.is_empty() => {}
                () = w.depth.space.notified(), if full => {}
                _ = resync.tick(), if full => {
                    let changes = w.depth.changes();
                    if let Ok(stats) = w.outbox.stats(&w.partition).await {
                        w.depth.refresh(stats.total.depth, changes);
                    }
                }
                delivery = receiver.recv(), if taking => {
                    match delivery {
                        Some(d) => {
                            // Cannot fail: `full` is false, and only this loop reserves.
                            let reserved = w.depth.try_reserve(per_message, max_depth);
                            debug_assert!(reserved);
                            // Boxed here: the set moves what it is given into its own
                            // task node, and a delivery's future is large.
                            in_flight.push(Box::pin(Arc::clone(&this).handle(d, shutdown.clone())));
                        }
                        None => break,
                    }
                }
            }
        }
        if tokio::time::timeout(grace, async { while in_flight.next().await.is_some() {} })
            .await
            .is_err()
        {
            tracing::warn!(route = %w.identity.route_id, "appends still running after the grace period; left to the source");
        }
    }
}

impl Running {
    /// Handles one delivery whose records were reserved, in its `receive`
    /// span (whose context is stored with the records).
    async fn handle(self: Arc<Self>, mut delivery: Delivery, shutdown: CancellationToken) {
        let receive = spans::receive(&self.writer.identity.route_id, &delivery.envelope);
        spans::stamp(&receive, &mut delivery.envelope);
        let append = spans::append(&receive, &self.writer.partition, self.writer.bindings.len());
        receive
            .scope(self.handle_in_span(delivery, shutdown, append))
            .await;
    }

    async fn handle_in_span(
        self: Arc<Self>,
        delivery: Delivery,
        shutdown: CancellationToken,
        append: MessageSpan,
    ) {
        let w = &self.writer;
        let Delivery {
            envelope,
            defect,
            redelivered,
            settle,
            ..
        } = delivery;
        if redelivered {
            w.route_metrics.redelivered();
        }
        let envelope = with_ttl(envelope, w.policy.ttl.map(|d| d.get()));
        let received_at = envelope.source.received_at;
        let now = SystemTime::now();
        let failure = if let Some(defect) = defect {
            Some((
                w.policy.on_permanent_failure,
                Failure {
                    reason: defect.dlq_reason(),
                    error: defect.to_string(),
                    attempts: 0,
                    first_attempt_at: None,
                    last_attempt_at: None,
                },
            ))
        } else if envelope.is_expired(now) {
            Some((
                w.policy.on_expired,
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
                self.dispose_all(&envelope, action, &failure, &shutdown)
                    .await
            }
            None => append.instrument(self.append(&envelope, &shutdown)).await,
        };
        if !matches!(outcome, Outcome::Persisted) {
            // Nothing appended: the reservation goes back.
            w.depth.settle_reservation(w.bindings.len() as u64, false);
        }
        settle.settle(outcome);
        w.route_metrics.settled_after(
            SystemTime::now()
                .duration_since(received_at)
                .unwrap_or_default(),
        );
    }

    /// Applies `action` on every binding (a message that never reached the
    /// outbox); a DLQ write that fails is held and retried.
    async fn dispose_all(
        &self,
        envelope: &Envelope,
        action: FailureAction,
        failure: &Failure,
        shutdown: &CancellationToken,
    ) -> Outcome {
        let w = &self.writer;
        let mut outcome = Outcome::StoreFailure;
        for b in &w.bindings {
            let written = dispose_held(
                &self.hold,
                w.policy.retry_backoff.initial_interval.get(),
                shutdown,
                &w.identity,
                w.dlq.as_ref(),
                action,
                b,
                envelope,
                failure,
            )
            .await;
            match written {
                Some(o) => outcome = o,
                // Shutdown: the source redelivers it; the bindings already
                // written are idempotent by their DLQ id.
                None => return Outcome::Shutdown,
            }
        }
        outcome
    }

    /// One append of a record per binding, held and retried while it fails.
    async fn append(&self, envelope: &Envelope, shutdown: &CancellationToken) -> Outcome {
        let w = &self.writer;
        let now = SystemTime::now();
        let message = || {
            let records = self
                .records
                .iter()
                .map(|(binding, address)| NewRecord::new(Arc::clone(binding), Arc::clone(address)))
                .collect();
            NewMessage::new(envelope.clone(), now, records)
        };
        let appended = self
            .hold
            .retry(
                &w.identity.route_id,
                w.policy.retry_backoff.initial_interval.get(),
                shutdown,
                || w.outbox.append(&w.partition, message()),
            )
            .await;
        if appended.is_none() {
            tracing::debug!(route = %w.identity.route_id, message_id = %envelope.id, "shutting down with an outbox append still failing; left to the source");
            return Outcome::Shutdown;
        }
        for b in &w.bindings {
            b.metrics.received(1);
        }
        w.depth.settle_reservation(w.bindings.len() as u64, true);
        w.wake.notify_one();
        Outcome::Persisted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_never_let_the_level_past_the_limit() {
        let d = OutboxDepth::default();
        assert!(d.try_reserve(3, 10));
        assert!(d.try_reserve(3, 10));
        assert!(d.try_reserve(3, 10));
        // 9 reserved: 3 more would make 12.
        assert!(!d.try_reserve(3, 10));
        d.settle_reservation(3, true);
        d.settle_reservation(3, false);
        assert_eq!((d.get(), d.level()), (3, 6));
        d.sub(3);
        d.settle_reservation(3, true);
        assert_eq!((d.get(), d.level()), (3, 3));
    }

    #[test]
    fn a_refresh_that_raced_with_a_change_is_ignored() {
        let d = OutboxDepth::default();
        d.set(10);
        let before = d.changes();
        // The store answers 10, but an append of 2 commits meanwhile.
        d.add(2);
        d.refresh(10, before);
        assert_eq!(d.get(), 12);
        // Or a completion of 5.
        let before = d.changes();
        d.sub(5);
        d.refresh(12, before);
        assert_eq!(d.get(), 7);
        // Nothing changed: the store's answer stands.
        let before = d.changes();
        d.refresh(9, before);
        assert_eq!(d.get(), 9);
    }

    #[test]
    fn one_message_always_fits_an_empty_outbox() {
        let d = OutboxDepth::default();
        assert!(d.try_reserve(5, 2));
        assert!(!d.try_reserve(1, 2));
    }

    #[test]
    fn intake_resumes_below_the_low_watermark() {
        assert_eq!(resume_level(10_000), 9_000);
        assert_eq!(resume_level(200), 180);
        assert_eq!(resume_level(5), 4);
        assert_eq!(resume_level(1), 1);
    }
}
