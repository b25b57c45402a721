//! The drainer: sends a `shared_outbox` partition's records (DESIGN §4.4).
//!
//! Invariants:
//!
//! 1. **Only the lease holder drains.** [`lease`] acquires the partition's
//!    lease and renews it every `renew_interval`; the drain loop runs cycles
//!    only under the version it holds. On loss the current cycle is dropped at
//!    once (sends in flight are abandoned; outcomes already handed to the
//!    store are still written, see invariant 7) and a new holder's higher
//!    version takes every claim back. At start the drainer
//!    releases a grant its own previous incarnation still holds (same agent
//!    id), so a restart fences out the dead process at once instead of waiting
//!    for its claims to go stale. A cycle also checks the held grant's expiry
//!    on this agent's clock ([`DrainerState::held_until`]) before every claim
//!    and every batch of sends it starts: a process resumed from a pause
//!    (SIGSTOP, a stopped VM) may run its cycle before its lease keeper
//!    notices the expiry, and must not start sending records that a new
//!    holder has meanwhile taken back and sent. Past the expiry it starts
//!    nothing more and gives its queued records back, so after a pause it
//!    sends at most what it had handed to the connection before it.
//! 2. **A record is completed only after its destination accepted it, or
//!    after its DLQ entry is durable.** A crash between the send and the
//!    completion re-sends the record: the duplicate window is the records
//!    sent and not yet settled — at most 3 × `drain_batch_size` per crash,
//!    because a batch's records start only while at most two batches are
//!    unsettled (see invariant 6). (The expiry sweep claims up to one batch
//!    more, but never sends it: a crash repeats its DLQ writes, which are
//!    idempotent by id.)
//! 3. **Order per binding.** Records of one binding leave in `seq` order
//!    (pipelined up to [`SEND_WINDOW`] on the connection, never reordered); a
//!    failed send stops the later records of its binding in that cycle: those
//!    not yet started are released untried (no replay count), those already
//!    in flight keep their own outcome (accepted ones are completed, so they
//!    are not sent twice). Bindings proceed concurrently.
//! 4. **No replay budget burnt on an outage.** A cycle is skipped while the
//!    egress session is disconnected; only a send that was actually tried and
//!    failed counts. A record goes to the DLQ after a permanent error, or once
//!    its replay count exceeds `max_replay_attempts` *and* its first attempt is
//!    older than `replay_budget`.
//! 5. **Expiry is fenced too.** Beside its drain, a cycle (also while
//!    disconnected) claims expired pending records (`OutboxStore::expire`),
//!    applies `on_expired`, and only then completes them — at most once per
//!    [`SWEEP_EVERY`] under a version: a record the drain claims is checked
//!    for expiry anyway, so the sweep is for the records it does not reach
//!    (a backlog, a lost connection), and at a low rate every message
//!    starts a cycle of its own.
//! 6. **The drain streams, never reorders.** A cycle claims batch after
//!    batch while the partition has records, and each batch's records join
//!    their binding's send lane as soon as they are claimed, behind the
//!    earlier ones, so the connection does not idle between batches. A batch
//!    is claimed once at most two are unsettled (sent or queued, outcome not
//!    yet written) besides the outcomes being written; outcomes are written
//!    a batch's worth at a time, and the claim they let through goes to the
//!    store beside them (usually one commit) but its records are held unsent
//!    until that write succeeded. After any failure (or `stop`, or the
//!    grant's expiry) the cycle claims nothing more, lets what is in flight
//!    finish — a claim still in flight goes back untried whole, every
//!    binding's records — writes every outcome, and ends, so the next cycle starts again at the lowest pending `seq` of
//!    every binding. On lease loss the cycle is dropped (the new holder's
//!    version takes its claims back); at shutdown it claims nothing more and
//!    finishes within the grace period. Outcomes whose write failed are kept
//!    and written again before the next claim under the same version, so a
//!    failed write does not leave records claimed until they are stale.
//! 7. **Each record is counted once, when its completion commits.** For
//!    every binding `received = sent + dropped + filtered + expired +
//!    dead_lettered + in_flight` holds exactly, whatever happens to the lease:
//!    a record is `received` once, when its append commits (or at start, for
//!    records left by a previous run), and leaves `in_flight` only in the
//!    write task that completed it, for exactly the seqs the store's
//!    `complete` reports deleted — as `sent`, or as the terminal state of its
//!    disposal (a DLQ write or a drop is not counted by itself). Writes run
//!    in a task of their own, so a completion handed to the store is counted
//!    even when the cycle that started it is dropped on a lease loss. A
//!    completion rejected as `Stale` (a newer version took the claims back)
//!    deletes nothing and counts nothing: the records are pending again, and
//!    are counted when the holder that sends them again completes them. A
//!    completion whose answer was lost (its outcome unknown) is written again
//!    under the same version, and the records it then finds gone are counted
//!    too: while the version holds, only that attempt could have deleted
//!    them. Under a newer version the retry is void, and a record it deleted
//!    stays in `in_flight`, as does a record completed by another agent: the
//!    law holds per agent for the records it completes.
//! 8. **The figures do not depend on the cycle's fate.** The depth and
//!    oldest-age gauges are refreshed from the store's `stats` every
//!    [`STATS_EVERY`], whether or not this agent holds the lease or its last
//!    cycle failed; while `stats` fails they keep their last value (the
//!    writer's in-memory depth is a partition total including appends in
//!    flight, not a per-binding figure, so it is not substituted). A failing
//!    cycle, DLQ write or `stats` is logged once when it starts failing and
//!    once when it recovers ([`FailureLog`]).
//!
//! 9. **A drained cycle may leave its last accepted records unwritten.**
//!    A cycle that drained the partition, with nothing but accepted records
//!    (at most a batch) left to write, leaves them to the next cycle under
//!    the same version, which writes them beside its first claim, usually in
//!    one commit: at a low rate every message starts a cycle, and this saves
//!    a store transaction per message. If no cycle starts within
//!    [`DEFER_FOR`] they are written on their own; at shutdown, before the
//!    lease is released. The next cycle counts them unsettled (the crash
//!    window of invariant 6 stays three batches) and they are counted when
//!    their completion commits (invariant 7). Any other outcome (a failed
//!    send or DLQ write, an expired or dead record), more than a batch, and
//!    a cycle that was interrupted (a failed claim or write, the grant's
//!    expiry, a stop) make a cycle write everything before it ends. On a
//!    lease loss their write is still started, as for a cycle dropped then
//!    (invariant 7): the store's fence lets it through only if no newer
//!    holder took them back, which then sends them again.
//!
//! Work arrives through a [`Notify`] the writer signals after each append;
//! otherwise the fallback poll is `drain_interval` or adaptive backoff.

