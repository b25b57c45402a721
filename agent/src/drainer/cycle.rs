//! One drain cycle: expire, then stream claimed batches through per-binding
//! send lanes while completing, releasing and dead-lettering what came back
//! in as few store calls as possible.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, PoisonError};
use std::time::{Instant, SystemTime};

use futures::StreamExt;
use futures::future::{BoxFuture, OptionFuture};
use futures::stream::FuturesUnordered;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{Drainer, SEND_WINDOW, SWEEP_EVERY};
use crate::metrics::Terminal;
use crate::routes::{Failure, write_disposal};
use crate::spans::{self, disposal_name};
use crate::stores::{DlqReason, OutboxRecord, Release, StoreError, StoreResult};
use crate::transports::{Address, SendError};
use ferry_shared::config::FailureAction;

/// What a cycle did.
#[derive(Debug, Default)]
pub(super) struct Report {
    /// Records claimed for sending (0 when skipped or empty).
    pub claimed: usize,
}

/// One binding's records in send order.
struct Lane {
    binding: String,
    /// Claimed, not yet started, in `seq` order.
    queue: VecDeque<OutboxRecord>,
    /// Sends started and not yet answered.
    in_flight: usize,
    /// A send failed: nothing more of this binding starts in this cycle.
    stopped: bool,
}

impl Lane {
    fn new(binding: &str) -> Self {
        Lane {
            binding: binding.to_owned(),
            queue: VecDeque::new(),
            in_flight: 0,
            stopped: false,
        }
    }

    /// Starts nothing more; the queued records go back untried.
    fn stop(&mut self, outcomes: &mut Outcomes) {
        self.stopped = true;
        outcomes.untried.extend(self.queue.drain(..).map(|r| r.seq));
    }
}

/// The lanes of a cycle, in the order their bindings first came. A route
/// has a few bindings, so a lane is found by comparing names, which costs
/// less than hashing one; a send carries its lane's index back.
#[derive(Default)]
struct Lanes(Vec<Lane>);

impl Lanes {
    /// The index of `binding`'s lane, created on its first record.
    fn index(&mut self, binding: &str) -> usize {
        match self.0.iter().position(|lane| lane.binding == binding) {
            Some(i) => i,
            None => {
                self.0.push(Lane::new(binding));
                self.0.len() - 1
            }
        }
    }
}

/// Outcomes waiting to be written.
#[derive(Default)]
pub(super) struct Outcomes {
    accepted: Vec<OutboxRecord>,
    /// Expired since the cycle's sweep: `on_expired` applies.
    expired: Vec<OutboxRecord>,
    dead: Vec<(OutboxRecord, Failure)>,
    failed: BTreeMap<String, Vec<u64>>,
    untried: Vec<u64>,
    /// A `complete` of these outcomes failed without knowing whether it was
    /// applied (its answer was lost): written again under the same version,
    /// the records it finds gone were deleted by that earlier attempt.
    completion_unknown: bool,
}

/// Most accepted records a batch of outcomes makes room for before they come.
const PREALLOCATED_OUTCOMES: usize = 1024;

impl Outcomes {
    /// Room for a batch's accepted records (up to [`PREALLOCATED_OUTCOMES`]:
    /// `drain_batch_size` has no upper limit): they are written a batch's
    /// worth at a time, and growing the vector from empty moved the records
    /// again at every doubling.
    fn for_batch(batch: usize) -> Self {
        Outcomes {
            accepted: Vec::with_capacity(batch.min(PREALLOCATED_OUTCOMES)),
            ..Outcomes::default()
        }
    }

    /// Only accepted records, at most `batch` of them, and no completion
    /// whose outcome is unknown: what a cycle may leave for the next one.
    fn deferrable(&self, batch: usize) -> bool {
        self.accepted.len() <= batch
            && self.expired.is_empty()
            && self.dead.is_empty()
            && self.failed.is_empty()
            && self.untried.is_empty()
            && !self.completion_unknown
    }

