//! The agent's stores: the outbox, the lease store and the dead-letter queue.
//!
//! Each is a trait with interchangeable backends (`memory` for development,
//! `sqlite` for a single durable node, `postgres` and `dynamodb` for stores
//! several agents share, `control_plane` for leases and dead letters kept by
//! the control plane). The
//! traits are dyn-compatible (`Arc<dyn OutboxStore>`), their futures are
//! `Send`, and every backend passes the same conformance suite
//! (`conformance`; the lease and DLQ suites are exported with the
//! `conformance` feature for backends tested from another crate).
//!
//! # Outbox invariants
//!
//! A *partition* (`{bridge}/{route}`) is an ordered set of *records*, one per
//! message and binding: `append` takes one message (an envelope) and the
//! bindings it goes to, and every record of it carries that one envelope
//! (stored once where the backend can: ADR 0007). The outbox keeps, per
//! partition, a fencing *high-water mark* (`hwm`): the highest lease version
//! any claim has shown.
//!
//! 1. `seq` is assigned by `append`, strictly increasing per partition and
//!    never reused, also after records are deleted or the store reopened.
//! 2. `append` is all or nothing (every record of the message or none) and
//!    durable when it returns `Ok`; a record is never visible to `claim`
//!    before its `append` returned. The other writes
//!    are atomic too, but a durable backend may let a power loss take back
//!    the latest of them (never an append acknowledged before them): that
//!    only makes records pending again, to be sent once more.
//! 3. A record is either *pending* or *claimed* under a version. Every claimed
//!    record's version equals the partition's `hwm`: a claim with a higher
//!    version raises `hwm` and makes every older claim pending again, in the
//!    same transaction.
//! 4. An operation carrying a version below `hwm` fails with
//!    [`StoreError::Stale`] and changes nothing. `complete` and `release` act
//!    only on records claimed with exactly their version and ignore the rest
//!    (they return the seqs they affected).
//! 5. `claim` returns, oldest first (`seq` order, hence record order within
//!    each binding), pending records and the caller's own claims older than
//!    `stale_claim_duration` (a drainer that lost track of a batch gets it back
//!    without a version bump). A `claim` whose outcome is not known may have
//!    claimed records it did not return; a backend whose claim is not one
//!    transaction (DynamoDB) knows which it chose and returns them with the
//!    owner's next `claim` under the same version, the others after
//!    `stale_claim_duration`.
//! 6. A counted release (a failed send) adds one to `replay_count` and sets
//!    `first_attempt_at` if unset; an uncounted one (never tried) changes
//!    neither. Both make the record pending.
//! 7. `expire` claims (fenced like `claim`) only pending records whose
//!    `expires_at` has passed, so that the caller can write their DLQ entries
//!    before it `complete`s them; `complete` is the only deletion, so the
//!    store does not grow beyond what is not yet delivered: a message's
//!    envelope is deleted with the last of its records.
//! 8. Records returned by one call share one `Arc` of their message's
//!    envelope: a fan-out is decoded and held once, not once per binding.
//!
//! # Leases
//!
//! The rules are [`ferry_shared::lease`]'s, the same for every backend of
//! both halves: a lease key has at most one unexpired holder; every acquire
//! that is granted carries `last version + 1` (also the holder's own, so a
//! restart under the same id fences out the previous run); only renew
//! extends a live grant; release is repeatable. Versions are durable in durable backends; the `memory` backend restarts
//! from zero, which is why a memory lease must never fence a durable outbox.
//!
//! # Errors say what is known
//!
//! [`StoreError::outcome_known`] is false only for `Unavailable` and `Timeout`:
//! the write may or may not have happened and the caller must reconcile (an
//! append is retried by leaving the source unacknowledged; a DLQ put is
//! idempotent by id).
//!
//! Time is always passed in (`now`), never read by a store, so tests control
//! it and backends agree on it.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime};

pub mod control_plane;
mod dlq;
pub mod dynamodb;
mod lease;
pub mod memory;
pub mod observed;
mod outbox;
pub mod postgres;
pub mod sqlite;

#[cfg(any(test, feature = "conformance"))]
pub mod conformance;

