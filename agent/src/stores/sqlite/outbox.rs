//! The SQLite outbox: the envelope stored once per message, a narrow row per
//! binding (`docs/adr/0007-outbox-layout.md`), keyed by one integer.
//!
//! # Layout
//!
//! - `outbox_partitions`: a row per partition with its fencing `hwm`, the
//!   `last_seq` assigned, and `pid`, the integer the other tables key on
//!   instead of the name.
//! - `outbox_messages`: a row per appended message: the encoded envelope and
//!   the seqs `first_seq..=last_seq` its records were given.
//! - `outbox_records`: a row per (message, binding), keyed by `key = pid <<
//!   40 | seq` (the table's rowid, see [`Keys`]): the record's own fields
//!   and the state that claims, completions and releases change, but not the
//!   envelope.
//! - `outbox_claims` (layout 5): a row per run of fresh records one claim
//!   took: its first and last key, version, owner and time (invariant 7).
//!
//! # Invariants
//!
//! 1. An append writes its message row and every record of it in one job.
//!    Its records get consecutive seqs, the message row's
//!    `first_seq..=last_seq`: the ranges of two messages of one partition
//!    never overlap, and a record's `msg` is the message whose range holds
//!    its seq.
//! 2. The job that deletes the last record of a message's range deletes the
//!    message row (`complete` is the only deletion): no envelope outlives its
//!    records, and none is deleted before them.
//! 3. Claims, completions, releases and expiries write `outbox_records`,
//!    its indexes and `outbox_claims` only, never a page of an envelope; a
//!    completion also deletes the message rows it emptied.
//! 4. A call that returns records decodes each message's envelope once and
//!    gives its records one `Arc` of it.
//! 5. A record's `key` is `pid << 40 | seq`: a partition's records are the
//!    key range of its `pid`, in seq order, and a seq never reaches 2^40.
//! 6. A record's `state` is 0 pending, 1 claimed by `claim`, 2 claimed by
//!    `expire`, 3 fresh (invariant 7). Pending records are in the index
//!    `outbox_records_pending` and records in state 2 in
//!    `outbox_records_expiring`; records in states 1 and 3 are in no state
//!    index, and records in state 1 have keys at most their partition's
//!    `claimed_to`, the highest key a claim took since the partition's
//!    fence last rose (a rise voids every claim and sets it back to 0). A
//!    claim removes a
//!    record's index entry instead of moving it, a completion touches none,
//!    and the search for stale claims reads the keys up to `claimed_to` —
//!    the oldest records, as claims take the oldest pending ones — and the
//!    few records in state 2 (an expiry may claim records far ahead).
//! 7. An append writes its records in state 3, *fresh*: in no index, and
//!    claimed by position. A fresh record above its partition's
//!    `claimed_to` is pending; one at or below it is claimed by the
//!    `outbox_claims` row whose run `first_key..=last_key` holds it, and
//!    every fresh record at or below `claimed_to` lies in exactly one run.
//!    A claim takes fresh records as a prefix of those above `claimed_to`
//!    (the oldest pending records are taken first, invariant 6) and writes
//!    one run row for them, not a row per record — the per-record write
//!    that cost a fan-out's claim most. Runs never overlap. Whatever acts
//!    on one record of a run otherwise (a release, a claim taking back a
//!    stale run) first gives it its own claim in state 1 (*materialize*);
//!    a completion deletes fresh records by their run's version. A run row
//!    goes with the last fresh record in it; a newer lease version deletes
//!    every run of the partition and sets `claimed_to` back to 0, so every
//!    fresh record is pending again.
//!
//! Every operation but `stats` is one job of the writer (atomic and, when
//! answered, committed); `stats` reads on the read connection. Appends made
//! while the writer is busy share one job ([`append_all`], a writer
//! [`Batch`]): it reads each partition's row once and writes its `last_seq`
//! once, where each append did both before. Only `append`
//! waits for an fsync: a claim, completion, release or expiry lost to a power
//! cut makes a record pending again, so it is sent once more — at-least-once
//! holds — while an acknowledged append lost would be a message lost.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rusqlite::{CachedStatement, Connection, OptionalExtension, Row, params};

use super::{Batch, Db, SqliteOptions, schema, sql_error, to_i64, to_u64};
use crate::stores::outbox::{Names, RawRecord, into_records, stale, validate_append};
use crate::stores::{
    BoxFuture, NewMessage, OutboxRecord, OutboxStats, OutboxStore, Release, StoreError,
    StoreResult, from_unix_nanos, unix_nanos,
};

/// The columns of a record row, in [`raw_record`]'s order.
const COLUMNS: &str = "key, msg, id, binding, address, created_at_ns, expires_at_ns, \
    claim_version, claim_owner, claimed_at_ns, replay_count, first_attempt_at_ns, last_error";

/// The pending records by key (invariant 6). Queries name their index:
/// without statistics SQLite may prefer the rowid.
const PENDING: &str = "outbox_records INDEXED BY outbox_records_pending";
/// The records claimed by `expire` by key (invariant 6).
const EXPIRING: &str = "outbox_records INDEXED BY outbox_records_expiring";
/// The states of invariants 6 and 7.
const CLAIMED_BY_CLAIM: i64 = 1;
const CLAIMED_BY_EXPIRE: i64 = 2;
const FRESH: i64 = 3;

/// The bits of a record's key that hold its seq; its partition's `pid` is
/// the bits above (invariant 5). One integer key makes `outbox_records` a
/// rowid table: SQLite finds, inserts and deletes a record by comparing one
/// integer, where the composite key `(pid, seq)` of layout 2 cost a record
/// comparison per step of every search (`docs/adr/0007-outbox-layout.md`).
const SEQ_BITS: u32 = 40;
/// The last seq a partition can assign: at 100 000 records a second, more
/// than 300 years of them.
pub(super) const MAX_SEQ: u64 = (1 << SEQ_BITS) - 1;
/// The highest `pid` a key can hold (keys are positive `i64`s).
pub(super) const MAX_PID: i64 = (1 << (63 - SEQ_BITS)) - 1;

/// The keys of one partition's records.
#[derive(Clone, Copy)]
struct Keys {
    base: i64,
}

impl Keys {
    fn of(pid: i64) -> StoreResult<Keys> {
        if !(0..=MAX_PID).contains(&pid) {
            return Err(StoreError::Corrupt(format!(
                "outbox partition id {pid} is outside 0..={MAX_PID}"
            )));
        }
        Ok(Keys {
            base: pid << SEQ_BITS,
        })
    }

    /// The key of `seq`; `None` past the last seq a partition can have,
    /// where no record is.
    fn key(self, seq: u64) -> Option<i64> {
        (seq <= MAX_SEQ).then_some(self.base | seq as i64)
    }

