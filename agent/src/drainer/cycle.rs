//! One drain cycle: expire, claim, send per binding in order, then complete,
//! release and dead-letter in as few store calls as possible.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use futures::StreamExt;
use futures::stream::FuturesOrdered;

use super::{Drainer, SEND_WINDOW, STATS_EVERY};
use crate::metrics::Terminal;
use crate::routes::{Failure, dispose};
use crate::stores::{DlqReason, OutboxRecord, Release, StoreResult};
use crate::transports::{Address, SendError};

/// What a cycle did.
#[derive(Debug, Default)]
pub(super) struct Report {
    /// Records claimed for sending (0 when skipped or empty).
    pub claimed: usize,
}

/// A batch claimed ahead, with the previous batch's completion still to be
/// written (every record of that batch was accepted or disposed).
#[derive(Debug)]
pub(crate) struct Ahead {
    records: Vec<OutboxRecord>,
    done: Vec<u64>,
    accepted: Vec<OutboxRecord>,
}

/// How one record's turn ended.
enum Turn {
    Accepted,
    Failed(SendError),
    Untried,
}

impl Drainer {
    /// `ahead` carries a batch claimed while the previous one was being
    /// sent (see [`Drainer::drain`]); the drain loop keeps it between cycles.
    pub(super) async fn cycle(
        &self,
        version: u64,
        last_stats: &mut Option<Instant>,
        ahead: &mut Option<Ahead>,
    ) -> StoreResult<Report> {
        let now = SystemTime::now();
        let expiry = async {
            let expired = self
                .outbox
                .expire(&self.partition, &self.owner, version, now, self.batch)
                .await?;
            if !expired.is_empty() {
                self.finish_expired(version, expired).await?;
            }
            Ok(())
        };
        let (expiry, drained) = tokio::join!(expiry, self.drain(version, now, ahead));
        let report = Report { claimed: drained? };
        expiry?;
        if last_stats.is_none_or(|t| t.elapsed() >= STATS_EVERY) {
            *last_stats = Some(Instant::now());
            self.update_stats().await;
        }
        Ok(report)
    }

    /// Claims a batch (or takes the one claimed ahead) and delivers it;
    /// returns how many records it held. While a full batch is sent, the
    /// previous batch's completion and the next batch's claim are written
    /// (queued together, they share a commit), so the writer's commits
    /// overlap the sends instead of following them. The next batch is only
    /// sent if every record of this one was accepted or disposed; otherwise
    /// it is released untried, so the next claim starts again at the lowest
    /// pending `seq` of every binding (order, invariant 3).
    async fn drain(
        &self,
        version: u64,
        now: SystemTime,
        ahead: &mut Option<Ahead>,
    ) -> StoreResult<usize> {
        if !*self.connected.borrow() {
            // Nothing is sent while disconnected: write the completion and
            // give the batch claimed ahead back.
            if let Some(a) = ahead.take() {
                self.flush(version, a).await?;
            }
            return Ok(0);
        }
        let (records, previous) = match ahead.take() {
            Some(a) => (a.records, Some((a.done, a.accepted))),
            None => {
                let r = self
                    .outbox
                    .claim(&self.partition, &self.owner, version, self.batch, now)
                    .await?;
                (r, None)
            }
        };
        let claimed = records.len();
        if claimed == 0 {
            return Ok(0);
        }
        *ahead = self
            .deliver(version, records, previous, claimed >= self.batch)
            .await?;
        Ok(claimed)
    }

    /// Writes a batch claimed ahead's pending completion and releases the
    /// batch untried.
    pub(super) async fn flush(&self, version: u64, a: Ahead) -> StoreResult<()> {
        let settled = self
            .settle(version, &a.done, &a.accepted, Vec::new(), &[])
            .await;
        let released = self.release_untried(version, &a.records).await;
        settled.and(released)
    }

    pub(super) async fn release_untried(
        &self,
        version: u64,
        records: &[OutboxRecord],
    ) -> StoreResult<()> {
        if records.is_empty() {
            return Ok(());
        }
        let seqs: Vec<u64> = records.iter().map(|r| r.seq).collect();
        self.outbox
            .release(&self.partition, version, &seqs, Release::Untried)
            .await
            .map(|_| ())
    }