pub use dlq::{DlqEntry, DlqFilter, DlqPage, DlqReason, DlqStat, DlqStats, PageRequest};
pub use lease::{Acquired, Grant, Lease, LeaseState};
pub use outbox::{BindingStats, Claim, NewMessage, NewRecord, OutboxRecord, OutboxStats, Release};

/// A boxed `Send` future: what the store traits return so that they can be
/// used as trait objects.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The result of a store operation.
pub type StoreResult<T> = Result<T, StoreError>;

/// What went wrong in a store, and whether the operation may have happened.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// Fenced out: the caller's version is below what the store has seen, or
    /// the lease is no longer held by the caller. Certainly not applied.
    #[error("stale: {0}")]
    Stale(String),
    /// The operation contradicts the current state. Not applied.
    #[error("conflict: {0}")]
    Conflict(String),
    /// No such entry or lease. Not applied.
    #[error("not found: {0}")]
    NotFound(String),
    /// The arguments are invalid. Not applied.
    #[error("invalid: {0}")]
    Invalid(String),
    /// A stored row cannot be decoded. The operation was not applied.
    #[error("corrupt: {0}")]
    Corrupt(String),
    /// The store has no room left (disk full, `max_size_bytes` reached).
    /// Not applied: the transaction was rolled back.
    #[error("full: {0}")]
    Full(String),
    /// The store could not be reached or failed while writing; the
    /// operation may or may not have been applied.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The store did not answer in time; the operation may or may not have
    /// been applied.
    #[error("timeout: {0}")]
    Timeout(String),
}

impl StoreError {
    /// True when the operation certainly did not take effect; false when it
    /// may have (`Unavailable`, `Timeout`) and the caller must reconcile.
    pub fn outcome_known(&self) -> bool {
        !matches!(self, StoreError::Unavailable(_) | StoreError::Timeout(_))
    }

    /// The variant's name in snake case, for metric labels and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Stale(_) => "stale",
            StoreError::Conflict(_) => "conflict",
            StoreError::NotFound(_) => "not_found",
            StoreError::Invalid(_) => "invalid",
            StoreError::Corrupt(_) => "corrupt",
            StoreError::Full(_) => "full",
            StoreError::Unavailable(_) => "unavailable",
            StoreError::Timeout(_) => "timeout",
        }
    }

    /// True when the store itself failed (`Full`, `Unavailable`, `Timeout`,
    /// `Corrupt`): what makes a store unhealthy. `Stale`, `Conflict`,
    /// `NotFound` and `Invalid` are answers about the caller's request.
    pub fn is_store_failure(&self) -> bool {
        matches!(
            self,
            StoreError::Full(_)
                | StoreError::Unavailable(_)
                | StoreError::Timeout(_)
                | StoreError::Corrupt(_)
        )
    }

    /// True when the store could not be reached or did not answer in time
    /// (`Unavailable`, `Timeout`): a failure of the path to the store, not of
    /// the operation, which any later answer from the store ends.
    pub fn is_unreachable(&self) -> bool {
        matches!(self, StoreError::Unavailable(_) | StoreError::Timeout(_))
    }
}