    /// The partition's `pid`.
    fn pid(self) -> i64 {
        self.base >> SEQ_BITS
    }

    /// The key of a seq read from one of the partition's rows.
    fn of_row(self, seq: i64) -> i64 {
        self.base | seq
    }

    /// The lowest and the highest key of the partition.
    fn range(self) -> (i64, i64) {
        (self.base, self.base | MAX_SEQ as i64)
    }
}

/// The seq in a record's key.
fn seq_of(key: i64) -> i64 {
    key & MAX_SEQ as i64
}

/// An outbox in a SQLite database.
pub struct SqliteOutboxStore {
    db: Db,
    options: SqliteOptions,
    /// Appends made while the writer is busy share one job ([`append_all`]).
    appends: Arc<Batch<Append, Vec<u64>>>,
}

impl SqliteOutboxStore {
    /// Opens the outbox at `options.path`, creating the file and tables if
    /// needed and migrating an older layout in place.
    pub async fn open(options: SqliteOptions) -> StoreResult<Self> {
        let db = Db::open(options.clone(), "outbox", schema::outbox).await?;
        Ok(SqliteOutboxStore {
            db,
            options,
            appends: Batch::new(true, append_all),
        })
    }

    /// The options it was opened with.
    pub fn options(&self) -> &SqliteOptions {
        &self.options
    }

    /// Transactions committed since open. Against the number of operations
    /// it shows how many share one commit (and one fsync): group commit at
    /// work, for metrics and benchmarks.
    pub fn commits(&self) -> u64 {
        self.db.commits()
    }

    /// Finishes the writes already sent and closes the database.
    pub async fn close(self) {
        self.db.close().await;
    }

    /// Every record of `partition`, in seq order.
    #[cfg(test)]
    pub(crate) async fn dump(&self, partition: &str) -> StoreResult<Vec<OutboxRecord>> {
        let partition = partition.to_owned();
        self.db
            .read(move |conn| {
                let Some(p) = partition_row(conn, &partition)? else {
                    return Ok(Vec::new());
                };
                // A fresh record at or below `claimed_to` has the claim of
                // the run holding it (invariant 7).
                let sql = "SELECT r.key, r.msg, r.id, r.binding, r.address, r.created_at_ns, \
                    r.expires_at_ns, COALESCE(r.claim_version, c.version), \
                    COALESCE(r.claim_owner, c.owner), COALESCE(r.claimed_at_ns, c.claimed_at_ns), \
                    r.replay_count, r.first_attempt_at_ns, r.last_error \
                    FROM outbox_records r LEFT JOIN outbox_claims c ON r.state=3 AND r.key<=?3 \
                    AND r.key BETWEEN c.first_key AND c.last_key \
                    WHERE r.key BETWEEN ?1 AND ?2 ORDER BY r.key";
                let mut stmt = conn.prepare(sql).map_err(sql_error)?;
                let (first, last) = Keys::of(p.pid)?.range();
                let mut names = Names::default();
                let rows = stmt
                    .query_map([first, last, p.claimed_to], |r| raw_record(r, &mut names))
                    .map_err(sql_error)?
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(sql_error)?;
                with_envelopes(conn, &partition, rows)
            })
            .await
    }

    /// Message rows (stored envelopes) of `partition`.
    #[cfg(test)]
    pub(crate) async fn envelopes(&self, partition: &str) -> StoreResult<usize> {
        let partition = partition.to_owned();
        self.db
            .read(move |conn| {
                let n: i64 = conn
                    .query_row(
                        "SELECT COUNT(*) FROM outbox_messages m \
                         JOIN outbox_partitions p ON p.pid = m.pid WHERE p.partition=?1",
                        [&partition],
                        |r| r.get(0),
                    )
                    .map_err(sql_error)?;
                Ok(usize::try_from(n).unwrap_or(0))
            })
            .await
    }
}

/// Column `i` of `r` as text, borrowed from the row.
fn text<'r>(r: &'r Row<'_>, i: usize) -> rusqlite::Result<&'r str> {
    r.get_ref(i)?.as_str().map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(i, rusqlite::types::Type::Text, e.into())
    })
}

/// A record row, its binding and address shared through `names` with the
/// rows read before it.
fn raw_record(r: &Row<'_>, names: &mut Names) -> rusqlite::Result<RawRecord> {
    Ok(RawRecord {
        seq: seq_of(r.get(0)?),
        msg: r.get(1)?,
        id: r.get(2)?,
        binding: names.get(text(r, 3)?),
        address: names.get(text(r, 4)?),
        created_at: r.get(5)?,
        expires_at: r.get(6)?,
        claim_version: r.get(7)?,
        claim_owner: r.get(8)?,
        claimed_at: r.get(9)?,
        replay_count: r.get(10)?,
        first_attempt_at: r.get(11)?,
        last_error: r.get(12)?,
    })
}

/// Turns rows into records in seq order, each message's envelope read and
/// decoded once and shared by its records (invariant 4).
fn with_envelopes(
    conn: &Connection,
    partition: &str,
    rows: Vec<RawRecord>,
) -> StoreResult<Vec<OutboxRecord>> {
    let mut select = conn
        .prepare_cached("SELECT envelope FROM outbox_messages WHERE msg=?1")
        .map_err(sql_error)?;
    into_records(partition, rows, |msg| {
        select
            .query_row([msg], |r| r.get(0))
            .optional()
            .map_err(sql_error)
    })
}

/// A partition's row.
struct PartitionRow {
    pid: i64,
    hwm: u64,
    last_seq: u64,
    /// Invariant 6: no record in state 1 has a higher key.
    claimed_to: i64,
}

fn partition_row(conn: &Connection, partition: &str) -> StoreResult<Option<PartitionRow>> {
    conn.prepare_cached(
        "SELECT pid, hwm, last_seq, claimed_to FROM outbox_partitions WHERE partition=?1",
    )
    .map_err(sql_error)?
    .query_row([partition], |r| {
        Ok((
            r.get::<_, i64>(0)?,
            r.get::<_, i64>(1)?,
            r.get::<_, i64>(2)?,
            r.get::<_, i64>(3)?,
        ))
    })
    .optional()
    .map_err(sql_error)?
    .map(|(pid, hwm, last_seq, claimed_to)| {
        Ok(PartitionRow {
            pid,
            hwm: to_u64(hwm)?,
            last_seq: to_u64(last_seq)?,
            claimed_to,
        })
    })
    .transpose()
}

