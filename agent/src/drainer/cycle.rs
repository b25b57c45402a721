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

/// How one record's turn ended.
enum Turn {
    Accepted,
    Failed(SendError),
    Untried,
}

impl Drainer {
    pub(super) async fn cycle(
        &self,
        version: u64,
        last_stats: &mut Option<Instant>,
    ) -> StoreResult<Report> {
        let now = SystemTime::now();
        let expired = self
            .outbox
            .expire(&self.partition, &self.owner, version, now, self.batch)
            .await?;
        if !expired.is_empty() {
            self.finish_expired(version, expired).await?;
        }
        let mut report = Report::default();
        if *self.connected.borrow() {
            let records = self
                .outbox
                .claim(&self.partition, &self.owner, version, self.batch, now)
                .await?;
            report.claimed = records.len();
            if !records.is_empty() {
                self.deliver(version, records).await?;
            }
        }
        if last_stats.is_none_or(|t| t.elapsed() >= STATS_EVERY) {
            *last_stats = Some(Instant::now());
            self.update_stats().await;
        }
        Ok(report)
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

    async fn deliver(&self, version: u64, records: Vec<OutboxRecord>) -> StoreResult<()> {
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
        let turns =
            futures::future::join_all(groups.into_values().map(|g| self.send_in_order(g))).await;
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
        let failed: Vec<(String, Vec<u64>)> = failed.into_iter().collect();
        self.settle(version, &done, &accepted, failed, &untried)
            .await
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