    fn len(&self) -> usize {
        self.accepted.len()
            + self.expired.len()
            + self.dead.len()
            + self.failed.values().map(Vec::len).sum::<usize>()
            + self.untried.len()
    }
}

/// A send's lane (its index in [`Lanes`]), record and result.
type SendOutcome = (usize, OutboxRecord, Result<(), SendError>);

impl Drainer {
    /// Writes what an earlier cycle under `version` could not, then expires
    /// what is due and drains the partition (see [`Drainer::drain`]). After
    /// `stop` no more is claimed; what is in flight finishes. A cycle that
    /// drained the partition may leave its last accepted records to the next
    /// one (invariant 9 of the drainer).
    pub(super) async fn cycle(
        self: &Arc<Self>,
        version: u64,
        stop: &CancellationToken,
    ) -> StoreResult<Report> {
        self.retry_leftovers(version).await?;
        let now = SystemTime::now();
        let sweep = self.sweep_due();
        let expiry = async {
            if !sweep {
                return Ok(());
            }
            let expired = self
                .outbox
                .expire(&self.partition, &self.owner, version, now, self.batch)
                .await?;
            if !expired.is_empty() {
                let outcomes = Outcomes {
                    expired,
                    ..Outcomes::default()
                };
                joined(self.spawn_write(version, outcomes).await)?;
            }
            Ok(())
        };
        let (expiry, report) = tokio::join!(expiry, self.drain(version, stop));
        let report = report?;
        expiry?;
        Ok(report)
    }

    /// Keeps a drained cycle's accepted records for the next cycle
    /// (invariant 9).
    fn defer(&self, version: u64, outcomes: Outcomes) {
        *self
            .state
            .deferred
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some((version, outcomes));
    }

    /// The accepted records a cycle under `version` left unwritten; those
    /// of an older version are void (its claims went back to pending) and
    /// are dropped.
    fn take_deferred(&self, version: u64) -> Option<Outcomes> {
        self.state
            .deferred
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .filter(|(v, _)| *v == version)
            .map(|(_, outcomes)| outcomes)
    }