/// Creates a partition's row with `hwm`; its `pid`. Refused, before
/// anything is written, when the `pid` would not fit in a key.
fn insert_partition(conn: &Connection, partition: &str, hwm: u64) -> StoreResult<i64> {
    let pid: i64 = conn
        .prepare_cached("SELECT COALESCE(MAX(pid), 0) + 1 FROM outbox_partitions")
        .map_err(sql_error)?
        .query_row([], |r| r.get(0))
        .map_err(sql_error)?;
    if pid > MAX_PID {
        return Err(StoreError::Conflict(format!(
            "the outbox has used all {MAX_PID} partition ids: partition {partition} cannot be \
             created; drain the outbox and point the store at a new file"
        )));
    }
    conn.prepare_cached(
        "INSERT INTO outbox_partitions (pid, partition, hwm, last_seq) VALUES (?1, ?2, ?3, 0)",
    )
    .map_err(sql_error)?
    .execute(params![pid, partition, to_i64(hwm)?])
    .map_err(sql_error)?;
    Ok(pid)
}

/// The partition's row, failing when `version` is below its high-water
/// mark; `None` for a partition never written.
fn fence(conn: &Connection, partition: &str, version: u64) -> StoreResult<Option<PartitionRow>> {
    match partition_row(conn, partition)? {
        Some(p) if version < p.hwm => Err(stale(partition, version, p.hwm)),
        found => Ok(found),
    }
}

fn sql_limit(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

/// An append waiting for its batch: the partition and the message, checked
/// by [`validate_append`] and with at least one record.
type Append = (String, NewMessage);

/// The statements an append runs, prepared once per batch.
struct Inserts<'c> {
    message: CachedStatement<'c>,
    record: CachedStatement<'c>,
}

/// A partition as a batch of appends found it, and the seqs it assigned.
struct Appending {
    partition: String,
    pid: i64,
    /// `last_seq` as stored.
    stored: u64,
    /// The last seq assigned so far in this batch.
    last: u64,
}

/// Appends a batch of messages in arrival order (invariant 1 for each), one
/// result each. The batch reads each partition's row once and writes its
/// `last_seq` once. A message refused before it wrote anything (its
/// partition cannot take more seqs or partitions) gets its own error and
/// the others go on; any other failure fails the whole batch.
fn append_all(conn: &Connection, appends: Vec<Append>) -> StoreResult<Vec<StoreResult<Vec<u64>>>> {
    let mut partitions: Vec<Appending> = Vec::new();
    let mut results = Vec::with_capacity(appends.len());
    // `last_insert_rowid` rather than `RETURNING`, which costs SQLite an
    // ephemeral table per statement.
    let mut inserts = Inserts {
        message: conn
            .prepare_cached(
                "INSERT INTO outbox_messages (pid, first_seq, last_seq, envelope) \
                 VALUES (?1, ?2, ?3, ?4)",
            )
            .map_err(sql_error)?,
        // State 3: fresh (invariant 7).
        record: conn
            .prepare_cached(
                "INSERT INTO outbox_records (key, msg, id, binding, address, created_at_ns, \
                 expires_at_ns, state, replay_count) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 3, 0)",
            )
            .map_err(sql_error)?,
    };
    for (partition, message) in appends {
        let before = conn.total_changes();
        match append_one(conn, &mut inserts, &mut partitions, partition, message) {
            // Part of it written, or the transaction rolled back (see the
            // writer's notes): nothing of the batch may stay.
            Err(e) if conn.total_changes() != before || conn.is_autocommit() => return Err(e),
            result => results.push(result),
        }
    }
    let mut update = conn
        .prepare_cached("UPDATE outbox_partitions SET last_seq=?2 WHERE pid=?1")
        .map_err(sql_error)?;
    for p in partitions.iter().filter(|p| p.last != p.stored) {
        update
            .execute(params![p.pid, to_i64(p.last)?])
            .map_err(sql_error)?;
    }
    Ok(results)
}

/// Writes one message of a batch: its message row and a fresh record per
/// binding (invariant 7), at the seqs after the last its partition assigned.
fn append_one(
    conn: &Connection,
    inserts: &mut Inserts<'_>,
    partitions: &mut Vec<Appending>,
    partition: String,
    message: NewMessage,
) -> StoreResult<Vec<u64>> {
    // Checked before anything is written (a new partition's row included),
    // so a refused append leaves nothing.
    let created_at = unix_nanos(message.created_at)?;
    let expires_at = message.expires_at.map(unix_nanos).transpose()?;
    // A batch holds the appends of a store's few routes: a short list.
    let i = match partitions.iter().position(|p| p.partition == partition) {
        Some(i) => i,
        None => {
            let (pid, stored) = match partition_row(conn, &partition)? {
                Some(row) => (row.pid, row.last_seq),
                None => (insert_partition(conn, &partition, 0)?, 0),
            };
            partitions.push(Appending {
                partition,
                pid,
                stored,
                last: stored,
            });
            partitions.len() - 1
        }
    };
    let p = &mut partitions[i];
    let first = p.last + 1;
    let last = p.last + message.records.len() as u64;
    let keys = Keys::of(p.pid)?;
    keys.key(last).ok_or_else(|| seqs_used_up(&p.partition))?;
    inserts
        .message
        .execute(params![
            p.pid,
            to_i64(first)?,
            to_i64(last)?,
            message.envelope.into_encoded()
        ])
        .map_err(sql_error)?;
    let msg = conn.last_insert_rowid();
    let seqs: Vec<u64> = (first..=last).collect();
    for (seq, r) in seqs.iter().zip(message.records) {
        inserts
            .record
            .execute(params![
                keys.key(*seq).ok_or_else(|| seqs_used_up(&p.partition))?,
                msg,
                r.id,
                r.binding,
                r.address,
                created_at,
                expires_at,
            ])
            .map_err(sql_error)?;
    }
    p.last = last;
    Ok(seqs)
}

fn seqs_used_up(partition: &str) -> StoreError {
    StoreError::Conflict(format!(
        "partition {partition} has assigned all {MAX_SEQ} seqs it can: drain it and point the \
         store at a new file"
    ))
}

struct ClaimArgs<'a> {
    partition: &'a str,
    owner: &'a str,
    version: u64,
    limit: usize,
    now: SystemTime,
    stale_after: Duration,
}

/// The partition a claim or an expiry works on, past its fence.
struct Fenced {
    keys: Keys,
    /// The partition's `claimed_to` (invariant 6).
    claimed_to: i64,
}

