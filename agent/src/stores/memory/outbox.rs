//! The memory outbox: a `BTreeMap` of records per partition; the records of
//! one message hold one `Arc` of its envelope.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use super::lock;
use crate::stores::outbox::{claim_is_stale, stale, validate_append};
use crate::stores::{
    BoxFuture, Claim, NewMessage, OutboxRecord, OutboxStats, OutboxStore, Release, StoreResult,
};

/// An outbox kept in process memory.
#[derive(Debug)]
pub struct MemoryOutboxStore {
    stale_claim_duration: Duration,
    partitions: Mutex<HashMap<String, Partition>>,
}

#[derive(Debug, Default)]
struct Partition {
    hwm: u64,
    /// The last seq assigned; seqs are never reused.
    last_seq: u64,
    records: BTreeMap<u64, OutboxRecord>,
}

impl Partition {
    /// Fails when `version` is below the high-water mark.
    fn fence(&self, partition: &str, version: u64) -> StoreResult<()> {
        if version < self.hwm {
            return Err(stale(partition, version, self.hwm));
        }
        Ok(())
    }

    /// `Stale` below the mark; above it the mark rises and every older
    /// claim is pending again.
    fn advance_fence(&mut self, partition: &str, version: u64) -> StoreResult<()> {
        self.fence(partition, version)?;
        if version > self.hwm {
            self.hwm = version;
            for r in self.records.values_mut() {
                if r.claim.as_ref().is_some_and(|c| c.version < version) {
                    r.claim = None;
                }
            }
        }
        Ok(())
    }

