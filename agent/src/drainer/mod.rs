//! The drainer: sends a `shared_outbox` partition's records (DESIGN §4.4).
//!
//! Invariants:
//!
//! 1. **Only the lease holder drains.** [`lease`] acquires the partition's
//!    lease and renews it every `renew_interval`; the drain loop runs cycles
//!    only under the version it holds. On loss the current cycle is dropped at
//!    once — its completions would be rejected as stale anyway — and a new
//!    holder's higher version takes every claim back. At start the drainer
//!    releases a grant its own previous incarnation still holds (same agent
//!    id), so a restart fences out the dead process at once instead of waiting
//!    for its claims to go stale.
//! 2. **A record is completed only after its destination accepted it, or
//!    after its DLQ entry is durable.** A crash between the send and the
//!    completion re-sends the record: the duplicate window is the records
//!    claimed and not yet settled — at most 3 × `drain_batch_size` per crash,
//!    because a batch is claimed only while at most two are unsettled (see
//!    invariant 6). (The expiry sweep claims up to one batch more, but never
//!    sends it: a crash repeats its DLQ writes, which are idempotent by id.)
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
//! 5. **Expiry is fenced too.** Each cycle (also while disconnected) claims
//!    expired pending records (`OutboxStore::expire`), applies `on_expired`,
//!    and only then completes them.
//! 6. **The drain streams, never reorders.** A cycle claims batch after
//!    batch while the partition has records, and each batch's records join
//!    their binding's send lane as soon as they are claimed, behind the
//!    earlier ones, so the connection does not idle between batches. A batch
//!    is claimed once at most two are unsettled (sent or queued, outcome not
//!    yet written); outcomes are written a batch's worth at a time, together
//!    with the claim they let through. After any failure the cycle claims
//!    nothing more, lets what is in flight finish, writes every outcome, and
//!    ends, so the next cycle starts again at the lowest pending `seq` of
//!    every binding. On lease loss the cycle is dropped (the new holder's
//!    version takes its claims back); at shutdown it claims nothing more and
//!    finishes within the grace period.
//!
//! Work arrives through a [`Notify`] the writer signals after each append;
//! otherwise the fallback poll is `drain_interval` or adaptive backoff.

mod cycle;
mod lease;
mod poll;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use ferry_shared::config::{DrainPoll, FailureAction};
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use crate::admin::ReadinessCondition;
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
}

impl Drainer {
    /// Runs until `shutdown`: keeps the lease and drains while it is held;
    /// then lets a cycle in progress finish within `grace` and releases the
    /// lease.
    pub async fn run(self, shutdown: CancellationToken) {
        let this = Arc::new(self);
        let (lease_tx, lease_rx) = watch::channel(None);
        let keeper = lease::keep(Arc::clone(&this), lease_tx, shutdown.clone());
        let drain = Arc::clone(&this).drain_loop(lease_rx, shutdown);
        let (held, ()) = tokio::join!(keeper, drain);
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
            let mut last_stats = None;
            loop {
                let mut lost = lease.clone();
                let lost = async move {
                    // An error means the keeper is gone: stop too.
                    let _ = lost.wait_for(|v| *v != Some(version)).await;
                };
                tokio::pin!(lost);
                let mut cycle = Box::pin(self.cycle(version, &mut last_stats, &shutdown));
                let report = tokio::select! {
                    biased;
                    () = &mut lost => break,
                    report = &mut cycle => report,
                    () = shutdown.cancelled() => {
                        // The cycle claims nothing more now; what is in
                        // flight finishes and is written.
                        if tokio::time::timeout(self.grace, &mut cycle).await.is_err() {
                            tracing::warn!(partition = %self.partition, "a drain cycle did not finish within the grace period; its claims are taken back on restart");
                        }
                        return;
                    }
                };
                drop(cycle);
                // A cycle drains until the partition is empty, so the next
                // waits for a write (whose wake-up may already be pending),
                // a reconnect or the fallback poll.
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
                        tracing::warn!(partition = %self.partition, %error, "drain cycle failed");
                        poll.empty();
                    }
                }
                tokio::select! {
                    biased;
                    () = shutdown.cancelled() => return,
                    () = &mut lost => break,
                    () = self.wake.notified() => {}
                    () = changed(&mut connected) => {}
                    () = tokio::time::sleep(poll.interval()) => {}
                }
            }
            tracing::warn!(partition = %self.partition, version, "lease lost; stopped draining");
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