/// The outbox: per-partition, fenced, ordered records (see the module
/// invariants).
pub trait OutboxStore: Send + Sync + 'static {
    /// Appends `message` to `partition` in one transaction, a record per
    /// entry of `message.records`, and returns the seqs assigned in that
    /// order. Durable when it returns `Ok`.
    fn append<'a>(
        &'a self,
        partition: &'a str,
        message: NewMessage,
    ) -> BoxFuture<'a, StoreResult<Vec<u64>>>;

    /// Claims up to `limit` records for `owner` under lease `version`:
    /// pending records and `owner`'s own claims older than the store's
    /// `stale_claim_duration`, oldest first. `version < hwm` is `Stale`;
    /// `version > hwm` raises `hwm` and takes back every older claim first.
    fn claim<'a>(
        &'a self,
        partition: &'a str,
        owner: &'a str,
        version: u64,
        limit: usize,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Vec<OutboxRecord>>>;

    /// Deletes the records among `seqs` claimed with `version`; returns the
    /// seqs deleted, ascending. `version < hwm` is `Stale`.
    fn complete<'a>(
        &'a self,
        partition: &'a str,
        version: u64,
        seqs: &'a [u64],
    ) -> BoxFuture<'a, StoreResult<Vec<u64>>>;

    /// Makes the records among `seqs` claimed with `version` pending again;
    /// returns the seqs released, ascending. `version < hwm` is `Stale`.
    fn release<'a>(
        &'a self,
        partition: &'a str,
        version: u64,
        seqs: &'a [u64],
        release: Release,
    ) -> BoxFuture<'a, StoreResult<Vec<u64>>>;

    /// Claims for `owner` under `version` and returns, oldest first, up to
    /// `limit` pending records whose `expires_at` is at or before `now`. The
    /// fence applies as in `claim`. The caller dead-letters (or drops) them
    /// and then `complete`s them, so a crash in between loses no DLQ entry:
    /// the records come back pending under the next version.
    fn expire<'a>(
        &'a self,
        partition: &'a str,
        owner: &'a str,
        version: u64,
        now: SystemTime,
        limit: usize,
    ) -> BoxFuture<'a, StoreResult<Vec<OutboxRecord>>>;

    /// Depth, claimed count and oldest pending record, in total and per
    /// binding, and the partition's high-water mark.
    fn stats<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, StoreResult<OutboxStats>>;
}

/// Leases with fencing versions (see the module invariants).
pub trait LeaseStore: Send + Sync + 'static {
    /// Takes `key` for `holder` for `ttl` when it is free, expired, or
    /// already held by `holder`, always at a new version.
    fn acquire<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        ttl: Duration,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Acquired>>;

    /// Extends the lease `holder` holds at `version` to `now + ttl`. `Stale`
    /// when it expired, was released, is held by someone else or unknown.
    fn renew<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
        ttl: Duration,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Lease>>;

    /// Gives the lease up so another holder can take it at once; `Ok` again
    /// when `holder` already released it at `version`. `Stale` when `holder`
    /// does not hold it at `version` (unknown key, another holder).
    fn release<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
    ) -> BoxFuture<'a, StoreResult<()>>;

    /// Every key ever granted, ordered by key, with its last version.
    fn list(&self) -> BoxFuture<'_, StoreResult<Vec<LeaseState>>>;
}

/// The dead-letter queue.
pub trait DlqStore: Send + Sync + 'static {
    /// Stores `entry`, durable when it returns. Idempotent by id: returns
    /// `false` (and changes nothing) when the id is already stored.
    fn put(&self, entry: DlqEntry) -> BoxFuture<'_, StoreResult<bool>>;

    /// Entries matching `filter`, oldest first (`dead_lettered_at`, then id).
    fn list<'a>(
        &'a self,
        filter: &'a DlqFilter,
        page: PageRequest,
    ) -> BoxFuture<'a, StoreResult<DlqPage>>;

    /// One entry; `NotFound` when absent.
    fn get<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<DlqEntry>>;

    /// Deletes one entry; `NotFound` when absent.
    fn delete<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<()>>;

    /// Deletes every entry matching `filter`; returns how many.
    fn purge<'a>(&'a self, filter: &'a DlqFilter) -> BoxFuture<'a, StoreResult<u64>>;

    /// Counts per bridge, route, binding and reason of entries matching
    /// `filter`.
    fn stats<'a>(&'a self, filter: &'a DlqFilter) -> BoxFuture<'a, StoreResult<DlqStats>>;
}

/// Nanoseconds since the Unix epoch: how stores keep and order times (exact,
/// so every backend returns the times it was given).
pub(crate) fn unix_nanos(t: SystemTime) -> StoreResult<i64> {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .ok()
        .and_then(|d| i64::try_from(d.as_nanos()).ok())
        .ok_or_else(|| StoreError::Invalid(format!("time {t:?} is outside 1970..2262")))
}

/// The inverse of [`unix_nanos`]; stored values are never negative, a
/// negative one is a corrupt row.
pub(crate) fn from_unix_nanos(n: i64) -> StoreResult<SystemTime> {
    u64::try_from(n)
        .map(|n| SystemTime::UNIX_EPOCH + Duration::from_nanos(n))
        .map_err(|_| StoreError::Corrupt(format!("negative time {n}")))
}