    async fn finish_expired(&self, version: u64, records: Vec<OutboxRecord>) -> StoreResult<()> {
        let mut done = Vec::new();
        let mut retry = Vec::new();
        for r in records {
            let Some(binding) = self.bindings.get(&r.binding) else {
                retry.push(r.seq);
                continue;
            };
            let failure = Failure {
                reason: DlqReason::Expired,
                error: "expired before delivery".into(),
                attempts: r.replay_count,
                first_attempt_at: r.first_attempt_at,
                last_attempt_at: None,
            };
            match dispose(
                &self.identity,
                self.dlq.as_ref(),
                self.on_expired,
                binding,
                r.id.clone(),
                &r.envelope,
                failure,
                r.created_at,
                false,
            )
            .await
            {
                Ok(_) => done.push(r.seq),
                Err(error) => {
                    tracing::warn!(partition = %self.partition, seq = r.seq, %error, "dlq write failed; the record is retried");
                    retry.push(r.seq);
                }
            }
        }
        self.settle(version, &done, &[], Vec::new(), &retry).await
    }

    /// Sends one batch while writing `previous`'s completion and, with
    /// `claim_next`, claiming the next batch. Settles the batch, or, when
    /// every record was accepted or disposed and a next batch was claimed,
    /// returns that batch with this one's completion still to be written.
    async fn deliver(
        &self,
        version: u64,
        records: Vec<OutboxRecord>,
        previous: Option<(Vec<u64>, Vec<OutboxRecord>)>,
        claim_next: bool,
    ) -> StoreResult<Option<Ahead>> {
        let now = SystemTime::now();
        // Group by binding, keeping seq order inside each group.
        let mut groups: BTreeMap<String, Vec<OutboxRecord>> = BTreeMap::new();
        let mut dead: Vec<(OutboxRecord, Failure)> = Vec::new();
        let mut untried = Vec::new();
        for r in records {
            if r.envelope.is_expired(now) {
                // Expired after this cycle's sweep: released untried, the
                // next sweep applies `on_expired`.
                untried.push(r.seq);
            } else if self.exhausted(r.replay_count, r.first_attempt_at, now) {
                let f = Failure {
                    reason: DlqReason::ReplayExhausted,
                    error: r.last_error.clone().unwrap_or_default(),
                    attempts: r.replay_count,
                    first_attempt_at: r.first_attempt_at,
                    last_attempt_at: None,
                };
                dead.push((r, f));
            } else {
                groups.entry(r.binding.clone()).or_default().push(r);
            }
        }
        let sends = futures::future::join_all(groups.into_values().map(|g| self.send_in_order(g)));
        // The completion is queued for the writer before the claim.
        let writes = async {
            let settle = async {
                match &previous {
                    Some((done, accepted)) => {
                        self.settle(version, done, accepted, Vec::new(), &[]).await
                    }
                    None => Ok(()),
                }
            };
            let claim = async {
                if claim_next {
                    self.outbox
                        .claim(
                            &self.partition,
                            &self.owner,
                            version,
                            self.batch,
                            SystemTime::now(),
                        )
                        .await
                        .map(Some)
                } else {
                    Ok(None)
                }
            };
            tokio::join!(settle, claim)
        };
        let (turns, (previous_settled, next)) = tokio::join!(sends, writes);
        let attempted_at = SystemTime::now();
        let mut accepted = Vec::new();
        let mut failed: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        for (r, turn) in turns.into_iter().flatten() {
            match turn {
                Turn::Accepted => accepted.push(r),
                Turn::Untried => untried.push(r.seq),
                Turn::Failed(SendError::Permanent(error)) => {
                    let f = Failure {
                        reason: DlqReason::PermanentError,
                        error,
                        attempts: r.replay_count + 1,
                        first_attempt_at: Some(r.first_attempt_at.unwrap_or(attempted_at)),
                        last_attempt_at: Some(attempted_at),
                    };
                    dead.push((r, f));
                }
                Turn::Failed(error) => {
                    let first = r.first_attempt_at.unwrap_or(attempted_at);
                    if self.exhausted(r.replay_count + 1, Some(first), attempted_at) {
                        let f = Failure {
                            reason: DlqReason::ReplayExhausted,
                            error: error.to_string(),
                            attempts: r.replay_count + 1,
                            first_attempt_at: Some(first),
                            last_attempt_at: Some(attempted_at),
                        };
                        dead.push((r, f));
                    } else {
                        failed.entry(error.to_string()).or_default().push(r.seq);
                    }
                }
            }
        }
        let mut done: Vec<u64> = Vec::new();
        for (r, failure) in dead {
            let Some(binding) = self.bindings.get(&r.binding) else {
                untried.push(r.seq);
                continue;
            };
            let action = self.on_permanent_failure;
            match dispose(
                &self.identity,
                self.dlq.as_ref(),
                action,
                binding,
                r.id.clone(),
                &r.envelope,
                failure,
                r.created_at,
                false,
            )
            .await
            {
                Ok(_) => done.push(r.seq),
                Err(error) => {
                    tracing::warn!(partition = %self.partition, seq = r.seq, %error, "dlq write failed; the record is retried");
                    untried.push(r.seq);
                }
            }
        }
        let clean = failed.is_empty() && untried.is_empty();
        let failed: Vec<(String, Vec<u64>)> = failed.into_iter().collect();
        let outcome = match (previous_settled, next) {
            (Ok(()), Ok(Some(next))) if clean && !next.is_empty() => {
                return Ok(Some(Ahead {
                    records: next,
                    done,
                    accepted,
                }));
            }
            (Ok(()), Ok(next)) => {
                // Not clean (or nothing ahead): the batch ahead goes back.
                match next {
                    Some(next) => self.release_untried(version, &next).await,
                    None => Ok(()),
                }
            }
            (Ok(()), Err(error)) => Err(error),
            (Err(error), next) => {
                if let Ok(Some(next)) = next
                    && let Err(e) = self.release_untried(version, &next).await
                {
                    tracing::warn!(partition = %self.partition, error = %e, "releasing the batch claimed ahead failed; it is taken back when stale");
                }
                Err(error)
            }
        };
        let settled = self
            .settle(version, &done, &accepted, failed, &untried)
            .await;
        settled.and(outcome).map(|()| None)
    }