/// Applies `version` to the partition's fence: `Stale` below the mark; above
/// it the mark rises and every older claim is pending again (invariant 3 of
/// the stores): records claimed one by one go back to state 0, and the runs
/// of fresh records are deleted with `claimed_to` set back to 0 (invariant
/// 7 here).
fn advance_fence(conn: &Connection, partition: &str, version: u64) -> StoreResult<Fenced> {
    let Some(p) = fence(conn, partition, version)? else {
        return Ok(Fenced {
            keys: Keys::of(insert_partition(conn, partition, version)?)?,
            claimed_to: 0,
        });
    };
    let keys = Keys::of(p.pid)?;
    if version > p.hwm {
        // A newer lease: every claim of an older one is void at once. The
        // claimed records are the keys up to `claimed_to` in states 1 and 3
        // and the indexed ones in state 2 (invariants 6 and 7).
        let v = to_i64(version)?;
        let (first, last) = keys.range();
        conn.prepare_cached("UPDATE outbox_partitions SET hwm=?2, claimed_to=0 WHERE pid=?1")
            .map_err(sql_error)?
            .execute(params![p.pid, v])
            .map_err(sql_error)?;
        conn.prepare_cached("DELETE FROM outbox_claims WHERE first_key BETWEEN ?1 AND ?2")
            .map_err(sql_error)?
            .execute(params![first, last])
            .map_err(sql_error)?;
        const UNCLAIM: &str = "UPDATE outbox_records SET state=0, claim_version=NULL, \
            claim_owner=NULL, claimed_at_ns=NULL";
        conn.prepare_cached(&format!(
            "{UNCLAIM} WHERE key BETWEEN ?1 AND ?2 AND state=1 AND claim_version<?3"
        ))
        .map_err(sql_error)?
        .execute(params![first, p.claimed_to, v])
        .map_err(sql_error)?;
        conn.prepare_cached(&format!(
            "{UNCLAIM} WHERE key IN (SELECT key FROM {EXPIRING} \
               WHERE state=2 AND key BETWEEN ?1 AND ?2 AND claim_version<?3)"
        ))
        .map_err(sql_error)?
        .execute(params![first, last, v])
        .map_err(sql_error)?;
        return Ok(Fenced {
            keys,
            claimed_to: 0,
        });
    }
    Ok(Fenced {
        keys,
        claimed_to: p.claimed_to,
    })
}

fn claim(conn: &Connection, a: ClaimArgs<'_>) -> StoreResult<Vec<OutboxRecord>> {
    let fenced = advance_fence(conn, a.partition, a.version)?;
    let keys = fenced.keys;
    let (first, last) = keys.range();
    let now = unix_nanos(a.now)?;
    let stale_ns = i64::try_from(a.stale_after.as_nanos()).unwrap_or(i64::MAX);
    let stale_at = now.saturating_sub(stale_ns);
    let limit = sql_limit(a.limit);
    // The oldest `limit` of the pending records and of this owner's claims
    // old enough to be taken back, merged here. Selecting and then marking
    // by seq range costs less than one `UPDATE … WHERE seq IN (…)
    // RETURNING`, which builds two ephemeral tables per call.
    //
    // Pending and fresh (invariant 7): the oldest above `claimed_to`, read
    // by key. They are taken as a prefix, so the run written below holds
    // every fresh record up to the new `claimed_to`.
    // None when `claimed_to` is the last key there can be (`i64::MAX`).
    let fresh = match fenced.claimed_to.max(first).checked_add(1) {
        Some(from) => selected(conn, &fresh_in(), params![from, last, limit])?,
        None => Vec::new(),
    };
    let fresh_seqs: Vec<i64> = fresh.iter().map(|r| r.seq).collect();
    let mut rows = fresh;
    // Pending since a release (or an older layout): a range scan of their
    // index.
    rows.extend(selected(
        conn,
        &format!(
            "SELECT {COLUMNS} FROM {PENDING} WHERE state=0 AND key BETWEEN ?1 AND ?2 \
             ORDER BY key LIMIT ?3"
        ),
        params![first, last, limit],
    )?);
    // Claimed by a claim and stale (invariant 6): among the keys up to
    // `claimed_to`, read in key order. Claims take the oldest pending
    // records, so these are the claimed records and the few released among
    // them; no index holds a claim's owner or time, so reading the rows
    // costs less than finding them through one.
    rows.extend(selected(
        conn,
        &format!(
            "SELECT {COLUMNS} FROM outbox_records NOT INDEXED WHERE key BETWEEN ?1 AND ?2 \
             AND state=1 AND claim_owner=?4 AND claimed_at_ns<=?5 ORDER BY key LIMIT ?3"
        ),
        params![first, fenced.claimed_to, limit, a.owner, stale_at],
    )?);
    // Fresh and claimed by a stale run of this owner (invariant 7).
    let stale_runs = conn
        .prepare_cached(
            "SELECT first_key, last_key FROM outbox_claims WHERE first_key BETWEEN ?1 AND ?2 \
             AND owner=?3 AND claimed_at_ns<=?4",
        )
        .map_err(sql_error)?
        .query_map(params![first, last, a.owner, stale_at], |r| {
            Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?))
        })
        .map_err(sql_error)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(sql_error)?;
    for (run_first, run_last) in &stale_runs {
        rows.extend(selected(
            conn,
            &fresh_in(),
            params![run_first, run_last, limit],
        )?);
    }
    // Claimed by an expiry and stale: few, and indexed. They stay in state 2
    // (see `mark`), so they never raise `claimed_to`.
    let expiring = selected(
        conn,
        &format!(
            "SELECT {COLUMNS} FROM {EXPIRING} WHERE state=2 AND key BETWEEN ?1 AND ?2 \
             AND claim_owner=?4 AND claimed_at_ns<=?5 ORDER BY key LIMIT ?3"
        ),
        params![first, last, limit, a.owner, stale_at],
    )?;
    let expiring_seqs: Vec<i64> = expiring.iter().map(|r| r.seq).collect();
    rows.extend(expiring);
    rows.sort_unstable_by_key(|r| r.seq);
    rows.truncate(a.limit);
    // `fresh_seqs` is ascending, and the fresh records taken are a prefix of
    // it: every candidate was merged in key order before the cut to
    // `limit`, so a fresh record is cut only with every higher one. They
    // get one run; every other record its own claim.
    let (taken_fresh, one_by_one): (Vec<i64>, Vec<i64>) = rows
        .iter()
        .map(|r| r.seq)
        .partition(|seq| fresh_seqs.binary_search(seq).is_ok());
    mark(
        conn,
        &a,
        now,
        CLAIMED_BY_CLAIM,
        one_by_one.into_iter().map(|seq| keys.of_row(seq)),
    )?;
    if let (Some(run_first), Some(run_last)) = (taken_fresh.first(), taken_fresh.last()) {
        conn.prepare_cached(
            "INSERT INTO outbox_claims (first_key, last_key, version, owner, claimed_at_ns) \
             VALUES (?1, ?2, ?3, ?4, ?5)",
        )
        .map_err(sql_error)?
        .execute(params![
            keys.of_row(*run_first),
            keys.of_row(*run_last),
            to_i64(a.version)?,
            a.owner,
            now
        ])
        .map_err(sql_error)?;
    }
    if !stale_runs.is_empty() {
        // Their records taken back now have claims of their own.
        drop_spent_runs(conn, keys, first, fenced.claimed_to)?;
    }
    stamp(&mut rows, &a, now)?;
    let top = rows
        .iter()
        .map(|r| r.seq)
        .filter(|seq| !expiring_seqs.contains(seq))
        .max()
        .map(|seq| keys.of_row(seq));
    if let Some(top) = top.filter(|top| *top > fenced.claimed_to) {
        conn.prepare_cached("UPDATE outbox_partitions SET claimed_to=?2 WHERE pid=?1")
            .map_err(sql_error)?
            .execute(params![keys.pid(), top])
            .map_err(sql_error)?;
    }
    with_envelopes(conn, a.partition, rows)
}