    /// Whether a cycle left accepted records unwritten.
    pub(super) fn has_deferred(&self) -> bool {
        self.state
            .deferred
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    /// Completes the accepted records a cycle under `version` left, when no
    /// cycle came to write them (invariant 9). A failed write keeps them for
    /// the next cycle, like any outcome; the write finishes (and counts)
    /// even if this future is dropped.
    pub(super) async fn flush_deferred(self: &Arc<Self>, version: u64) -> StoreResult<()> {
        match self.take_deferred(version) {
            Some(outcomes) => joined(self.spawn_write(version, outcomes).await),
            None => Ok(()),
        }
    }

    /// On a lease loss, starts the write of the records a cycle under
    /// `version` left, as a dropped cycle's write goes on (invariant 7):
    /// the store completes them unless a newer holder took them back.
    pub(super) fn write_deferred_on_loss(self: &Arc<Self>, version: u64) {
        if let Some(outcomes) = self.take_deferred(version) {
            drop(self.spawn_write(version, outcomes));
        }
    }

    /// A cycle, then the write of the accepted records it left for the next
    /// one: all a cycle on its own writes. The first error of the two.
    #[cfg(test)]
    pub(super) async fn cycle_and_flush(
        self: &Arc<Self>,
        version: u64,
        stop: &CancellationToken,
    ) -> StoreResult<Report> {
        let report = self.cycle(version, stop).await;
        let flushed = self.flush_deferred(version).await;
        report.and_then(|r| flushed.map(|()| r))
    }

    /// Whether this cycle sweeps for expired records (invariant 5): the
    /// first one does, and then one at most every [`SWEEP_EVERY`].
    fn sweep_due(&self) -> bool {
        let mut last = self
            .state
            .last_sweep
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let due = last.is_none_or(|t| t.elapsed() >= SWEEP_EVERY);
        if due {
            *last = Some(Instant::now());
        }
        due
    }

    /// Writes again the outcomes whose write failed under `version` (their
    /// records are still claimed under it); those of an older version are
    /// void — its claims went back to pending — and are dropped. Each write
    /// runs in its own task, like every outcome write (invariant 7); after a
    /// failure the rest are kept for the next cycle.
    async fn retry_leftovers(self: &Arc<Self>, version: u64) -> StoreResult<()> {
        let leftovers = std::mem::take(
            &mut *self
                .state
                .leftovers
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        let mut leftovers = leftovers.into_iter().filter(|(v, _)| *v == version);
        while let Some((_, outcomes)) = leftovers.next() {
            if let Err(error) = joined(self.spawn_write(version, outcomes).await) {
                // The failed one is kept by its task; keep the rest too.
                self.state
                    .leftovers
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .extend(leftovers);
                return Err(error);
            }
        }
        Ok(())
    }

    /// Writes `outcomes` in a task of its own, so that the write — and the
    /// counting of what it completed — finishes even if the cycle is dropped
    /// (lease loss): a completion handed to the store is counted exactly when
    /// the store applied it.
    fn spawn_write(
        self: &Arc<Self>,
        version: u64,
        outcomes: Outcomes,
    ) -> JoinHandle<StoreResult<()>> {
        let this = Arc::clone(self);
        tokio::spawn(async move { this.write_or_keep(version, outcomes).await })
    }

    /// [`Drainer::write_outcomes`]; on failure keeps `outcomes` for the next
    /// cycle under the same version (unless fenced out: then the claims are
    /// void and nothing is left to write).
    async fn write_or_keep(&self, version: u64, mut outcomes: Outcomes) -> StoreResult<()> {
        let result = self.write_outcomes(version, &mut outcomes).await;
        if let Err(error) = &result
            && !matches!(error, StoreError::Stale(_))
        {
            self.state
                .leftovers
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push((version, outcomes));
        }
        result
    }

    /// Claims batches and sends them until the partition is empty, a send
    /// fails, or `stop` (invariant 6). Each binding has a lane: its records
    /// start in `seq` order as soon as they are claimed, behind those of
    /// earlier batches, at most [`SEND_WINDOW`] in flight. Outcomes are
    /// written a batch's worth at a time, and the remainder once nothing
    /// else is in flight — or, once the partition is drained and nothing
    /// but accepted records remain, by the next cycle beside its first
    /// claim (invariant 9 of the drainer). A batch is claimed while at most two are unsettled
    /// besides the outcomes being written, so the claim goes to the store
    /// with the write that makes room for it (usually sharing its commit)
    /// instead of after it; its records are held unsent until that write
    /// succeeded, so at most three batches are ever sent and not yet
    /// settled (the crash duplicate window, invariant 2). After a failed send nothing more is
    /// claimed and the failed binding's queued records go back untried; the
    /// cycle ends once everything in flight is settled, so the next one
    /// starts again at the lowest pending `seq` of every binding. After
    /// `stop` or a failed write every lane stops that way.
    async fn drain(
        self: &Arc<Self>,
        version: u64,
        stop: &CancellationToken,
    ) -> StoreResult<Report> {
        let mut report = Report::default();
        // The last cycle's accepted records are written beside the first
        // claim, usually in one commit with it (invariant 9).
        let deferred = self.take_deferred(version);
        if !*self.connected.borrow() {
            if let Some(outcomes) = deferred {
                joined(self.spawn_write(version, outcomes).await)?;
            }
            return Ok(report);
        }
        let mut lanes = Lanes::default();
        let mut sends: FuturesUnordered<BoxFuture<'static, SendOutcome>> = FuturesUnordered::new();
        let mut outcomes = Outcomes::for_batch(self.batch);
        let mut claiming: Option<BoxFuture<'_, StoreResult<Vec<OutboxRecord>>>> = None;
        let mut writing_count = deferred.as_ref().map_or(0, Outcomes::len);
        let mut writing: Option<JoinHandle<StoreResult<()>>> =
            deferred.map(|outcomes| self.spawn_write(version, outcomes));
        // The claim in flight was let through by the outcomes being written
        // (there was no room without them): its records wait for that write.
        let mut claim_awaits_write = false;
        // A batch so claimed and answered before its write: unsent until
        // the write succeeded.
        let mut held: Option<Vec<OutboxRecord>> = None;
        // Claimed and not yet settled: held, queued, in flight, in
        // `outcomes` or being written.
        let mut unsettled = writing_count;
        // A claim came back short: the partition is drained.
        let mut more = true;
        // A send, a claim or a write failed, or shutdown: claim nothing more.
        let mut interrupted = false;
        let mut stopping = false;
        let mut error = None;
        // Made once: a new one per turn of the loop registers with the token
        // and unregisters again each time.
        let cancelled = stop.cancelled();
        tokio::pin!(cancelled);
        loop {
            if !stopping && stop.is_cancelled() {
                // Shutdown: what is in flight finishes, nothing more starts.
                stopping = true;
                interrupted = true;
                halt(&mut lanes, &mut outcomes);
            }
            self.halt_if_expired(&mut interrupted, &mut lanes, &mut outcomes);
            // A claim may go out while at most two batches are unsettled.
            let may_claim = claiming.is_none() && held.is_none() && more && !interrupted;
            let limit = 2 * self.batch;
            // A batch's worth of outcomes is written at once; the rest when
            // nothing else is coming (no send, and no claim in flight or
            // about to go out).
            let idle = claiming.is_none() && sends.is_empty() && !(may_claim && unsettled <= limit);
            if writing.is_none() && (outcomes.len() >= self.batch || (idle && outcomes.len() > 0)) {
                if idle
                    && !more
                    && !interrupted
                    && held.is_none()
                    && outcomes.deferrable(self.batch)
                {
                    // Drained, and nothing but accepted records to write:
                    // the next cycle writes them beside its first claim.
                    self.defer(version, outcomes);
                    break;
                }
                let taken = std::mem::replace(&mut outcomes, Outcomes::for_batch(self.batch));
                writing_count = taken.len();
                writing = Some(self.spawn_write(version, taken));
            }
            // The outcomes being written make room at once: the claim they
            // let through is held until they are written.
            let being_written = if writing.is_some() { writing_count } else { 0 };
            if may_claim && unsettled - being_written <= limit {
                claim_awaits_write = unsettled > limit;
                claiming = Some(self.outbox.claim(
                    &self.partition,
                    &self.owner,
                    version,
                    self.batch,
                    SystemTime::now(),
                ));
            }
            if claiming.is_none() && writing.is_none() && sends.is_empty() {
                break;
            }
            // Outcomes first, so a failing binding stops as early as possible.
            tokio::select! {
                biased;
                () = &mut cancelled, if !stopping => {}
                Some((lane, record, result)) = sends.next(), if !sends.is_empty() => {
                    // Every record in flight came through its lane.
                    let lane = &mut lanes.0[lane];
                    lane.in_flight = lane.in_flight.saturating_sub(1);
                    match result {
                        Ok(()) => outcomes.accepted.push(record),
                        Err(e) => {
                            tracing::debug!(partition = %self.partition, seq = record.seq, binding = %record.binding, error = %e, "send failed");
                            interrupted = true;
                            lane.stop(&mut outcomes);
                            self.failed(record, e, &mut outcomes);
                        }
                    }
                }
                Some(claimed) = OptionFuture::from(claiming.as_mut()), if claiming.is_some() => {
                    claiming = None;
                    match claimed {
                        Ok(records) => {
                            more = records.len() >= self.batch;
                            report.claimed += records.len();
                            unsettled += records.len();
                            if claim_awaits_write {
                                held = Some(records);
                            } else {
                                self.enqueue(records, interrupted, &mut lanes, &mut outcomes);
                            }
                        }
                        Err(e) => {
                            interrupted = true;
                            error.get_or_insert(e);
                        }
                    }
                }
                Some(written) = OptionFuture::from(writing.as_mut()), if writing.is_some() => {
                    writing = None;
                    claim_awaits_write = false;
                    unsettled -= writing_count;
                    if let Err(e) = joined(written) {
                        // Those outcomes are written again before the next
                        // claim (`retry_leftovers`). Start nothing more; what
                        // is in flight finishes and its outcome is still
                        // written if the store allows.
                        interrupted = true;
                        halt(&mut lanes, &mut outcomes);
                        error.get_or_insert(e);
                    }
                    if let Some(records) = held.take() {
                        self.enqueue(records, interrupted, &mut lanes, &mut outcomes);
                    }
                }
            }
            // Checked again here: a pause may have ended with this very select.
            self.halt_if_expired(&mut interrupted, &mut lanes, &mut outcomes);
            self.start_sends(&mut lanes, &mut sends);
        }
        match error {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    /// Past the held grant's expiry (a process resumed from a pause, before
    /// its lease keeper noticed): claims nothing more, starts no send, and
    /// gives the queued records back (invariant 1 of the drainer).
    fn halt_if_expired(&self, interrupted: &mut bool, lanes: &mut Lanes, outcomes: &mut Outcomes) {
        if !*interrupted && self.lease_expired() {
            tracing::warn!(partition = %self.partition, "the lease expired during a drain cycle; starting nothing more");
            *interrupted = true;
            halt(lanes, outcomes);
        }
    }

    /// Sorts claimed records: expired ones get `on_expired` (here, not in the
    /// next sweep: a claim of nothing but expired records would otherwise
    /// come back forever), exhausted ones go to the DLQ, the rest to their
    /// binding's lane, or back untried if that lane has stopped. Once the
    /// cycle is `interrupted` every record goes back untried: a claim that
    /// was in flight when it stopped must not open a lane for a binding
    /// that had none yet.
    fn enqueue(
        &self,
        records: Vec<OutboxRecord>,
        interrupted: bool,
        lanes: &mut Lanes,
        outcomes: &mut Outcomes,
    ) {
        if interrupted {
            outcomes.untried.extend(records.iter().map(|r| r.seq));
            return;
        }
        let now = SystemTime::now();
        for r in records {
            if r.envelope.is_expired(now) {
                outcomes.expired.push(r);
            } else if self.exhausted(r.replay_count, r.first_attempt_at, now) {
                let f = Failure {
                    reason: DlqReason::ReplayExhausted,
                    error: r.last_error.clone().unwrap_or_default(),
                    attempts: r.replay_count,
                    first_attempt_at: r.first_attempt_at,
                    last_attempt_at: None,
                };
                outcomes.dead.push((r, f));
            } else {
                let i = lanes.index(&r.binding);
                let lane = &mut lanes.0[i];
                if lane.stopped {
                    outcomes.untried.push(r.seq);
                } else {
                    lane.queue.push_back(r);
                }
            }
        }
    }

    /// Starts queued records while their lane has room. Futures are first
    /// polled in push order, so each binding's publishes reach the
    /// connection in record order.
    fn start_sends(
        &self,
        lanes: &mut Lanes,
        sends: &mut FuturesUnordered<BoxFuture<'static, SendOutcome>>,
    ) {
        for (i, lane) in lanes.0.iter_mut().enumerate() {
            while !lane.stopped && lane.in_flight < SEND_WINDOW {
                let Some(r) = lane.queue.pop_front() else {
                    break;
                };
                lane.in_flight += 1;
                let sender = Arc::clone(&self.sender);
                sends.push(Box::pin(async move {
                    // Shared with the record: no copy per send.
                    let address = Address::new(Arc::clone(&r.address));
                    let attempt = r.replay_count.saturating_add(1);
                    let result =
                        spans::send(&*sender, &r.envelope, &r.binding, &address, attempt).await;
                    (i, r, result)
                }));
            }
        }
    }

    /// Files a failed send: a permanent error or an exhausted budget goes to
    /// the DLQ, anything else is released counted.
    fn failed(&self, r: OutboxRecord, error: SendError, outcomes: &mut Outcomes) {
        let attempted_at = SystemTime::now();
        let first = r.first_attempt_at.unwrap_or(attempted_at);
        let reason = match &error {
            SendError::Permanent(_) => DlqReason::PermanentError,
            SendError::Oversized(_) => DlqReason::Oversized,
            _ if self.exhausted(r.replay_count + 1, Some(first), attempted_at) => {
                DlqReason::ReplayExhausted
            }
            _ => {
                outcomes
                    .failed
                    .entry(error.to_string())
                    .or_default()
                    .push(r.seq);
                return;
            }
        };
        let error = match error {
            SendError::Permanent(e) | SendError::Oversized(e) => e,
            other => other.to_string(),
        };
        let f = Failure {
            reason,
            error,
            attempts: r.replay_count + 1,
            first_attempt_at: Some(first),
            last_attempt_at: Some(attempted_at),
        };
        outcomes.dead.push((r, f));
    }

    /// Dead-letters (or drops) what must be, then writes every outcome: one
    /// `complete` for everything terminal (accepted or disposed), one counted
    /// `release` per distinct error, one uncounted `release` for the rest. A
    /// record whose DLQ write failed is released untried and retried. On
    /// failure `outcomes` keeps what is left to write: once the completion
    /// succeeded, only the releases. Safe to repeat: a DLQ write is
    /// idempotent by id, and `complete` and `release` act only on records
    /// still claimed under `version`, so nothing is counted twice.
    async fn write_outcomes(&self, version: u64, outcomes: &mut Outcomes) -> StoreResult<()> {
        let expired = outcomes
            .expired
            .iter()
            .map(|r| (r, expiry_failure(r), self.on_expired));
        let dead = outcomes
            .dead
            .iter()
            .map(|(r, f)| (r, f.clone(), self.on_permanent_failure));
        let (disposed, retry) = self.dispose_all(expired.chain(dead)).await;
        let completed = self
            .complete_terminal(
                version,
                &disposed,
                &outcomes.accepted,
                outcomes.completion_unknown,
            )
            .await;
        if let Err(error) = &completed
            && !error.outcome_known()
        {
            outcomes.completion_unknown = true;
        }
        completed?;
        outcomes.accepted.clear();
        outcomes.expired.clear();
        outcomes.dead.clear();
        outcomes.completion_unknown = false;
        outcomes.untried.extend(retry);
        self.release_rest(version, outcomes).await
    }

    /// Applies each record's failure action (without counting it: see
    /// [`Drainer::complete_terminal`]); returns the records disposed of with their
    /// terminal state, and the seqs to retry (their DLQ write failed, or
    /// their binding is unknown).
    async fn dispose_all<'r>(
        &self,
        records: impl Iterator<Item = (&'r OutboxRecord, Failure, FailureAction)>,
    ) -> (Vec<(&'r OutboxRecord, Terminal)>, Vec<u64>) {
        let (mut done, mut retry) = (Vec::new(), Vec::new());
        for (r, failure, action) in records {
            let Some(binding) = self.bindings.get(&*r.binding) else {
                retry.push(r.seq);
                continue;
            };
            let span = spans::dispose(
                disposal_name(failure.reason),
                &r.binding,
                failure.reason.as_str(),
                &r.envelope.trace,
            );
            match span
                .scope(write_disposal(
                    &self.identity,
                    self.dlq.as_ref(),
                    action,
                    binding,
                    r.id.clone(),
                    &r.envelope,
                    failure,
                ))
                .await
            {
                Ok((terminal, _)) => {
                    self.state.dlq_writes.succeeded(&self.partition);
                    done.push((r, terminal));
                }
                Err(error) => {
                    tracing::debug!(partition = %self.partition, seq = r.seq, %error, "dlq write failed; the record is retried");
                    self.state.dlq_writes.failed(&self.partition, &error);
                    retry.push(r.seq);
                }
            }
        }
        (done, retry)
    }

    fn exhausted(&self, replay_count: u32, first: Option<SystemTime>, now: SystemTime) -> bool {
        replay_count > self.max_replay_attempts
            && first.is_some_and(|t| now.duration_since(t).unwrap_or_default() > self.replay_budget)
    }

    /// Completes every terminal record (accepted or disposed) and counts
    /// each one the `complete` deleted — and only those — as `sent` or its
    /// disposal's terminal state (see the module's counting invariant).
    /// After a completion whose outcome was not known (`after_unknown`), the
    /// records already gone were deleted by it and are counted too: this
    /// write is under the same version (older leftovers are dropped), and a
    /// `complete` that is not `Stale` proves no newer holder took them back,
    /// so nothing but that attempt could have deleted them. Two cases miss:
    /// a disposed record the lost completion deleted whose DLQ write fails
    /// in the retry is not counted (it is not completed again, though its
    /// entry exists), and a store that also lost committed writes (a
    /// failover to an asynchronous replica) may have made a record pending
    /// again, which is then counted now and once more when it is sent again.
    async fn complete_terminal(
        &self,
        version: u64,
        disposed: &[(&OutboxRecord, Terminal)],
        accepted: &[OutboxRecord],
        after_unknown: bool,
    ) -> StoreResult<()> {
        let terminal: Vec<(&OutboxRecord, Terminal)> = accepted
            .iter()
            .map(|r| (r, Terminal::Sent))
            .chain(disposed.iter().copied())
            .collect();
        if terminal.is_empty() {
            return Ok(());
        }
        let seqs: Vec<u64> = terminal.iter().map(|(r, _)| r.seq).collect();
        let done = self
            .outbox
            .complete(&self.partition, version, &seqs)
            .await?;
        let now = SystemTime::now();
        for (r, t) in &terminal {
            if (after_unknown || done.binary_search(&r.seq).is_ok())
                && let Some(b) = self.bindings.get(&*r.binding)
            {
                b.metrics
                    .finished(*t, 1, now.duration_since(r.created_at).ok());
            }
        }
        let gone = if after_unknown {
            seqs.len()
        } else {
            done.len()
        };
        self.depth.sub(gone as u64);
        Ok(())
    }

    /// Releases the failed records (one counted `release` per distinct
    /// error) and the untried ones (one uncounted `release`).
    async fn release_rest(&self, version: u64, outcomes: &Outcomes) -> StoreResult<()> {
        let attempted_at = SystemTime::now();
        for (error, seqs) in &outcomes.failed {
            self.outbox
                .release(
                    &self.partition,
                    version,
                    seqs,
                    Release::Failed {
                        error: error.clone(),
                        attempted_at,
                    },
                )
                .await?;
        }
        if !outcomes.untried.is_empty() {
            self.outbox
                .release(
                    &self.partition,
                    version,
                    &outcomes.untried,
                    Release::Untried,
                )
                .await?;
        }
        Ok(())
    }
}

/// A write task's result; a task that panicked or was aborted wrote nothing
/// certain.
fn joined(result: Result<StoreResult<()>, tokio::task::JoinError>) -> StoreResult<()> {
    result.unwrap_or_else(|e| Err(StoreError::Unavailable(format!("outcome write task: {e}"))))
}

/// Stops every lane: its queued records go back untried.
fn halt(lanes: &mut Lanes, outcomes: &mut Outcomes) {
    for lane in &mut lanes.0 {
        lane.stop(outcomes);
    }
}

/// The failure an expired record is disposed of with.
fn expiry_failure(r: &OutboxRecord) -> Failure {
    Failure {
        reason: DlqReason::Expired,
        error: "expired before delivery".into(),
        attempts: r.replay_count,
        first_attempt_at: r.first_attempt_at,
        last_attempt_at: None,
    }
}