    /// Sends one binding's records in order, pipelined up to the window; a
    /// failure stops the records not yet started.
    async fn send_in_order(&self, records: Vec<OutboxRecord>) -> Vec<(OutboxRecord, Turn)> {
        let mut out = Vec::with_capacity(records.len());
        let mut queue = records.into_iter();
        let mut in_flight = FuturesOrdered::new();
        let mut stopped = false;
        loop {
            while !stopped && in_flight.len() < SEND_WINDOW {
                let Some(r) = queue.next() else { break };
                let sender = Arc::clone(&self.sender);
                // Futures are first polled in push order, so the publishes
                // are queued on the connection in record order.
                in_flight.push_back(async move {
                    let address = Address::new(r.address.clone());
                    let result = sender.send(&r.envelope, &address).await;
                    (r, result)
                });
            }
            let Some((r, result)) = in_flight.next().await else {
                break;
            };
            match result {
                Ok(()) => out.push((r, Turn::Accepted)),
                Err(error) => {
                    tracing::debug!(partition = %self.partition, seq = r.seq, binding = %r.binding, %error, "send failed");
                    stopped = true;
                    out.push((r, Turn::Failed(error)));
                }
            }
        }
        out.extend(queue.map(|r| (r, Turn::Untried)));
        out
    }

    fn exhausted(&self, replay_count: u32, first: Option<SystemTime>, now: SystemTime) -> bool {
        replay_count > self.max_replay_attempts
            && first.is_some_and(|t| now.duration_since(t).unwrap_or_default() > self.replay_budget)
    }

    /// Writes the cycle's outcome: one `complete` for everything terminal
    /// (accepted or disposed), one counted `release` per distinct error, one
    /// uncounted `release` for the rest. Counts what was sent.
    async fn settle(
        &self,
        version: u64,
        disposed: &[u64],
        accepted: &[OutboxRecord],
        failed: Vec<(String, Vec<u64>)>,
        untried: &[u64],
    ) -> StoreResult<()> {
        let mut complete: Vec<u64> = disposed.to_vec();
        complete.extend(accepted.iter().map(|r| r.seq));
        if !complete.is_empty() {
            let done = self
                .outbox
                .complete(&self.partition, version, &complete)
                .await?;
            let now = SystemTime::now();
            for r in accepted {
                if done.binary_search(&r.seq).is_ok()
                    && let Some(b) = self.bindings.get(&r.binding)
                {
                    b.metrics
                        .finished(Terminal::Sent, 1, now.duration_since(r.created_at).ok());
                }
            }
            self.depth.sub(done.len() as u64);
        }
        let attempted_at = SystemTime::now();
        for (error, seqs) in failed {
            self.outbox
                .release(
                    &self.partition,
                    version,
                    &seqs,
                    Release::Failed {
                        error,
                        attempted_at,
                    },
                )
                .await?;
        }
        if !untried.is_empty() {
            self.outbox
                .release(&self.partition, version, untried, Release::Untried)
                .await?;
        }
        Ok(())
    }

    async fn update_stats(&self) {
        match self.outbox.stats(&self.partition).await {
            Ok(stats) => {
                let now = SystemTime::now();
                self.depth.set(stats.total.depth);
                for (id, b) in &self.bindings {
                    let s = stats.bindings.get(id).cloned().unwrap_or_default();
                    b.metrics.set_outbox(s.depth, s.oldest_pending_age(now));
                }
            }
            Err(error) => {
                tracing::debug!(partition = %self.partition, %error, "outbox stats failed")
            }
        }
    }
}
