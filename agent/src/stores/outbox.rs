//! Outbox record types, shared by every backend.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use ferry_shared::envelope::Envelope;

use super::{StoreError, StoreResult, from_unix_nanos};

/// A message to append: one envelope for one or more bindings. The outbox
/// stores the envelope once and a record per binding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewMessage {
    /// The message.
    pub envelope: Envelope,
    /// When the message was written.
    pub created_at: SystemTime,
    /// When its records stop being worth delivering.
    pub expires_at: Option<SystemTime>,
    /// One record per binding, in the order their seqs are assigned.
    pub records: Vec<NewRecord>,
}

impl NewMessage {
    /// A message for `records`, expiring when the envelope does.
    pub fn new(envelope: Envelope, created_at: SystemTime, records: Vec<NewRecord>) -> Self {
        NewMessage {
            expires_at: envelope.expires_at,
            envelope,
            created_at,
            records,
        }
    }
}

/// One binding's record of a [`NewMessage`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewRecord {
    /// Unique record id (a UUIDv7 from [`NewRecord::new`]); the id of the DLQ
    /// entry the record may become, so it must never repeat.
    pub id: String,
    /// The binding (destination) the record is for. Shared: a route makes
    /// one record per binding of every message, and a copy of the name for
    /// each cost an allocation.
    pub binding: Arc<str>,
    /// The address the binding sends to (shared, as `binding`).
    pub address: Arc<str>,
}

impl NewRecord {
    /// A record with a fresh UUIDv7 id.
    pub fn new(binding: impl Into<Arc<str>>, address: impl Into<Arc<str>>) -> Self {
        NewRecord {
            id: crate::ids::new_id(),
            binding: binding.into(),
            address: address.into(),
        }
    }
}

/// A stored record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxRecord {
    /// The partition (`{bridge}/{route}`), shared by the records one call
    /// returns.
    pub partition: Arc<str>,
    /// Position in the partition, strictly increasing, never reused.
    pub seq: u64,
    /// Unique record id.
    pub id: String,
    /// The binding the record is for (shared, see [`Names`]).
    pub binding: Arc<str>,
    /// The address the binding sends to (shared, see [`Names`]).
    pub address: Arc<str>,
    /// The message, shared by the records of one message that one call
    /// returns.
    pub envelope: Arc<Envelope>,
    /// When the record was appended.
    pub created_at: SystemTime,
    /// When it stops being worth delivering.
    pub expires_at: Option<SystemTime>,
    /// The current claim; `None` while pending.
    pub claim: Option<Claim>,
    /// How many failed sends released it.
    pub replay_count: u32,
    /// When the first failed send was released.
    pub first_attempt_at: Option<SystemTime>,
    /// The error of the last failed send.
    pub last_error: Option<String>,
}

/// Who claimed a record, under which fencing version and when.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    /// The lease version of the claim.
    pub version: u64,
    /// The claiming drainer.
    pub owner: String,
    /// When it was claimed.
    pub claimed_at: SystemTime,
}

/// How a claimed record goes back to pending.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Release {
    /// A send was tried and failed: `replay_count + 1`, `first_attempt_at`
    /// set if unset, `last_error` set.
    Failed {
        /// The send error.
        error: String,
        /// When the attempt was made.
        attempted_at: SystemTime,
    },
    /// Never tried (an earlier record of its binding failed, shutdown, lost
    /// lease): nothing is counted.
    Untried,
}

/// Counts for a partition or one of its bindings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BindingStats {
    /// Records stored (pending + claimed).
    pub depth: u64,
    /// Records claimed.
    pub claimed: u64,
    /// Creation time of the oldest pending record.
    pub oldest_pending_created_at: Option<SystemTime>,
}

impl BindingStats {
    /// Records waiting to be claimed.
    pub fn pending(&self) -> u64 {
        self.depth - self.claimed
    }

    /// Age of the oldest pending record at `now` (zero if in the future).
    pub fn oldest_pending_age(&self, now: SystemTime) -> Option<Duration> {
        self.oldest_pending_created_at
            .map(|t| now.duration_since(t).unwrap_or_default())
    }

    pub(crate) fn add(&mut self, claimed: bool, created_at: SystemTime) {
        self.add_group(claimed, 1, created_at);
    }

    /// Counts `count` records in one state, the oldest created at `oldest`.
    pub(crate) fn add_group(&mut self, claimed: bool, count: u64, oldest: SystemTime) {
        self.depth += count;
        if claimed {
            self.claimed += count;
        } else {
            self.oldest_pending_created_at = Some(
                self.oldest_pending_created_at
                    .map_or(oldest, |t| t.min(oldest)),
            );
        }
    }
}

/// Statistics of one partition.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OutboxStats {
    /// The fencing high-water mark (0 before any claim).
    pub high_water_mark: u64,
    /// Every binding together.
    pub total: BindingStats,
    /// Per binding with at least one record.
    pub bindings: BTreeMap<String, BindingStats>,
}

/// Checks what `append` refuses, before anything is written.
pub(crate) fn validate_append(partition: &str, message: &NewMessage) -> StoreResult<()> {
    if partition.is_empty() {
        return Err(StoreError::Invalid("empty partition".into()));
    }
    for (i, r) in message.records.iter().enumerate() {
        if r.id.is_empty() {
            return Err(StoreError::Invalid(format!("records[{i}]: empty id")));
        }
        if r.binding.is_empty() {
            return Err(StoreError::Invalid(format!("records[{i}]: empty binding")));
        }
    }
    Ok(())
}

/// The error for an operation under a version below the high-water mark.
pub(crate) fn stale(partition: &str, version: u64, hwm: u64) -> StoreError {
    StoreError::Stale(format!(
        "partition {partition}: version {version} is below the high-water mark {hwm}"
    ))
}