/// Selects the fresh records of the key range `?1..=?2`, at most `?3`, by
/// key (invariant 7).
fn fresh_in() -> String {
    format!(
        "SELECT {COLUMNS} FROM outbox_records WHERE key BETWEEN ?1 AND ?2 AND state=3 \
         ORDER BY key LIMIT ?3"
    )
}

/// The rows a `SELECT {COLUMNS}` returns.
fn selected(
    conn: &Connection,
    sql: &str,
    args: impl rusqlite::Params,
) -> StoreResult<Vec<RawRecord>> {
    let mut names = Names::default();
    conn.prepare_cached(sql)
        .map_err(sql_error)?
        .query_map(args, |r| raw_record(r, &mut names))
        .map_err(sql_error)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(sql_error)
}

/// Claims the records of `keys` (ascending) for `a.owner` under
/// `a.version` at `now`, one by one: one `UPDATE` per run of consecutive
/// keys (the records released, stale or taken by an expiry: fresh ones
/// share a run row instead, invariant 7). Each record goes to `state`, but one in
/// state 2 stays there: a stale expiry taken back by a claim stays where
/// invariant 6 finds it.
fn mark(
    conn: &Connection,
    a: &ClaimArgs<'_>,
    now: i64,
    state: i64,
    keys: impl IntoIterator<Item = i64>,
) -> StoreResult<()> {
    let version = to_i64(a.version)?;
    let mut update = conn
        .prepare_cached(
            "UPDATE outbox_records SET state=CASE state WHEN 2 THEN 2 ELSE ?6 END, \
             claim_version=?3, claim_owner=?4, claimed_at_ns=?5 WHERE key BETWEEN ?1 AND ?2",
        )
        .map_err(sql_error)?;
    for (first, last) in runs(keys) {
        update
            .execute(params![first, last, version, a.owner, now, state])
            .map_err(sql_error)?;
    }
    Ok(())
}

/// Gives `rows` the claim `a` just wrote for them, as the caller returns them.
fn stamp(rows: &mut [RawRecord], a: &ClaimArgs<'_>, now: i64) -> StoreResult<()> {
    let version = to_i64(a.version)?;
    for row in rows {
        row.state_claimed(version, a.owner, now);
    }
    Ok(())
}

/// A run of fresh records claimed under one version, cut to a key range.
struct Span {
    first: i64,
    last: i64,
    owner: String,
    claimed_at: i64,
}

/// The parts of `first..=last` that runs of `version` hold (invariant 7).
fn spans(
    conn: &Connection,
    keys: Keys,
    first: i64,
    last: i64,
    version: i64,
) -> StoreResult<Vec<Span>> {
    conn.prepare_cached(
        "SELECT first_key, last_key, owner, claimed_at_ns FROM outbox_claims \
         WHERE first_key BETWEEN ?1 AND ?3 AND last_key>=?2 AND version=?4",
    )
    .map_err(sql_error)?
    .query_map(params![keys.range().0, first, last, version], |r| {
        Ok(Span {
            first: r.get::<_, i64>(0)?.max(first),
            last: r.get::<_, i64>(1)?.min(last),
            owner: r.get(2)?,
            claimed_at: r.get(3)?,
        })
    })
    .map_err(sql_error)?
    .collect::<Result<Vec<_>, _>>()
    .map_err(sql_error)
}

/// Deletes the runs meeting `first..=last` that hold no fresh record any
/// more (invariant 7: a run row goes with its last fresh record).
fn drop_spent_runs(conn: &Connection, keys: Keys, first: i64, last: i64) -> StoreResult<()> {
    conn.prepare_cached(
        "DELETE FROM outbox_claims WHERE first_key BETWEEN ?1 AND ?3 AND last_key>=?2 \
         AND NOT EXISTS (SELECT 1 FROM outbox_records WHERE key BETWEEN \
           outbox_claims.first_key AND outbox_claims.last_key AND state=3)",
    )
    .map_err(sql_error)?
    .execute(params![keys.range().0, first, last])
    .map_err(sql_error)?;
    Ok(())
}

/// Gives the fresh records of the keys `runs` that runs of `version` claim
/// a claim of their own (state 1, invariant 7), so that what acts on
/// claimed records one by one finds them.
fn materialize(
    conn: &Connection,
    keys: Keys,
    runs: &[(i64, i64)],
    version: i64,
) -> StoreResult<()> {
    let mut update = conn
        .prepare_cached(
            "UPDATE outbox_records SET state=1, claim_version=?3, claim_owner=?4, \
             claimed_at_ns=?5 WHERE key BETWEEN ?1 AND ?2 AND state=3",
        )
        .map_err(sql_error)?;
    let mut touched = false;
    for (first, last) in runs {
        for span in spans(conn, keys, *first, *last, version)? {
            update
                .execute(params![
                    span.first,
                    span.last,
                    version,
                    span.owner,
                    span.claimed_at
                ])
                .map_err(sql_error)?;
            touched = true;
        }
    }
    if let (true, Some((first, _)), Some((_, last))) = (touched, runs.first(), runs.last()) {
        drop_spent_runs(conn, keys, *first, *last)?;
    }
    Ok(())
}

/// The runs of consecutive values of ascending, distinct `seqs`, as
/// `(first, last)`: the seq ranges that hold exactly these records.
fn runs<T>(seqs: impl IntoIterator<Item = T>) -> Vec<(T, T)>
where
    T: Copy + PartialEq + std::ops::Add<Output = T> + From<u8>,
{
    let mut runs: Vec<(T, T)> = Vec::new();
    for seq in seqs {
        match runs.last_mut() {
            Some((_, last)) if *last + T::from(1) == seq => *last = seq,
            _ => runs.push((seq, seq)),
        }
    }
    runs
}

/// `seqs` sorted, each once.
fn distinct(seqs: &[u64]) -> Vec<u64> {
    let mut seqs = seqs.to_vec();
    seqs.sort_unstable();
    seqs.dedup();
    seqs
}