mod cycle;
mod lease;
mod poll;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use ferry_shared::config::{DrainPoll, FailureAction};
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use crate::health::ReadinessCondition;
use crate::log_state::FailureLog;
use crate::metrics::RouteMetrics;
use crate::routes::shared_outbox::OutboxDepth;
use crate::routes::{RouteBinding, RouteIdentity};
use crate::stores::{DlqStore, LeaseStore, OutboxStore, StoreError};
use crate::transports::Sender;

/// Sends in flight per binding (pipelined on the connection, in order). With
/// a handful of bindings this stays below the MQTT session's outgoing
/// in-flight window (100), so the broker never parks one of them.
pub const SEND_WINDOW: usize = 32;

/// How often at most the drainer reads the partition's statistics for the
/// depth and oldest-age gauges.
const STATS_EVERY: Duration = Duration::from_millis(500);

/// How long the accepted records a drained cycle left unwritten wait for
/// the next cycle before they are completed on their own (invariant 9).
const DEFER_FOR: Duration = Duration::from_millis(5);

/// How often at most a cycle starts with an expiry sweep (invariant 5): the
/// sweep is a store transaction, one more per message at a low rate.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// Everything one drainer needs.
pub struct Drainer {
    /// Bridge, route, agent.
    pub identity: RouteIdentity,
    /// `{bridge}/{route}`: the outbox partition and the lease key.
    pub partition: String,
    /// The lease holder: the agent id, stable across restarts.
    pub holder: String,
    /// The claim owner: the holder plus this process's incarnation.
    pub owner: String,
    /// The route's bindings by id.
    pub bindings: HashMap<String, RouteBinding>,
    /// The outbox.
    pub outbox: Arc<dyn OutboxStore>,
    /// The lease store.
    pub leases: Arc<dyn LeaseStore>,
    /// The DLQ, when configured.
    pub dlq: Option<Arc<dyn DlqStore>>,
    /// The sender every binding of the route is on.
    pub sender: Arc<dyn Sender>,
    /// The egress session's connected state.
    pub connected: watch::Receiver<bool>,
    /// Signalled by the writer after each append.
    pub wake: Arc<Notify>,
    /// The writer's back-pressure depth counter.
    pub depth: Arc<OutboxDepth>,
    /// Records per claim.
    pub batch: usize,
    /// The fallback poll.
    pub poll: DrainPoll,
    /// Lease lifetime.
    pub lease_ttl: Duration,
    /// Lease renewal period.
    pub renew_interval: Duration,
    /// How long a cycle in progress may finish at shutdown.
    pub grace: Duration,
    /// `policy.on_expired`.
    pub on_expired: FailureAction,
    /// `policy.on_permanent_failure`.
    pub on_permanent_failure: FailureAction,
    /// `policy.max_replay_attempts`.
    pub max_replay_attempts: u32,
    /// `policy.replay_budget`.
    pub replay_budget: Duration,
    /// Lease-held gauge.
    pub route_metrics: RouteMetrics,
    /// "lease of route X resolved" (we know whether we hold it).
    pub lease_resolved: ReadinessCondition,
    /// What the drainer keeps between cycles (`DrainerState::default()`).
    pub state: DrainerState,
}