    /// The records among `seqs` claimed with `version`, ascending.
    fn claimed_with(&self, version: u64, seqs: &[u64]) -> Vec<u64> {
        let mut out: Vec<u64> = seqs
            .iter()
            .copied()
            .filter(|s| {
                self.records
                    .get(s)
                    .and_then(|r| r.claim.as_ref())
                    .is_some_and(|c| c.version == version)
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }
}

impl MemoryOutboxStore {
    /// An empty outbox; an owner's claims older than `stale_claim_duration`
    /// are returned to it again by `claim`.
    pub fn new(stale_claim_duration: Duration) -> Self {
        MemoryOutboxStore {
            stale_claim_duration,
            partitions: Mutex::default(),
        }
    }

    #[cfg(test)]
    pub(crate) fn dump(&self, partition: &str) -> StoreResult<Vec<OutboxRecord>> {
        Ok(lock(&self.partitions)?
            .get(partition)
            .map(|p| p.records.values().cloned().collect())
            .unwrap_or_default())
    }

    fn append_now(&self, partition: &str, message: NewMessage) -> StoreResult<Vec<u64>> {
        validate_append(partition, &message)?;
        let mut parts = lock(&self.partitions)?;
        let p = parts.entry(partition.to_owned()).or_default();
        let envelope = Arc::new(message.envelope);
        let shared_partition: Arc<str> = Arc::from(partition);
        let mut seqs = Vec::with_capacity(message.records.len());
        for r in message.records {
            p.last_seq += 1;
            let seq = p.last_seq;
            seqs.push(seq);
            p.records.insert(
                seq,
                OutboxRecord {
                    partition: Arc::clone(&shared_partition),
                    seq,
                    id: r.id,
                    binding: r.binding,
                    address: r.address,
                    envelope: Arc::clone(&envelope),
                    created_at: message.created_at,
                    expires_at: message.expires_at,
                    claim: None,
                    replay_count: 0,
                    first_attempt_at: None,
                    last_error: None,
                },
            );
        }
        Ok(seqs)
    }

    fn claim_now(
        &self,
        partition: &str,
        owner: &str,
        version: u64,
        limit: usize,
        now: SystemTime,
    ) -> StoreResult<Vec<OutboxRecord>> {
        let mut parts = lock(&self.partitions)?;
        let p = parts.entry(partition.to_owned()).or_default();
        p.advance_fence(partition, version)?;
        let stale_after = self.stale_claim_duration;
        let mut out = Vec::new();
        for r in p.records.values_mut() {
            if out.len() >= limit {
                break;
            }
            let eligible = match &r.claim {
                None => true,
                Some(c) => c.owner == owner && claim_is_stale(c.claimed_at, now, stale_after),
            };
            if eligible {
                r.claim = Some(Claim {
                    version,
                    owner: owner.to_owned(),
                    claimed_at: now,
                });
                out.push(r.clone());
            }
        }
        Ok(out)
    }

    fn complete_now(&self, partition: &str, version: u64, seqs: &[u64]) -> StoreResult<Vec<u64>> {
        let mut parts = lock(&self.partitions)?;
        let Some(p) = parts.get_mut(partition) else {
            return Ok(Vec::new());
        };
        p.fence(partition, version)?;
        let done = p.claimed_with(version, seqs);
        for s in &done {
            p.records.remove(s);
        }
        Ok(done)
    }

    fn release_now(
        &self,
        partition: &str,
        version: u64,
        seqs: &[u64],
        release: Release,
    ) -> StoreResult<Vec<u64>> {
        let mut parts = lock(&self.partitions)?;
        let Some(p) = parts.get_mut(partition) else {
            return Ok(Vec::new());
        };
        p.fence(partition, version)?;
        let released = p.claimed_with(version, seqs);
        for s in &released {
            if let Some(r) = p.records.get_mut(s) {
                r.claim = None;
                if let Release::Failed {
                    error,
                    attempted_at,
                } = &release
                {
                    r.replay_count = r.replay_count.saturating_add(1);
                    r.first_attempt_at.get_or_insert(*attempted_at);
                    r.last_error = Some(error.clone());
                }
            }
        }
        Ok(released)
    }

    fn expire_now(
        &self,
        partition: &str,
        owner: &str,
        version: u64,
        now: SystemTime,
        limit: usize,
    ) -> StoreResult<Vec<OutboxRecord>> {
        let mut parts = lock(&self.partitions)?;
        let p = parts.entry(partition.to_owned()).or_default();
        p.advance_fence(partition, version)?;
        let mut out = Vec::new();
        for r in p.records.values_mut() {
            if out.len() >= limit {
                break;
            }
            if r.claim.is_none() && r.expires_at.is_some_and(|t| t <= now) {
                r.claim = Some(Claim {
                    version,
                    owner: owner.to_owned(),
                    claimed_at: now,
                });
                out.push(r.clone());
            }
        }
        Ok(out)
    }

    fn stats_now(&self, partition: &str) -> StoreResult<OutboxStats> {
        let parts = lock(&self.partitions)?;
        let mut stats = OutboxStats::default();
        if let Some(p) = parts.get(partition) {
            stats.high_water_mark = p.hwm;
            for r in p.records.values() {
                let claimed = r.claim.is_some();
                stats.total.add(claimed, r.created_at);
                stats
                    .bindings
                    .entry(r.binding.to_string())
                    .or_default()
                    .add(claimed, r.created_at);
            }
        }
        Ok(stats)
    }
}

impl OutboxStore for MemoryOutboxStore {
    fn append<'a>(
        &'a self,
        partition: &'a str,
        message: NewMessage,
    ) -> BoxFuture<'a, StoreResult<Vec<u64>>> {
        Box::pin(async move { self.append_now(partition, message) })
    }

    fn claim<'a>(
        &'a self,
        partition: &'a str,
        owner: &'a str,
        version: u64,
        limit: usize,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Vec<OutboxRecord>>> {
        Box::pin(async move { self.claim_now(partition, owner, version, limit, now) })
    }

    fn complete<'a>(
        &'a self,
        partition: &'a str,
        version: u64,
        seqs: &'a [u64],
    ) -> BoxFuture<'a, StoreResult<Vec<u64>>> {
        Box::pin(async move { self.complete_now(partition, version, seqs) })
    }

    fn release<'a>(
        &'a self,
        partition: &'a str,
        version: u64,
        seqs: &'a [u64],
        release: Release,
    ) -> BoxFuture<'a, StoreResult<Vec<u64>>> {
        Box::pin(async move { self.release_now(partition, version, seqs, release) })
    }

    fn expire<'a>(
        &'a self,
        partition: &'a str,
        owner: &'a str,
        version: u64,
        now: SystemTime,
        limit: usize,
    ) -> BoxFuture<'a, StoreResult<Vec<OutboxRecord>>> {
        Box::pin(async move { self.expire_now(partition, owner, version, now, limit) })
    }

    fn stats<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, StoreResult<OutboxStats>> {
        Box::pin(async move { self.stats_now(partition) })
    }
}