/// Runs `stmt` (parameters: key, version, then `extra`) for each distinct
/// seq, once the fresh ones among them have claims of their own
/// ([`materialize`]), and returns those it changed, ascending.
fn per_claimed(
    conn: &Connection,
    partition: &str,
    version: u64,
    seqs: &[u64],
    stmt: &str,
    extra: &[&dyn rusqlite::ToSql],
) -> StoreResult<Vec<u64>> {
    let Some(p) = fence(conn, partition, version)? else {
        return Ok(Vec::new());
    };
    let keys = Keys::of(p.pid)?;
    let version = to_i64(version)?;
    let seqs = distinct(seqs);
    let runs = runs(seqs.iter().filter_map(|seq| keys.key(*seq)));
    materialize(conn, keys, &runs, version)?;
    let mut stmt = conn.prepare_cached(stmt).map_err(sql_error)?;
    let mut done = Vec::new();
    for seq in seqs {
        let Some(key) = keys.key(seq) else {
            continue;
        };
        let mut args: Vec<&dyn rusqlite::ToSql> = vec![&key, &version];
        args.extend_from_slice(extra);
        if stmt.execute(args.as_slice()).map_err(sql_error)? == 1 {
            done.push(seq);
        }
    }
    Ok(done)
}

/// Which records `release` acts on: claimed one by one (by a claim or an
/// expiry) with exactly its version.
const CLAIMED: &str = "WHERE key=?1 AND state IN (1, 2) AND claim_version=?2";

/// Which records of the key run `?1..=?2` `complete` acts on one by one:
/// claimed with exactly its version (`?3`).
const CLAIMED_IN_RUN: &str = "WHERE key BETWEEN ?1 AND ?2 AND state IN (1, 2) AND claim_version=?3";

/// Which fresh records of the key range `?1..=?2` `complete` acts on: those
/// of a run of its version, the range being cut to one (invariant 7).
const FRESH_RANGE: &str = "WHERE key BETWEEN ?1 AND ?2 AND state=3";

fn complete(
    conn: &Connection,
    partition: &str,
    version: u64,
    seqs: &[u64],
) -> StoreResult<Vec<u64>> {
    let Some(p) = fence(conn, partition, version)? else {
        return Ok(Vec::new());
    };
    let keys = Keys::of(p.pid)?;
    let version = to_i64(version)?;
    // A statement of each kind per run of consecutive seqs (a batch is
    // mostly one run), not per seq. The run's rows are read once, before
    // they are deleted (a `DELETE … RETURNING` costs SQLite an ephemeral
    // table per statement), and sorted here into those claimed one by one
    // and the fresh ones of runs of `version`; each delete then matches
    // exactly the rows found for it.
    let mut find = conn
        .prepare_cached(
            "SELECT key, msg, state, claim_version FROM outbox_records WHERE key BETWEEN ?1 AND ?2",
        )
        .map_err(sql_error)?;
    let mut delete = conn
        .prepare_cached(&format!("DELETE FROM outbox_records {CLAIMED_IN_RUN}"))
        .map_err(sql_error)?;
    let mut delete_fresh = conn
        .prepare_cached(&format!("DELETE FROM outbox_records {FRESH_RANGE}"))
        .map_err(sql_error)?;
    // Invariant 2: a message goes with the last record of its range. The
    // messages of a run's records lie between the lowest and the highest of
    // their `msg`s, and few others do: a partition's messages have ascending
    // `msg` in append order (a rowid above every live one), and a run's
    // records were appended one after another.
    let mut emptied = conn
        .prepare_cached(
            "DELETE FROM outbox_messages WHERE msg BETWEEN ?2 AND ?3 AND pid=?1 AND NOT EXISTS ( \
               SELECT 1 FROM outbox_records WHERE key BETWEEN \
               ?4 + outbox_messages.first_seq AND ?4 + outbox_messages.last_seq)",
        )
        .map_err(sql_error)?;
    let mut done = Vec::new();
    // No record has a seq without a key.
    let stored = distinct(seqs).into_iter().filter_map(|seq| keys.key(seq));
    for (first, last) in runs(stored) {
        let rows = find
            .query_map([first, last], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, Option<i64>>(3)?,
                ))
            })
            .map_err(sql_error)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(sql_error)?;
        let spans = if rows.iter().any(|r| r.2 == FRESH) {
            spans(conn, keys, first, last, version)?
        } else {
            Vec::new()
        };
        let mut found = Vec::with_capacity(rows.len());
        let mut one_by_one = false;
        for (key, msg, state, claim_version) in rows {
            let done = match state {
                CLAIMED_BY_CLAIM | CLAIMED_BY_EXPIRE => claim_version == Some(version),
                FRESH => spans.iter().any(|s| (s.first..=s.last).contains(&key)),
                _ => false,
            };
            if done {
                one_by_one |= state != FRESH;
                found.push((key, msg));
            }
        }
        if one_by_one {
            delete
                .execute(params![first, last, version])
                .map_err(sql_error)?;
        }
        for span in &spans {
            delete_fresh
                .execute(params![span.first, span.last])
                .map_err(sql_error)?;
        }
        if !spans.is_empty() {
            drop_spent_runs(conn, keys, first, last)?;
        }
        let msgs = found.iter().map(|(_, msg)| *msg);
        let (Some(low), Some(high)) = (msgs.clone().min(), msgs.max()) else {
            continue;
        };
        emptied
            .execute(params![p.pid, low, high, keys.range().0])
            .map_err(sql_error)?;
        for (key, _) in found {
            done.push(to_u64(seq_of(key))?);
        }
    }
    done.sort_unstable();
    Ok(done)
}

fn release(
    conn: &Connection,
    partition: &str,
    version: u64,
    seqs: &[u64],
    release: Release,
) -> StoreResult<Vec<u64>> {
    const UNCLAIM: &str = "UPDATE outbox_records SET state=0, claim_version=NULL, \
        claim_owner=NULL, claimed_at_ns=NULL";
    match release {
        Release::Untried => per_claimed(
            conn,
            partition,
            version,
            seqs,
            &format!("{UNCLAIM} {CLAIMED}"),
            &[],
        ),
        Release::Failed {
            error,
            attempted_at,
        } => {
            let at = unix_nanos(attempted_at)?;
            per_claimed(
                conn,
                partition,
                version,
                seqs,
                &format!(
                    "{UNCLAIM}, replay_count=replay_count+1, \
                     first_attempt_at_ns=COALESCE(first_attempt_at_ns, ?3), last_error=?4 {CLAIMED}"
                ),
                &[&at, &error],
            )
        }
    }
}