/// What a drainer keeps between cycles: outcomes to write again, and the
/// failing/healthy state of its store operations for the logs.
pub struct DrainerState {
    /// Outcomes whose write failed, with the version they were claimed
    /// under (invariant 6).
    leftovers: Mutex<Vec<(u64, cycle::Outcomes)>>,
    /// Until when the lease keeper's grant lasts (`None`: not held); set on
    /// every grant and renewal, cleared on loss (invariant 1).
    held_until: Mutex<Option<SystemTime>>,
    /// When the last expiry sweep started (invariant 5).
    last_sweep: Mutex<Option<Instant>>,
    /// Accepted records a drained cycle left for the next one, with the
    /// version they were claimed under (invariant 9).
    deferred: Mutex<Option<(u64, cycle::Outcomes)>>,
    cycles: FailureLog,
    dlq_writes: FailureLog,
    stats: FailureLog,
}

impl Default for DrainerState {
    fn default() -> Self {
        Self {
            leftovers: Mutex::new(Vec::new()),
            held_until: Mutex::new(None),
            last_sweep: Mutex::new(None),
            deferred: Mutex::new(None),
            cycles: FailureLog::new("drain cycle"),
            dlq_writes: FailureLog::new("drainer dlq write"),
            stats: FailureLog::new("outbox stats"),
        }
    }
}

impl Drainer {
    /// Runs until `shutdown`: keeps the lease and drains while it is held;
    /// then lets a cycle in progress finish within `grace` and releases the
    /// lease.
    pub async fn run(self, shutdown: CancellationToken) {
        let this = Arc::new(self);
        let (lease_tx, lease_rx) = watch::channel(None);
        let keeper = lease::keep(Arc::clone(&this), lease_tx, shutdown.clone());
        let drain = Arc::clone(&this).drain_loop(lease_rx, shutdown.clone());
        let stats = this.stats_loop(shutdown);
        let (held, (), ()) = tokio::join!(keeper, drain, stats);
        if let Some(version) = held {
            match this
                .leases
                .release(&this.partition, &this.holder, version)
                .await
            {
                Ok(()) => tracing::info!(partition = %this.partition, version, "lease released"),
                Err(error) => {
                    tracing::warn!(partition = %this.partition, %error, "releasing the lease failed")
                }
            }
            this.route_metrics.set_lease_held(false);
        }
    }