/// True when a claim made at `claimed_at` is old enough at `now` to be
/// reclaimed by its owner.
pub(crate) fn claim_is_stale(claimed_at: SystemTime, now: SystemTime, after: Duration) -> bool {
    now.duration_since(claimed_at).is_ok_and(|age| age >= after)
}

/// The claim time (Unix nanoseconds) before which a claim is stale at `now`
/// (a backend that compares stored times in its query).
pub(crate) fn stale_before(now: SystemTime, after: Duration) -> StoreResult<i64> {
    let after = i64::try_from(after.as_nanos()).unwrap_or(i64::MAX);
    Ok(super::unix_nanos(now)?.saturating_sub(after))
}

/// The names (bindings, addresses) of the records one call reads, each
/// shared by every record that carries it instead of copied for each: a
/// claim returns a record per binding of every message, and copying the two
/// names out of the row for each cost two allocations. Keeps the last
/// [`Names::KEEP`] names seen, as a route has a few bindings; an address
/// made per message from a template is copied as before.
#[derive(Default)]
pub(crate) struct Names(Vec<Arc<str>>);

impl Names {
    const KEEP: usize = 8;

    /// `name`, shared with the records read before it that carry it.
    pub(crate) fn get(&mut self, name: &str) -> Arc<str> {
        if let Some(known) = self.0.iter().find(|known| ***known == *name) {
            return Arc::clone(known);
        }
        let new: Arc<str> = Arc::from(name);
        if self.0.len() == Self::KEEP {
            self.0.remove(0);
        }
        self.0.push(Arc::clone(&new));
        new
    }
}

/// A record row as a backend stores it (times in Unix nanoseconds, integers
/// as `i64`), before its times are decoded and its envelope attached.
pub(crate) struct RawRecord {
    pub(crate) seq: i64,
    pub(crate) msg: i64,
    pub(crate) id: String,
    pub(crate) binding: Arc<str>,
    pub(crate) address: Arc<str>,
    pub(crate) created_at: i64,
    pub(crate) expires_at: Option<i64>,
    pub(crate) claim_version: Option<i64>,
    pub(crate) claim_owner: Option<String>,
    pub(crate) claimed_at: Option<i64>,
    pub(crate) replay_count: i64,
    pub(crate) first_attempt_at: Option<i64>,
    pub(crate) last_error: Option<String>,
}

impl RawRecord {
    /// The row as a claim by `owner` under `version` at `now` leaves it.
    pub(crate) fn state_claimed(&mut self, version: i64, owner: &str, now: i64) {
        self.claim_version = Some(version);
        self.claim_owner = Some(owner.to_owned());
        self.claimed_at = Some(now);
    }

    pub(crate) fn into_record(
        self,
        partition: &Arc<str>,
        envelope: Arc<Envelope>,
    ) -> StoreResult<OutboxRecord> {
        let claim = match (self.claim_version, self.claim_owner, self.claimed_at) {
            (Some(version), Some(owner), Some(at)) => Some(Claim {
                version: stored_u64(version)?,
                owner,
                claimed_at: from_unix_nanos(at)?,
            }),
            _ => None,
        };
        Ok(OutboxRecord {
            partition: Arc::clone(partition),
            seq: stored_u64(self.seq)?,
            id: self.id,
            binding: self.binding,
            address: self.address,
            envelope,
            created_at: from_unix_nanos(self.created_at)?,
            expires_at: self.expires_at.map(from_unix_nanos).transpose()?,
            claim,
            replay_count: u32::try_from(self.replay_count)
                .map_err(|_| StoreError::Corrupt(format!("replay count {}", self.replay_count)))?,
            first_attempt_at: self.first_attempt_at.map(from_unix_nanos).transpose()?,
            last_error: self.last_error,
        })
    }
}

/// Turns rows into records in seq order, each message's envelope fetched
/// (`envelope(msg)`: its encoded bytes, `None` when missing) and decoded
/// once, and shared by its records: the stores' invariant 8.
pub(crate) fn into_records(
    partition: &str,
    mut rows: Vec<RawRecord>,
    mut envelope: impl FnMut(i64) -> StoreResult<Option<Vec<u8>>>,
) -> StoreResult<Vec<OutboxRecord>> {
    rows.sort_unstable_by_key(|r| r.seq);
    // A message's records have consecutive seqs, so in seq order they come
    // one after another: the last message decoded is the only one to keep.
    let mut decoded: Option<(i64, Arc<Envelope>)> = None;
    let mut out = Vec::with_capacity(rows.len());
    let shared_partition: Arc<str> = Arc::from(partition);
    for row in rows {
        let shared = match &decoded {
            Some((msg, e)) if *msg == row.msg => Arc::clone(e),
            _ => {
                let bytes = envelope(row.msg)?.ok_or_else(|| {
                    StoreError::Corrupt(format!(
                        "outbox record {partition}/{}: message {} is missing",
                        row.seq, row.msg
                    ))
                })?;
                let e = Envelope::decode(&bytes).map_err(|e| {
                    StoreError::Corrupt(format!("outbox message {partition}/{}: {e}", row.msg))
                })?;
                let e = Arc::new(e);
                decoded = Some((row.msg, Arc::clone(&e)));
                e
            }
        };
        out.push(row.into_record(&shared_partition, shared)?);
    }
    Ok(out)
}

/// A stored integer that must not be negative.
fn stored_u64(n: i64) -> StoreResult<u64> {
    u64::try_from(n).map_err(|_| StoreError::Corrupt(format!("negative value {n}")))
}