fn expire(conn: &Connection, a: ClaimArgs<'_>) -> StoreResult<Vec<OutboxRecord>> {
    let fenced = advance_fence(conn, a.partition, a.version)?;
    let now = unix_nanos(a.now)?;
    // The index is on the expression `key >> 40` (the partition's `pid`),
    // which the query must spell the same way.
    // Pending: in state 0, or fresh above `claimed_to` (invariant 7).
    let mut rows = selected(
        conn,
        &format!(
            "SELECT {COLUMNS} FROM outbox_records INDEXED BY outbox_records_expiry \
             WHERE key >> {SEQ_BITS} = ?1 AND (state=0 OR state=3 AND key>?4) \
             AND expires_at_ns IS NOT NULL AND expires_at_ns<=?3 ORDER BY key LIMIT ?2"
        ),
        params![
            fenced.keys.pid(),
            sql_limit(a.limit),
            now,
            fenced.claimed_to
        ],
    )?;
    let keys = fenced.keys;
    mark(
        conn,
        &a,
        now,
        CLAIMED_BY_EXPIRE,
        rows.iter().map(|r| keys.of_row(r.seq)),
    )?;
    stamp(&mut rows, &a, now)?;
    with_envelopes(conn, a.partition, rows)
}

fn stats(conn: &Connection, partition: &str) -> StoreResult<OutboxStats> {
    let Some(p) = partition_row(conn, partition)? else {
        return Ok(OutboxStats::default());
    };
    let mut stats = OutboxStats {
        high_water_mark: p.hwm,
        ..OutboxStats::default()
    };
    // Counted here rather than by `GROUP BY`, which sorts every record of
    // the partition first: a partition has a few bindings, so a short list
    // searched by name groups them without a sort or an allocation per row.
    let mut stmt = conn
        .prepare_cached(
            "SELECT binding, state, created_at_ns, key FROM outbox_records \
             WHERE key BETWEEN ?1 AND ?2",
        )
        .map_err(sql_error)?;
    let (first, last) = Keys::of(p.pid)?.range();
    let mut rows = stmt.query([first, last]).map_err(sql_error)?;
    let mut groups: Vec<Group> = Vec::new();
    while let Some(row) = rows.next().map_err(sql_error)? {
        let binding = row
            .get_ref(0)
            .and_then(|v| Ok(v.as_str()?))
            .map_err(sql_error)?;
        // Invariant 7: a fresh record is claimed at or below `claimed_to`.
        let claimed = match row.get::<_, i64>(1).map_err(sql_error)? {
            0 => false,
            FRESH => row.get::<_, i64>(3).map_err(sql_error)? <= p.claimed_to,
            _ => true,
        };
        let created_at = row.get::<_, i64>(2).map_err(sql_error)?;
        match groups
            .iter_mut()
            .find(|g| g.claimed == claimed && g.binding == binding)
        {
            Some(g) => {
                g.count += 1;
                g.oldest = g.oldest.min(created_at);
            }
            None => groups.push(Group {
                binding: binding.to_owned(),
                claimed,
                count: 1,
                oldest: created_at,
            }),
        }
    }
    for g in groups {
        let oldest = from_unix_nanos(g.oldest)?;
        for s in [
            &mut stats.total,
            stats.bindings.entry(g.binding).or_default(),
        ] {
            s.add_group(g.claimed, g.count, oldest);
        }
    }
    Ok(stats)
}

/// The records of one binding in one state, as `stats` counts them.
struct Group {
    binding: String,
    claimed: bool,
    count: u64,
    /// The lowest `created_at_ns`.
    oldest: i64,
}