    async fn drain_loop(
        self: Arc<Self>,
        mut lease: watch::Receiver<Option<u64>>,
        shutdown: CancellationToken,
    ) {
        let mut poll = poll::PollTimer::new(self.poll);
        let mut connected = self.connected.clone();
        loop {
            // Wait for the lease.
            let version = loop {
                if let Some(v) = *lease.borrow_and_update() {
                    break v;
                }
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    changed = lease.changed() => if changed.is_err() { return },
                }
            };
            tracing::info!(partition = %self.partition, version, "draining");
            // A new grant sweeps at its first cycle (invariant 5).
            *self
                .state
                .last_sweep
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = None;
            'cycles: loop {
                let mut lost = lease.clone();
                let lost = async move {
                    // The keeper ends only at shutdown, still holding the
                    // lease (released after this loop): the shutdown branch
                    // lets the cycle finish. Treating its end as a loss
                    // would claim again under the same version, forever.
                    if lost.wait_for(|v| *v != Some(version)).await.is_err() {
                        std::future::pending::<()>().await;
                    }
                };
                tokio::pin!(lost);
                let mut cycle = Box::pin(self.cycle(version, &shutdown));
                let report = tokio::select! {
                    biased;
                    () = &mut lost => break,
                    report = &mut cycle => report,
                    () = shutdown.cancelled() => {
                        // The cycle claims nothing more now; what is in
                        // flight finishes and is written, and so is what a
                        // cycle that drained just before the stop left.
                        let finish = async {
                            let _ = (&mut cycle).await;
                            self.flush_deferred(version).await
                        };
                        if tokio::time::timeout(self.grace, finish).await.is_err() {
                            tracing::warn!(partition = %self.partition, "a drain cycle did not finish within the grace period; its claims are taken back on restart");
                        }
                        return;
                    }
                };
                drop(cycle);
                // A cycle drains until the partition is empty, so the next
                // waits for a write (whose wake-up may already be pending),
                // a reconnect or the fallback poll.
                if report.is_ok() {
                    self.state.cycles.succeeded(&self.partition);
                }
                match report {
                    Ok(r) if r.claimed > 0 => poll.reset(),
                    Ok(_) => poll.empty(),
                    Err(StoreError::Stale(error)) => {
                        // A newer holder exists; the keeper notices at its
                        // next renewal. Do nothing meanwhile.
                        tracing::warn!(partition = %self.partition, %error, "fenced out");
                        poll.empty();
                    }
                    Err(error) => {
                        self.state.cycles.failed(&self.partition, &error);
                        poll.empty();
                    }
                }
                // The records a drained cycle left unwritten are completed
                // by the next cycle, or after `DEFER_FOR` if none comes.
                let poll_after = tokio::time::sleep(poll.interval());
                tokio::pin!(poll_after);
                loop {
                    let deferred = self.has_deferred();
                    tokio::select! {
                        biased;
                        () = shutdown.cancelled() => {
                            if tokio::time::timeout(self.grace, self.flush_deferred(version)).await.is_err() {
                                tracing::warn!(partition = %self.partition, "completing the last delivered records did not finish within the grace period; they are sent again on restart");
                            }
                            return;
                        }
                        () = &mut lost => {
                            self.write_deferred_on_loss(version);
                            break 'cycles;
                        }
                        () = self.wake.notified() => break,
                        () = changed(&mut connected) => break,
                        () = &mut poll_after => break,
                        () = tokio::time::sleep(DEFER_FOR), if deferred => {
                            // The write runs in a task of its own: a stop
                            // or a loss meanwhile is still seen.
                            let flush = self.flush_deferred(version);
                            tokio::pin!(flush);
                            let flushed = tokio::select! {
                                biased;
                                () = shutdown.cancelled() => {
                                    if tokio::time::timeout(self.grace, &mut flush).await.is_err() {
                                        tracing::warn!(partition = %self.partition, "completing the last delivered records did not finish within the grace period; they are sent again on restart");
                                    }
                                    return;
                                }
                                () = &mut lost => break 'cycles,
                                flushed = &mut flush => flushed,
                            };
                            match flushed {
                                Ok(()) | Err(StoreError::Stale(_)) => {}
                                Err(error) => self.state.cycles.failed(&self.partition, &error),
                            }
                        }
                    }
                }
            }
            tracing::warn!(partition = %self.partition, version, "lease lost; stopped draining");
        }
    }
}

impl Drainer {
    /// Records until when the held grant lasts (`None` once lost).
    fn set_held_until(&self, until: Option<SystemTime>) {
        *self
            .state
            .held_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = until;
    }

    /// True once the held grant expired on this agent's clock, or none is
    /// held (invariant 1).
    fn lease_expired(&self) -> bool {
        self.state
            .held_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none_or(|until| SystemTime::now() >= until)
    }

    /// Refreshes the depth and oldest-age gauges every [`STATS_EVERY`] until
    /// `shutdown` (invariant 8).
    async fn stats_loop(&self, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(STATS_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => self.update_stats().await,
            }
        }
    }

    async fn update_stats(&self) {
        let changes = self.depth.changes();
        match self.outbox.stats(&self.partition).await {
            Ok(stats) => {
                self.state.stats.succeeded(&self.partition);
                let now = SystemTime::now();
                self.depth.refresh(stats.total.depth, changes);
                for (id, b) in &self.bindings {
                    let s = stats.bindings.get(id).cloned().unwrap_or_default();
                    b.metrics.set_outbox(s.depth, s.oldest_pending_age(now));
                }
            }
            Err(error) => self.state.stats.failed(&self.partition, &error),
        }
    }
}

/// Resolves when the connected state changes; never once the session is gone
/// (the fallback poll and shutdown still end the wait).
async fn changed(connected: &mut watch::Receiver<bool>) {
    if connected.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}