impl OutboxStore for SqliteOutboxStore {
    fn append<'a>(
        &'a self,
        partition: &'a str,
        message: NewMessage,
    ) -> BoxFuture<'a, StoreResult<Vec<u64>>> {
        Box::pin(async move {
            validate_append(partition, &message)?;
            if message.records.is_empty() {
                return Ok(Vec::new());
            }
            self.db
                .write_batched(&self.appends, (partition.to_owned(), message))
                .await
        })
    }

    fn claim<'a>(
        &'a self,
        partition: &'a str,
        owner: &'a str,
        version: u64,
        limit: usize,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Vec<OutboxRecord>>> {
        let (partition, owner) = (partition.to_owned(), owner.to_owned());
        let stale_after = self.options.stale_claim_duration;
        Box::pin(self.db.write_unsynced(move |c| {
            claim(
                c,
                ClaimArgs {
                    partition: &partition,
                    owner: &owner,
                    version,
                    limit,
                    now,
                    stale_after,
                },
            )
        }))
    }

    fn complete<'a>(
        &'a self,
        partition: &'a str,
        version: u64,
        seqs: &'a [u64],
    ) -> BoxFuture<'a, StoreResult<Vec<u64>>> {
        let (partition, seqs) = (partition.to_owned(), seqs.to_vec());
        Box::pin(
            self.db
                .write_unsynced(move |c| complete(c, &partition, version, &seqs)),
        )
    }

    fn release<'a>(
        &'a self,
        partition: &'a str,
        version: u64,
        seqs: &'a [u64],
        how: Release,
    ) -> BoxFuture<'a, StoreResult<Vec<u64>>> {
        let (partition, seqs) = (partition.to_owned(), seqs.to_vec());
        Box::pin(
            self.db
                .write_unsynced(move |c| release(c, &partition, version, &seqs, how)),
        )
    }

    fn expire<'a>(
        &'a self,
        partition: &'a str,
        owner: &'a str,
        version: u64,
        now: SystemTime,
        limit: usize,
    ) -> BoxFuture<'a, StoreResult<Vec<OutboxRecord>>> {
        let (partition, owner) = (partition.to_owned(), owner.to_owned());
        Box::pin(self.db.write_unsynced(move |c| {
            expire(
                c,
                ClaimArgs {
                    partition: &partition,
                    owner: &owner,
                    version,
                    limit,
                    now,
                    stale_after: Duration::ZERO,
                },
            )
        }))
    }

    fn stats<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, StoreResult<OutboxStats>> {
        let partition = partition.to_owned();
        Box::pin(self.db.read(move |c| stats(c, &partition)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stores::NewRecord;
    use crate::stores::conformance::{envelope, sqlite_options, t};

    /// A store on a new file in `dir`, and its options.
    async fn opened(dir: &tempfile::TempDir) -> (SqliteOutboxStore, SqliteOptions) {
        let options = sqlite_options(dir, "outbox.db");
        let store = SqliteOutboxStore::open(options.clone())
            .await
            .expect("open");
        (store, options)
    }

    fn message(bindings: &[&str]) -> NewMessage {
        let records = bindings.iter().map(|b| NewRecord::new(*b, "out")).collect();
        NewMessage::new(envelope("m"), t(1), records)
    }

    /// The last seqs a key can hold are assigned and work like any other;
    /// an append that would pass them is refused and writes nothing.
    #[tokio::test]
    async fn a_partition_out_of_seqs_refuses_the_append_and_writes_nothing() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let (store, options) = opened(&dir).await;
        assert_eq!(store.append("p", message(&["x"])).await, Ok(vec![1]));
        store.close().await;
        Connection::open(&options.path)
            .expect("open the file")
            .execute(
                "UPDATE outbox_partitions SET last_seq = ?1",
                [to_i64(MAX_SEQ - 1).expect("fits")],
            )
            .expect("near the last seq");

        let store = SqliteOutboxStore::open(options).await.expect("reopen");
        let refused = store.append("p", message(&["x", "y"])).await;
        assert!(
            matches!(&refused, Err(StoreError::Conflict(e)) if e.contains("all 1099511627775 seqs")),
            "{refused:?}"
        );
        assert_eq!(store.envelopes("p").await, Ok(1), "nothing written");
        assert_eq!(store.append("p", message(&["x"])).await, Ok(vec![MAX_SEQ]));
        let claimed = store.claim("p", "o", 1, 10, t(2)).await.expect("claim");
        let seqs: Vec<u64> = claimed.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, vec![1, MAX_SEQ]);
        assert_eq!(
            store.complete("p", 1, &[1, MAX_SEQ, MAX_SEQ + 1]).await,
            Ok(vec![1, MAX_SEQ])
        );
        assert_eq!(store.envelopes("p").await, Ok(0));
    }

    /// Appends made together share a batch, which reads each partition's row
    /// once and writes its `last_seq` once: each append still gets its own
    /// seqs, one refused for lack of seqs costs the others nothing, and the
    /// seqs go on from where the batch left them after a reopen.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn appends_made_together_get_their_own_seqs_and_errors() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let (store, options) = opened(&dir).await;
        assert_eq!(store.append("full", message(&["x"])).await, Ok(vec![1]));
        store.close().await;
        Connection::open(&options.path)
            .expect("open the file")
            .execute(
                "UPDATE outbox_partitions SET last_seq = ?1 WHERE partition = 'full'",
                [to_i64(MAX_SEQ - 1).expect("fits")],
            )
            .expect("near the last seq");

        let store = SqliteOutboxStore::open(options.clone())
            .await
            .expect("reopen");
        let partitions = ["p", "q", "full"];
        let appends = (0..30).map(|i| {
            let partition = partitions[i % 3];
            let bindings: &[&str] = if partition == "full" {
                &["x", "y"]
            } else {
                &["x"]
            };
            store.append(partition, message(bindings))
        });
        let results = futures::future::join_all(appends).await;
        for partition in ["p", "q"] {
            let mut seqs: Vec<u64> = (0..30)
                .filter(|i| partitions[i % 3] == partition)
                .flat_map(|i| results[i].clone().expect("appended"))
                .collect();
            seqs.sort_unstable();
            assert_eq!(seqs, (1..=10).collect::<Vec<_>>(), "partition {partition}");
        }
        for i in (0..30).filter(|i| partitions[i % 3] == "full") {
            assert!(
                matches!(&results[i], Err(StoreError::Conflict(_))),
                "{:?}",
                results[i]
            );
        }
        store.close().await;

        let store = SqliteOutboxStore::open(options).await.expect("reopen");
        assert_eq!(store.append("p", message(&["x"])).await, Ok(vec![11]));
        assert_eq!(
            store.append("full", message(&["x"])).await,
            Ok(vec![MAX_SEQ])
        );
        assert_eq!(
            store.envelopes("full").await,
            Ok(2),
            "nothing refused was written"
        );
    }

    /// `(seq, state)` of each record row, then `(first seq, last seq,
    /// version)` of each run, read from the file.
    type Layout = (Vec<(i64, i64)>, Vec<(i64, i64, i64)>);

    fn layout(options: &SqliteOptions) -> Layout {
        let conn = Connection::open(&options.path).expect("open the file");
        let states = conn
            .prepare("SELECT key & ?1, state FROM outbox_records ORDER BY key")
            .expect("prepare")
            .query_map([MAX_SEQ as i64], |r| Ok((r.get(0)?, r.get(1)?)))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows");
        let runs = conn
            .prepare("SELECT first_key & ?1, last_key & ?1, version FROM outbox_claims")
            .expect("prepare")
            .query_map([MAX_SEQ as i64], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows");
        (states, runs)
    }

    /// Invariant 7: a claim of fresh records writes one run row and leaves
    /// the records as they were; a release gives a record its own claim; the
    /// run goes with its last fresh record; a newer version voids the run.
    #[tokio::test]
    async fn a_claim_of_fresh_records_writes_one_run_not_a_row_per_record() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let (store, options) = opened(&dir).await;
        for _ in 0..5 {
            store.append("p", message(&["x"])).await.expect("append");
        }
        let claimed = store.claim("p", "o", 1, 3, t(2)).await.expect("claim");
        assert_eq!(claimed.iter().map(|r| r.seq).collect::<Vec<_>>(), [1, 2, 3]);
        assert!(
            claimed
                .iter()
                .all(|r| r.claim.as_ref().is_some_and(|c| c.version == 1))
        );
        assert_eq!(
            layout(&options),
            (
                vec![(1, 3), (2, 3), (3, 3), (4, 3), (5, 3)],
                vec![(1, 3, 1)]
            )
        );

        let untried = Release::Untried;
        assert_eq!(store.release("p", 1, &[2], untried).await, Ok(vec![2]));
        assert_eq!(store.complete("p", 1, &[1]).await, Ok(vec![1]));
        assert_eq!(
            layout(&options),
            (vec![(2, 0), (3, 3), (4, 3), (5, 3)], vec![(1, 3, 1)]),
            "seq 2 pending on its own; seq 3 still claimed by the run"
        );
        // Seq 3 is claimed: the next claim takes 2, then fresh 4 and 5.
        let again = store.claim("p", "o", 1, 10, t(3)).await.expect("claim");
        assert_eq!(again.iter().map(|r| r.seq).collect::<Vec<_>>(), [2, 4, 5]);
        assert_eq!(store.complete("p", 1, &[3]).await, Ok(vec![3]));
        assert_eq!(
            layout(&options),
            (vec![(2, 1), (4, 3), (5, 3)], vec![(4, 5, 1)]),
            "the first run went with seq 3"
        );

        // A newer version: the run is void and its records pending again.
        let taken = store.claim("p", "n", 2, 10, t(4)).await.expect("claim");
        assert_eq!(taken.iter().map(|r| r.seq).collect::<Vec<_>>(), [2, 4, 5]);
        assert_eq!(store.complete("p", 1, &[2, 4, 5]).await.ok(), None);
        assert_eq!(store.complete("p", 2, &[2, 4, 5]).await, Ok(vec![2, 4, 5]));
        assert_eq!(layout(&options), (vec![], vec![]));
        assert_eq!(store.envelopes("p").await, Ok(0));
    }
}
