//! The SQLite outbox: the envelope stored once per message, a record needing
//! a row of its own only once something acts on it alone
//! (`docs/adr/0007-outbox-layout.md`), keyed by one integer.
//!
//! # Layout
//!
//! - `outbox_partitions`: a row per partition with its fencing `hwm`, the
//!   `last_seq` assigned, `claimed_to` (invariant 6) and `pid`, the integer
//!   the other tables key on instead of the name.
//! - `outbox_messages`: a row per appended message, keyed by its first
//!   record's key: the encoded envelope, the seqs `first_seq..=last_seq` its
//!   records were given, their times and each one's id, binding and address
//!   ([`record_list`](super::record_list)).
//! - `outbox_records`: a row per record that left the fresh state
//!   (invariant 7), keyed by `key = pid << 40 | seq` (the table's rowid, see
//!   [`Keys`]): the record's own fields and the state that claims,
//!   completions and releases change, but not the envelope.
//! - `outbox_done` (layout 6): the key of each record completed while its
//!   message still holds others.
//! - `outbox_claims` (layout 5): a row per run of fresh records one claim
//!   took: its first and last key, version, owner, time and how many fresh
//!   records it still holds (invariant 7).
//!
//! # Invariants
//!
//! 1. An append writes its message row, and nothing else, in one job. Its
//!    records get consecutive seqs, the message row's
//!    `first_seq..=last_seq`, and the row's key (`msg`) is the first one's:
//!    the ranges of two messages of one partition never overlap, and a
//!    record's message is the one whose range holds its key.
//! 2. A record is stored while its key lies in a message's range and is not
//!    in `outbox_done`. The job that completes the last stored record of a
//!    message deletes the message row and its keys in `outbox_done`
//!    (`complete` is the only deletion): no envelope outlives its records,
//!    and none is deleted before them. A completed record whose message
//!    keeps others gets its key in `outbox_done`.
//! 3. Claims, completions, releases and expiries write `outbox_records`,
//!    its indexes, `outbox_done` and `outbox_claims` only, never a message
//!    row; a completion also deletes the message rows it emptied.
//! 4. A call that returns records decodes each message's envelope once and
//!    gives its records one `Arc` of it.
//! 5. A record's `key` is `pid << 40 | seq`: a partition's records are the
//!    key range of its `pid`, in seq order, and a seq never reaches 2^40.
//! 6. A record row's `state` is 0 pending, 1 claimed by `claim`, 2 claimed
//!    by `expire`. Pending rows are in the index `outbox_records_pending`
//!    and rows in state 2 in `outbox_records_expiring`; rows in state 1 are
//!    in no state index and have keys at most their partition's
//!    `claimed_to`, the highest key a claim took since the partition's
//!    fence last rose (a rise voids every claim and sets it back to 0). The
//!    search for stale claims reads the keys up to `claimed_to` — the
//!    oldest records, as claims take the oldest pending ones — and the few
//!    rows in state 2 (an expiry may claim records far ahead).
//! 7. A stored record without a row is *fresh*: an append writes no record
//!    row, and its message row holds what a row would (layout 6). A fresh
//!    record above its partition's `claimed_to` is pending; one at or below
//!    it is claimed by the `outbox_claims` row whose run
//!    `first_key..=last_key` holds it, and every fresh record at or below
//!    `claimed_to` lies in exactly one run. A claim takes fresh records as a
//!    prefix of those above `claimed_to` (the oldest pending records are
//!    taken first, invariant 6) and writes one run row for them. Runs never
//!    overlap, and a run's `fresh` counts the fresh records it holds.
//!    Whatever acts on one record of a run otherwise (a release, a claim
//!    taking back a stale run) or claims a fresh record by expiry first
//!    gives it a row (*materialize*); a completion of fresh records of a
//!    run of its version needs no row. A run row goes when its count
//!    reaches 0; a newer lease version deletes every run of the partition
//!    and sets `claimed_to` back to 0, so every fresh record is pending
//!    again.
//! 8. A fresh record is claimed (by a claim or an expiry) only once the
//!    writer's group that appended it is durable ([`Undurable`]): with
//!    `synchronous: full` the WAL is synced after the commit
//!    ([`super::syncer`]), and a claim must not see a record before its
//!    append returned (guarantee 2 of the stores).
//!
//! Every operation but `stats` is one job of the writer (atomic and, when
//! answered, committed); `stats` reads on the read connection. Appends made
//! while the writer is busy share one job ([`append_all`], a writer
//! [`Batch`]): it reads each partition's row once and writes its `last_seq`
//! once, where each append did both before. Only `append`
//! waits for an fsync: a claim, completion, release or expiry lost to a power
//! cut makes a record pending again, so it is sent once more — at-least-once
//! holds — while an acknowledged append lost would be a message lost.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use rusqlite::{CachedStatement, Connection, OptionalExtension, Row, params};

use super::record_list::{self, Entry};
use super::syncer::Durability;
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
/// The states of a record row (invariant 6).
const CLAIMED_BY_CLAIM: i64 = 1;
const CLAIMED_BY_EXPIRE: i64 = 2;

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

/// The appends whose group is not yet durable, per partition (invariant
/// 8): what claims and expiries leave alone. Used on the writer thread only,
/// so its lock is never contended.
struct Undurable {
    durability: Arc<Durability>,
    /// By `pid`, in append order: each append's group and first key.
    appended: Mutex<HashMap<i64, VecDeque<(u64, i64)>>>,
}

impl Undurable {
    fn new(durability: Arc<Durability>) -> Arc<Self> {
        Arc::new(Undurable {
            durability,
            appended: Mutex::new(HashMap::new()),
        })
    }

    /// A message appended at `first_key` of partition `pid`, in the group
    /// the writer is running. One entry per group and partition, the
    /// group's first key (a partition's keys rise within a group), so the
    /// list is as long as the groups not yet durable.
    fn appended(&self, pid: i64, first_key: i64) {
        let group = self.durability.group();
        if self.durability.is_durable(group) {
            return;
        }
        let mut appended = self.appended.lock().unwrap_or_else(PoisonError::into_inner);
        let waiting = appended.entry(pid).or_default();
        self.drop_durable(waiting);
        if waiting.back().is_none_or(|(last, _)| *last != group) {
            waiting.push_back((group, first_key));
        }
    }

    /// The highest key of partition `pid` a claim may take fresh, if any
    /// append is not yet durable. Groups become durable in order, and a
    /// partition's keys rise from group to group, so the durable appends are
    /// a prefix of its list.
    fn claimable_to(&self, pid: i64) -> Option<i64> {
        let mut appended = self.appended.lock().unwrap_or_else(PoisonError::into_inner);
        let waiting = appended.get_mut(&pid)?;
        self.drop_durable(waiting);
        waiting.front().map(|(_, first_key)| first_key - 1)
    }

    /// Drops the appends that became durable from the front of a list.
    fn drop_durable(&self, waiting: &mut VecDeque<(u64, i64)>) {
        while waiting
            .front()
            .is_some_and(|(group, _)| self.durability.is_durable(*group))
        {
            waiting.pop_front();
        }
    }
}

/// An outbox in a SQLite database.
pub struct SqliteOutboxStore {
    db: Db,
    options: SqliteOptions,
    /// Appends made while the writer is busy share one job ([`append_all`]).
    appends: Arc<Batch<Append, Vec<u64>>>,
    /// What claims leave alone until it is durable (invariant 8).
    undurable: Arc<Undurable>,
}

impl SqliteOutboxStore {
    /// Opens the outbox at `options.path`, creating the file and tables if
    /// needed and migrating an older layout in place.
    pub async fn open(options: SqliteOptions) -> StoreResult<Self> {
        let db = Db::open(options.clone(), "outbox", schema::outbox).await?;
        let undurable = Undurable::new(db.durability());
        let recorded = Arc::clone(&undurable);
        Ok(SqliteOutboxStore {
            db,
            options,
            appends: Batch::new(
                true,
                Box::new(move |conn, appends| append_all(conn, appends, &recorded)),
            ),
            undurable,
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
                let keys = Keys::of(p.pid)?;
                let (first, last) = keys.range();
                let mut rows = selected(
                    conn,
                    &format!("SELECT {COLUMNS} FROM outbox_records WHERE key BETWEEN ?1 AND ?2"),
                    params![first, last],
                )?;
                // A fresh record at or below `claimed_to` has the claim of
                // the run holding it (invariant 7).
                let runs: Vec<(i64, i64, i64, String, i64)> = conn
                    .prepare(
                        "SELECT first_key, last_key, version, owner, claimed_at_ns \
                         FROM outbox_claims WHERE first_key BETWEEN ?1 AND ?2",
                    )
                    .map_err(sql_error)?
                    .query_map([first, last], |r| {
                        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
                    })
                    .map_err(sql_error)?
                    .collect::<Result<_, _>>()
                    .map_err(sql_error)?;
                let mut names = Names::default();
                each_fresh(conn, keys, (first, last), false, |r| {
                    let mut raw = r.raw(&mut names);
                    let run = runs.iter().find(|run| (run.0..=run.1).contains(&r.key));
                    if let Some((_, _, version, owner, at)) = run.filter(|_| r.key <= p.claimed_to)
                    {
                        raw.state_claimed(*version, owner, *at);
                    }
                    rows.push(raw);
                    Ok(true)
                })?;
                with_envelopes(conn, &partition, rows, Vec::new())
            })
            .await
    }

    /// What breaks this module's invariants (2, 6, 7) in `partition`, read
    /// from the tables themselves: keys of rows and of `outbox_done` outside
    /// every message or in both, messages without a stored record, claims
    /// that are not the partition's fence, fresh records held by no run or
    /// by two, and runs whose count is not what they hold. The model-based
    /// test checks it after every step.
    #[cfg(test)]
    pub(crate) async fn broken_invariants(&self, partition: &str) -> StoreResult<Vec<String>> {
        let partition = partition.to_owned();
        self.db
            .read(move |conn| {
                let mut errs = Vec::new();
                let Some(p) = partition_row(conn, &partition)? else {
                    return Ok(errs);
                };
                let keys = Keys::of(p.pid)?;
                let (first, last) = keys.range();
                // The first two integer columns of `sql`'s rows in the partition.
                let pairs = |sql: &str| -> StoreResult<Vec<(i64, i64)>> {
                    conn.prepare(sql)
                        .map_err(sql_error)?
                        .query_map([first, last], |r| Ok((r.get(0)?, r.get(1)?)))
                        .map_err(sql_error)?
                        .collect::<Result<_, _>>()
                        .map_err(sql_error)
                };
                let msgs = pairs(&format!(
                    "SELECT msg, {} | last_seq FROM outbox_messages \
                     WHERE msg BETWEEN ?1 AND ?2 ORDER BY msg",
                    keys.base
                ))?;
                let rows: Vec<(i64, i64, Option<i64>)> = conn
                    .prepare(
                        "SELECT key, state, claim_version FROM outbox_records \
                         WHERE key BETWEEN ?1 AND ?2 ORDER BY key",
                    )
                    .map_err(sql_error)?
                    .query_map([first, last], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
                    .map_err(sql_error)?
                    .collect::<Result<_, _>>()
                    .map_err(sql_error)?;
                let done: Vec<i64> = pairs(
                    "SELECT key, key FROM outbox_done WHERE key BETWEEN ?1 AND ?2 ORDER BY key",
                )?
                .into_iter()
                .map(|k| k.0)
                .collect();
                let runs: Vec<(i64, i64, i64, i64)> = conn
                    .prepare(
                        "SELECT first_key, last_key, version, fresh FROM outbox_claims \
                         WHERE first_key BETWEEN ?1 AND ?2 ORDER BY first_key",
                    )
                    .map_err(sql_error)?
                    .query_map([first, last], |r| {
                        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
                    })
                    .map_err(sql_error)?
                    .collect::<Result<_, _>>()
                    .map_err(sql_error)?;
                let in_msg = |k: i64| msgs.iter().any(|(m, e)| (*m..=*e).contains(&k));
                for (k, state, v) in &rows {
                    if !in_msg(*k) {
                        errs.push(format!("row {} outside any message", seq_of(*k)));
                    }
                    if *state == 1 && *k > p.claimed_to {
                        errs.push(format!(
                            "state-1 row {} above claimed_to {}",
                            seq_of(*k),
                            seq_of(p.claimed_to)
                        ));
                    }
                    if *state != 0 && *v != Some(p.hwm as i64) {
                        errs.push(format!(
                            "row {} claimed at {:?} != hwm {}",
                            seq_of(*k),
                            v,
                            p.hwm
                        ));
                    }
                }
                for k in &done {
                    if !in_msg(*k) {
                        errs.push(format!(
                            "done key {} outside any message (leaked)",
                            seq_of(*k)
                        ));
                    }
                    if rows.iter().any(|r| r.0 == *k) {
                        errs.push(format!("done key {} also has a row", seq_of(*k)));
                    }
                }
                let mut tally = vec![0i64; runs.len()];
                for (m, e) in &msgs {
                    let mut stored = 0;
                    for k in *m..=*e {
                        let has_row = rows.iter().any(|r| r.0 == k);
                        let is_done = done.contains(&k);
                        if has_row || !is_done {
                            stored += 1;
                        }
                        if has_row || is_done {
                            continue;
                        }
                        let holders: Vec<usize> = runs
                            .iter()
                            .enumerate()
                            .filter(|(_, r)| (r.0..=r.1).contains(&k))
                            .map(|(i, _)| i)
                            .collect();
                        for i in &holders {
                            tally[*i] += 1;
                        }
                        if k <= p.claimed_to && holders.len() != 1 {
                            errs.push(format!(
                                "fresh {} <= claimed_to {} in {} runs",
                                seq_of(k),
                                seq_of(p.claimed_to),
                                holders.len()
                            ));
                        }
                        if k > p.claimed_to && !holders.is_empty() {
                            errs.push(format!("fresh {} above claimed_to in a run", seq_of(k)));
                        }
                    }
                    if stored == 0 {
                        errs.push(format!("message {} holds no record (leaked)", seq_of(*m)));
                    }
                }
                for (i, r) in runs.iter().enumerate() {
                    if r.3 != tally[i] {
                        errs.push(format!(
                            "run {}..{} counts {} fresh, holds {}",
                            seq_of(r.0),
                            seq_of(r.1),
                            r.3,
                            tally[i]
                        ));
                    }
                    if r.3 <= 0 || tally[i] == 0 {
                        errs.push(format!(
                            "run {}..{} is empty but kept",
                            seq_of(r.0),
                            seq_of(r.1)
                        ));
                    }
                    if r.2 != p.hwm as i64 {
                        errs.push(format!(
                            "run {}..{} at version {} != hwm {}",
                            seq_of(r.0),
                            seq_of(r.1),
                            r.2,
                            p.hwm
                        ));
                    }
                    if r.1 > p.claimed_to {
                        errs.push(format!(
                            "run {}..{} above claimed_to",
                            seq_of(r.0),
                            seq_of(r.1)
                        ));
                    }
                    if i > 0 && runs[i - 1].1 >= r.0 {
                        errs.push("runs overlap".into());
                    }
                }
                Ok(errs)
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

/// The statistics of `partition` in the outbox file at `path`, read on a
/// read-only connection of its own: for tests that look at a running
/// agent's file without opening a store (and its writer) beside it.
#[cfg(any(test, feature = "conformance"))]
pub fn stats_of_file(path: &std::path::Path, partition: &str) -> StoreResult<OutboxStats> {
    let conn = Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
        .map_err(sql_error)?;
    conn.execute_batch("BEGIN").map_err(sql_error)?;
    stats(&conn, partition)
}

/// Column `i` of `r` as text, borrowed from the row.
fn text<'r>(r: &'r Row<'_>, i: usize) -> rusqlite::Result<&'r str> {
    r.get_ref(i)?.as_str().map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(i, rusqlite::types::Type::Text, e.into())
    })
}

/// Column `i` of `r` as a blob, borrowed from the row.
fn blob<'r>(r: &'r Row<'_>, i: usize) -> StoreResult<&'r [u8]> {
    r.get_ref(i)
        .map_err(sql_error)?
        .as_blob()
        .map_err(|e| StoreError::Corrupt(format!("outbox column {i}: {e}")))
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

/// Turns rows into records in seq order, each message's envelope read (or
/// taken from `read`, ascending by key) and decoded once and shared by its
/// records (invariant 4).
fn with_envelopes(
    conn: &Connection,
    partition: &str,
    rows: Vec<RawRecord>,
    mut read: Envelopes,
) -> StoreResult<Vec<OutboxRecord>> {
    let mut select = conn
        .prepare_cached("SELECT envelope FROM outbox_messages WHERE msg=?1")
        .map_err(sql_error)?;
    into_records(partition, rows, |msg| {
        if let Ok(i) = read.binary_search_by_key(&msg, |(m, _)| *m) {
            let bytes = std::mem::take(&mut read[i].1);
            if !bytes.is_empty() {
                return Ok(Some(bytes));
            }
        }
        select
            .query_row([msg], |r| r.get(0))
            .optional()
            .map_err(sql_error)
    })
}

/// A fresh record (invariant 7) as its message row holds it.
struct Fresh<'a> {
    key: i64,
    /// Its message's key.
    msg: i64,
    created_at: i64,
    expires_at: Option<i64>,
    entry: &'a Entry<'a>,
    /// The encoded envelope, when asked for.
    envelope: Option<&'a [u8]>,
}

impl Fresh<'_> {
    /// The record as a row would hold it, unclaimed.
    fn raw(&self, names: &mut Names) -> RawRecord {
        RawRecord {
            seq: seq_of(self.key),
            msg: self.msg,
            id: self.entry.id.to_owned(),
            binding: names.get(self.entry.binding),
            address: names.get(self.entry.address),
            created_at: self.created_at,
            expires_at: self.expires_at,
            claim_version: None,
            claim_owner: None,
            claimed_at: None,
            replay_count: 0,
            first_attempt_at: None,
            last_error: None,
        }
    }
}

/// Selects `$columns` of the messages whose ranges meet the keys
/// `?1..=?2` of the partition whose first key is `?3`, in key order: the one
/// holding `?1` (keyed at or below it) and those keyed up to `?2`.
macro_rules! messages_over {
    ($columns:literal) => {
        concat!(
            "SELECT ",
            $columns,
            " FROM outbox_messages WHERE msg BETWEEN IFNULL((SELECT msg FROM outbox_messages \
             WHERE msg BETWEEN ?3 AND ?1 ORDER BY msg DESC LIMIT 1), ?1) AND ?2 ORDER BY msg"
        )
    };
}

/// The keys of one table in a key range, in key order, read only as far as
/// asked: [`each_fresh`] passes over them beside the messages, so a call
/// that stops early reads no more of them than of the messages.
struct Keyed<'s> {
    rows: rusqlite::Rows<'s>,
    next: Option<i64>,
}

impl<'s> Keyed<'s> {
    fn new(mut rows: rusqlite::Rows<'s>) -> StoreResult<Self> {
        let next = Self::read(&mut rows)?;
        Ok(Keyed { rows, next })
    }

    fn read(rows: &mut rusqlite::Rows<'s>) -> StoreResult<Option<i64>> {
        rows.next()
            .map_err(sql_error)?
            .map(|row| row.get(0).map_err(sql_error))
            .transpose()
    }

    /// True when the table holds `key`; the keys below it are passed. Asked
    /// in ascending order.
    fn holds(&mut self, key: i64) -> StoreResult<bool> {
        while let Some(next) = self.next {
            if next >= key {
                return Ok(next == key);
            }
            self.next = Self::read(&mut self.rows)?;
        }
        Ok(false)
    }
}

/// Calls `each` with the fresh records of the keys `from..=to` in key
/// order, until it returns `false` (invariant 7); with their envelopes when
/// `envelopes` (read only then: a large one spills into overflow pages).
fn each_fresh(
    conn: &Connection,
    keys: Keys,
    (from, to): (i64, i64),
    envelopes: bool,
    mut each: impl FnMut(Fresh<'_>) -> StoreResult<bool>,
) -> StoreResult<()> {
    if from > to {
        return Ok(());
    }
    // Keys in a message's range but not fresh: those with a row, and those
    // completed (invariants 2 and 7).
    let mut with_row = conn
        .prepare_cached("SELECT key FROM outbox_records WHERE key BETWEEN ?1 AND ?2 ORDER BY key")
        .map_err(sql_error)?;
    let mut with_row = Keyed::new(with_row.query([from, to]).map_err(sql_error)?)?;
    let mut done = conn
        .prepare_cached("SELECT key FROM outbox_done WHERE key BETWEEN ?1 AND ?2 ORDER BY key")
        .map_err(sql_error)?;
    let mut done = Keyed::new(done.query([from, to]).map_err(sql_error)?)?;
    let sql = if envelopes {
        messages_over!("msg, last_seq, created_at_ns, expires_at_ns, records, envelope")
    } else {
        messages_over!("msg, last_seq, created_at_ns, expires_at_ns, records")
    };
    let mut stmt = conn.prepare_cached(sql).map_err(sql_error)?;
    let mut rows = stmt.query([from, to, keys.range().0]).map_err(sql_error)?;
    while let Some(row) = rows.next().map_err(sql_error)? {
        let msg: i64 = row.get(0).map_err(sql_error)?;
        let last = keys.of_row(row.get(1).map_err(sql_error)?);
        if last < from {
            continue;
        }
        let (created_at, expires_at) = (
            row.get(2).map_err(sql_error)?,
            row.get(3).map_err(sql_error)?,
        );
        let entries = record_list::decode(blob(row, 4)?, message_len(msg, last)?, msg)?;
        let envelope = envelopes.then(|| blob(row, 5)).transpose()?;
        for (key, entry) in (msg..).zip(&entries) {
            if key < from {
                continue;
            }
            if key > to {
                return Ok(());
            }
            if with_row.holds(key)? || done.holds(key)? {
                continue;
            }
            let fresh = Fresh {
                key,
                msg,
                created_at,
                expires_at,
                entry,
                envelope,
            };
            if !each(fresh)? {
                return Ok(());
            }
        }
    }
    Ok(())
}

/// The number of records of the message keyed `msg` whose last is `last`.
fn message_len(msg: i64, last: i64) -> StoreResult<usize> {
    usize::try_from(last - msg + 1)
        .map_err(|_| StoreError::Corrupt(format!("outbox message {msg} ends at key {last}")))
}

/// The fresh records of the keys `range`, at most `limit`, unclaimed.
fn fresh_in(
    conn: &Connection,
    keys: Keys,
    range: (i64, i64),
    limit: usize,
) -> StoreResult<Vec<RawRecord>> {
    Ok(fresh_with(conn, keys, range, limit, false)?.0)
}

/// Most records a read of fresh records makes room for before it finds them.
const PREALLOCATED_RECORDS: usize = 1024;

/// The encoded envelopes of the messages a call read already, by key, so
/// that [`with_envelopes`] need not read them again.
type Envelopes = Vec<(i64, Vec<u8>)>;

/// As [`fresh_in`], with the envelope of each message found when
/// `envelopes` (none otherwise).
fn fresh_with(
    conn: &Connection,
    keys: Keys,
    range: (i64, i64),
    limit: usize,
    envelopes: bool,
) -> StoreResult<(Vec<RawRecord>, Envelopes)> {
    let mut names = Names::default();
    // Sized once (up to a drain batch's worth): the records are large, and
    // growing the vector moved them again at every doubling. The range and
    // the limit only bound what is found.
    let room = usize::try_from(range.1.saturating_sub(range.0).saturating_add(1))
        .unwrap_or(0)
        .min(limit)
        .min(PREALLOCATED_RECORDS);
    let mut found = Vec::with_capacity(room);
    let mut read: Envelopes = Vec::with_capacity(if envelopes { room } else { 0 });
    each_fresh(conn, keys, range, envelopes, |r| {
        if found.len() >= limit {
            return Ok(false);
        }
        if let Some(envelope) = r.envelope
            && read.last().is_none_or(|(msg, _)| *msg != r.msg)
        {
            read.push((r.msg, envelope.to_vec()));
        }
        found.push(r.raw(&mut names));
        Ok(true)
    })?;
    Ok((found, read))
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
fn append_all(
    conn: &Connection,
    appends: Vec<Append>,
    undurable: &Undurable,
) -> StoreResult<Vec<StoreResult<Vec<u64>>>> {
    let mut partitions: Vec<Appending> = Vec::new();
    let mut results = Vec::with_capacity(appends.len());
    let mut insert = conn
        .prepare_cached(
            "INSERT INTO outbox_messages (msg, pid, first_seq, last_seq, created_at_ns, \
             expires_at_ns, records, envelope) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        )
        .map_err(sql_error)?;
    for (partition, message) in appends {
        let before = conn.total_changes();
        match append_one(
            conn,
            &mut insert,
            &mut partitions,
            partition,
            message,
            undurable,
        ) {
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

/// Writes one message of a batch: its message row, which holds its records
/// (invariant 7), at the seqs after the last its partition assigned.
fn append_one(
    conn: &Connection,
    insert: &mut CachedStatement<'_>,
    partitions: &mut Vec<Appending>,
    partition: String,
    message: NewMessage,
    undurable: &Undurable,
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
    let msg = keys.key(first).ok_or_else(|| seqs_used_up(&p.partition))?;
    insert
        .execute(params![
            msg,
            p.pid,
            to_i64(first)?,
            to_i64(last)?,
            created_at,
            expires_at,
            record_list::encode(&message.records),
            message.envelope.into_encoded()
        ])
        .map_err(sql_error)?;
    undurable.appended(p.pid, msg);
    p.last = last;
    Ok((first..=last).collect())
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
    /// The appends not yet durable (invariant 8).
    undurable: &'a Undurable,
}

/// The partition a claim or an expiry works on, past its fence.
struct Fenced {
    keys: Keys,
    /// The partition's `claimed_to` (invariant 6).
    claimed_to: i64,
}

/// Applies `version` to the partition's fence: `Stale` below the mark; above
/// it the mark rises and every older claim is pending again (invariant 3 of
/// the stores): rows claimed go back to state 0, and the runs of fresh
/// records are deleted with `claimed_to` set back to 0 (invariant 7 here).
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
        // claimed records are the runs and the rows in state 1 up to
        // `claimed_to`, and the indexed rows in state 2 (invariants 6, 7).
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
    // Pending since a release (or an older layout): a range scan of their
    // index.
    let pending = selected(
        conn,
        &format!(
            "SELECT {COLUMNS} FROM {PENDING} WHERE state=0 AND key BETWEEN ?1 AND ?2 \
             ORDER BY key LIMIT ?3"
        ),
        params![first, last, limit],
    )?;
    // Pending and fresh (invariant 7): the oldest above `claimed_to`, read
    // from their messages. They are taken as a prefix, so the run written
    // below holds every fresh record up to the new `claimed_to`. None above
    // the `limit`-th pending row can make the cut, so the scan stops there:
    // after a fence rise (`claimed_to` back to 0) over a backlog of released
    // records it would otherwise read the whole backlog on every claim.
    let upto = match pending.get(a.limit.saturating_sub(1)) {
        Some(row) if a.limit > 0 => keys.of_row(row.seq),
        _ => last,
    };
    // Nothing an append not yet durable wrote (invariant 8).
    let upto = a
        .undurable
        .claimable_to(keys.pid())
        .map_or(upto, |durable| upto.min(durable));
    // None when `claimed_to` is the last key there can be (`i64::MAX`).
    let (fresh, envelopes) = match fenced.claimed_to.max(first).checked_add(1) {
        Some(from) => fresh_with(conn, keys, (from, upto), a.limit, true)?,
        None => (Vec::new(), Vec::new()),
    };
    let fresh_seqs: Vec<i64> = fresh.iter().map(|r| r.seq).collect();
    let mut rows = fresh;
    rows.extend(pending);
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
    let mut from_stale_runs = Vec::new();
    for (run_first, run_last) in &stale_runs {
        let taken_back = fresh_in(conn, keys, (*run_first, *run_last), a.limit)?;
        from_stale_runs.extend(taken_back.iter().map(|r| r.seq));
        rows.extend(taken_back);
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
    stamp(&mut rows, &a, now)?;
    // `fresh_seqs` is ascending, and the fresh records taken are a prefix of
    // it: every candidate was merged in key order before the cut to
    // `limit`, so a fresh record is cut only with every higher one. They
    // get one run; those of stale runs a row each, and every other record
    // its own claim in its row.
    from_stale_runs.sort_unstable();
    let mut taken_fresh: Vec<i64> = Vec::new();
    let mut one_by_one: Vec<i64> = Vec::new();
    for row in &rows {
        if fresh_seqs.binary_search(&row.seq).is_ok() {
            taken_fresh.push(row.seq);
        } else if from_stale_runs.binary_search(&row.seq).is_ok() {
            insert_row(conn, keys, row, CLAIMED_BY_CLAIM)?;
        } else {
            one_by_one.push(row.seq);
        }
    }
    mark(
        conn,
        &a,
        now,
        CLAIMED_BY_CLAIM,
        one_by_one.into_iter().map(|seq| keys.of_row(seq)),
    )?;
    if let (Some(run_first), Some(run_last)) = (taken_fresh.first(), taken_fresh.last()) {
        conn.prepare_cached(
            "INSERT INTO outbox_claims (first_key, last_key, version, owner, claimed_at_ns, \
             fresh) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        )
        .map_err(sql_error)?
        .execute(params![
            keys.of_row(*run_first),
            keys.of_row(*run_last),
            to_i64(a.version)?,
            a.owner,
            now,
            sql_limit(taken_fresh.len())
        ])
        .map_err(sql_error)?;
    }
    for (run_first, run_last) in &stale_runs {
        // Their records taken back now have rows of their own.
        let left = from_stale_runs.iter().filter(|seq| {
            (*run_first..=*run_last).contains(&keys.of_row(**seq))
                && rows.binary_search_by_key(*seq, |r| r.seq).is_ok()
        });
        spend(conn, *run_first, sql_limit(left.count()))?;
    }
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
    with_envelopes(conn, a.partition, rows, envelopes)
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

/// Gives a fresh record its row, in `state` with the claim `row` carries
/// (invariant 7: *materialize*).
fn insert_row(conn: &Connection, keys: Keys, row: &RawRecord, state: i64) -> StoreResult<()> {
    conn.prepare_cached(
        "INSERT INTO outbox_records (key, msg, id, binding, address, created_at_ns, \
         expires_at_ns, state, claim_version, claim_owner, claimed_at_ns, replay_count) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, 0)",
    )
    .map_err(sql_error)?
    .execute(params![
        keys.of_row(row.seq),
        row.msg,
        row.id,
        &*row.binding,
        &*row.address,
        row.created_at,
        row.expires_at,
        state,
        row.claim_version,
        row.claim_owner,
        row.claimed_at,
    ])
    .map_err(sql_error)?;
    Ok(())
}

/// Claims the rows of `keys` (ascending) for `a.owner` under `a.version` at
/// `now`: one `UPDATE` per run of consecutive keys (the records released,
/// stale or taken by an expiry). Each record goes to `state`, but one in
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

/// Takes `n` fresh records off the count of the run starting at `run`, and
/// deletes the run when it holds none (invariant 7).
fn spend(conn: &Connection, run: i64, n: i64) -> StoreResult<()> {
    if n == 0 {
        return Ok(());
    }
    conn.prepare_cached("UPDATE outbox_claims SET fresh=fresh-?2 WHERE first_key=?1")
        .map_err(sql_error)?
        .execute(params![run, n])
        .map_err(sql_error)?;
    conn.prepare_cached("DELETE FROM outbox_claims WHERE first_key=?1 AND fresh<=0")
        .map_err(sql_error)?
        .execute([run])
        .map_err(sql_error)?;
    Ok(())
}

/// A run of fresh records claimed under one version, cut to a key range.
struct Span {
    /// The run's first key, which keys its row.
    run: i64,
    first: i64,
    last: i64,
    owner: String,
    claimed_at: i64,
}

impl Span {
    fn holds(&self, key: i64) -> bool {
        (self.first..=self.last).contains(&key)
    }
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
        let run: i64 = r.get(0)?;
        Ok(Span {
            run,
            first: run.max(first),
            last: r.get::<_, i64>(1)?.min(last),
            owner: r.get(2)?,
            claimed_at: r.get(3)?,
        })
    })
    .map_err(sql_error)?
    .collect::<Result<Vec<_>, _>>()
    .map_err(sql_error)
}

/// Gives the fresh records of the keys `runs` that runs of `version` claim
/// a row with that claim (state 1, invariant 7), so that what acts on
/// claimed records one by one finds them.
fn materialize(
    conn: &Connection,
    keys: Keys,
    runs: &[(i64, i64)],
    version: i64,
) -> StoreResult<()> {
    for (first, last) in runs {
        for span in spans(conn, keys, *first, *last, version)? {
            let mut rows = fresh_in(conn, keys, (span.first, span.last), usize::MAX)?;
            for row in &mut rows {
                row.state_claimed(version, &span.owner, span.claimed_at);
                insert_row(conn, keys, row, CLAIMED_BY_CLAIM)?;
            }
            spend(conn, span.run, sql_limit(rows.len()))?;
        }
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
/// seq, once the fresh ones among them have rows of their own
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
    let mut done = Vec::new();
    // No record has a seq without a key. A batch is mostly one run of
    // consecutive seqs, and its statements go per run, not per seq.
    let stored = distinct(seqs).into_iter().filter_map(|seq| keys.key(seq));
    for (first, last) in runs(stored) {
        complete_run(conn, keys, version, (first, last), p.claimed_to, &mut done)?;
    }
    done.sort_unstable();
    Ok(done)
}

/// Completes the records of the keys `first..=last` claimed under
/// `version`, pushing their seqs to `done`: deletes their rows, counts the
/// fresh ones off their runs, and deletes each message left without a
/// record or marks them completed in `outbox_done` (invariant 2).
fn complete_run(
    conn: &Connection,
    keys: Keys,
    version: i64,
    (first, last): (i64, i64),
    claimed_to: i64,
    done: &mut Vec<u64>,
) -> StoreResult<()> {
    // The messages of the run, and what their whole ranges hold: rows,
    // completed keys, and fresh records (the rest).
    let mut messages: Vec<(i64, i64)> = Vec::new();
    {
        let mut stmt = conn
            .prepare_cached(messages_over!("msg, last_seq"))
            .map_err(sql_error)?;
        let mut rows = stmt
            .query([first, last, keys.range().0])
            .map_err(sql_error)?;
        while let Some(row) = rows.next().map_err(sql_error)? {
            let msg: i64 = row.get(0).map_err(sql_error)?;
            let end = keys.of_row(row.get(1).map_err(sql_error)?);
            if end >= first {
                messages.push((msg, end));
            }
        }
    }
    let (Some(&(low, _)), Some(&(_, high))) = (messages.first(), messages.last()) else {
        return Ok(());
    };
    let rows: Vec<(i64, i64, Option<i64>)> = conn
        .prepare_cached(
            "SELECT key, state, claim_version FROM outbox_records WHERE key BETWEEN ?1 AND ?2",
        )
        .map_err(sql_error)?
        .query_map([low, high], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .map_err(sql_error)?
        .collect::<Result<_, _>>()
        .map_err(sql_error)?;
    let completed: Vec<i64> = conn
        .prepare_cached("SELECT key FROM outbox_done WHERE key BETWEEN ?1 AND ?2")
        .map_err(sql_error)?
        .query_map([low, high], |r| r.get(0))
        .map_err(sql_error)?
        .collect::<Result<_, _>>()
        .map_err(sql_error)?;
    let spans = if first <= claimed_to {
        spans(conn, keys, first, last.min(claimed_to), version)?
    } else {
        Vec::new()
    };
    let mut spent = vec![0i64; spans.len()];
    let mut any_row = false;
    let mut mark_done = conn
        .prepare_cached("INSERT INTO outbox_done (key) VALUES (?1)")
        .map_err(sql_error)?;
    for (msg, end) in messages {
        let mut now_done = Vec::new();
        let mut left = false;
        for key in msg..=end {
            let asked = (first..=last).contains(&key);
            if let Ok(i) = rows.binary_search_by_key(&key, |r| r.0) {
                let (_, state, claim_version) = rows[i];
                let claimed = matches!(state, CLAIMED_BY_CLAIM | CLAIMED_BY_EXPIRE)
                    && claim_version == Some(version);
                if asked && claimed {
                    any_row = true;
                    now_done.push(key);
                } else {
                    left = true;
                }
            } else if completed.binary_search(&key).is_ok() {
                // Completed before.
            } else if let Some(s) = spans.iter().position(|s| asked && s.holds(key)) {
                spent[s] += 1;
                now_done.push(key);
            } else {
                left = true;
            }
        }
        if left {
            for key in &now_done {
                mark_done.execute([key]).map_err(sql_error)?;
            }
        } else {
            conn.prepare_cached("DELETE FROM outbox_messages WHERE msg=?1")
                .map_err(sql_error)?
                .execute([msg])
                .map_err(sql_error)?;
            if completed.iter().any(|k| (msg..=end).contains(k)) {
                conn.prepare_cached("DELETE FROM outbox_done WHERE key BETWEEN ?1 AND ?2")
                    .map_err(sql_error)?
                    .execute([msg, end])
                    .map_err(sql_error)?;
            }
        }
        for key in now_done {
            done.push(to_u64(seq_of(key))?);
        }
    }
    if any_row {
        conn.prepare_cached(
            "DELETE FROM outbox_records WHERE key BETWEEN ?1 AND ?2 AND state IN (1, 2) \
             AND claim_version=?3",
        )
        .map_err(sql_error)?
        .execute(params![first, last, version])
        .map_err(sql_error)?;
    }
    for (span, n) in spans.iter().zip(spent) {
        spend(conn, span.run, n)?;
    }
    Ok(())
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
    let keys = fenced.keys;
    let now = unix_nanos(a.now)?;
    // Pending rows past their expiry. The index is on the expression `key
    // >> 40` (the partition's `pid`), which the query must spell the same
    // way.
    let mut rows = selected(
        conn,
        &format!(
            "SELECT {COLUMNS} FROM outbox_records INDEXED BY outbox_records_expiry \
             WHERE key >> {SEQ_BITS} = ?1 AND state=0 \
             AND expires_at_ns IS NOT NULL AND expires_at_ns<=?3 ORDER BY key LIMIT ?2"
        ),
        params![keys.pid(), sql_limit(a.limit), now],
    )?;
    // Fresh and pending (above `claimed_to`, invariant 7) in messages past
    // their expiry, the oldest `limit`.
    let expired: Vec<(i64, i64)> = conn
        .prepare_cached(
            "SELECT msg, last_seq FROM outbox_messages INDEXED BY outbox_messages_expiry \
             WHERE pid=?1 AND expires_at_ns IS NOT NULL AND expires_at_ns<=?2 ORDER BY msg",
        )
        .map_err(sql_error)?
        .query_map(params![keys.pid(), now], |r| Ok((r.get(0)?, r.get(1)?)))
        .map_err(sql_error)?
        .collect::<Result<_, _>>()
        .map_err(sql_error)?;
    let mut fresh: Vec<RawRecord> = Vec::new();
    let durable_to = a.undurable.claimable_to(keys.pid());
    for (msg, last_seq) in expired {
        // Nothing an append not yet durable wrote (invariant 8).
        let end = durable_to.map_or(keys.of_row(last_seq), |d| keys.of_row(last_seq).min(d));
        if end > fenced.claimed_to && fresh.len() < a.limit {
            let from = msg.max(fenced.claimed_to + 1);
            fresh.extend(fresh_in(conn, keys, (from, end), a.limit - fresh.len())?);
        }
    }
    let fresh_seqs: Vec<i64> = fresh.iter().map(|r| r.seq).collect();
    rows.extend(fresh);
    rows.sort_unstable_by_key(|r| r.seq);
    rows.truncate(a.limit);
    stamp(&mut rows, &a, now)?;
    // A fresh record gets a row, in state 2 (invariant 7); a pending row
    // moves there.
    let mut in_rows = Vec::new();
    for row in &rows {
        // Ascending: found message by message in key order.
        if fresh_seqs.binary_search(&row.seq).is_ok() {
            insert_row(conn, keys, row, CLAIMED_BY_EXPIRE)?;
        } else {
            in_rows.push(keys.of_row(row.seq));
        }
    }
    mark(conn, &a, now, CLAIMED_BY_EXPIRE, in_rows)?;
    with_envelopes(conn, a.partition, rows, Vec::new())
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
    let mut groups: Vec<Group> = Vec::new();
    let mut count = |binding: &str, claimed: bool, created_at: i64| match groups
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
    };
    let keys = Keys::of(p.pid)?;
    let (first, last) = keys.range();
    {
        let mut stmt = conn
            .prepare_cached(
                "SELECT binding, state, created_at_ns FROM outbox_records \
                 WHERE key BETWEEN ?1 AND ?2",
            )
            .map_err(sql_error)?;
        let mut rows = stmt.query([first, last]).map_err(sql_error)?;
        while let Some(row) = rows.next().map_err(sql_error)? {
            let binding = text(row, 0).map_err(sql_error)?;
            let claimed = row.get::<_, i64>(1).map_err(sql_error)? != 0;
            count(binding, claimed, row.get(2).map_err(sql_error)?);
        }
    }
    // Invariant 7: a fresh record is claimed at or below `claimed_to`.
    each_fresh(conn, keys, (first, last), false, |r| {
        count(r.entry.binding, r.key <= p.claimed_to, r.created_at);
        Ok(true)
    })?;
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

/// Copies layout 5's messages (`outbox_messages_v5`) into layout 6's table:
/// each under its first record's key, with its records' ids, bindings,
/// addresses and times from their rows; a key without a row (a record
/// completed while its message lived on) goes to `outbox_done`. Rows keep
/// their state and point at the new key. Messages without a row are not
/// copied (the migration then refuses).
pub(super) fn copy_v5_messages(conn: &Connection) -> StoreResult<()> {
    let mut messages = conn
        .prepare(
            "SELECT pid, first_seq, last_seq, envelope FROM outbox_messages_v5 \
             ORDER BY pid, first_seq",
        )
        .map_err(sql_error)?;
    let mut rows = messages.query([]).map_err(sql_error)?;
    let mut records = conn
        .prepare(
            "SELECT key, id, binding, address, created_at_ns, expires_at_ns FROM outbox_records \
             WHERE key BETWEEN ?1 AND ?2 ORDER BY key",
        )
        .map_err(sql_error)?;
    while let Some(row) = rows.next().map_err(sql_error)? {
        let keys = Keys::of(row.get(0).map_err(sql_error)?)?;
        let (first_seq, last_seq): (i64, i64) = (
            row.get(1).map_err(sql_error)?,
            row.get(2).map_err(sql_error)?,
        );
        let (msg, end) = (keys.of_row(first_seq), keys.of_row(last_seq));
        type Stored = (i64, String, String, String, i64, Option<i64>);
        let stored: Vec<Stored> = records
            .query_map([msg, end], |r| {
                Ok((
                    r.get(0)?,
                    r.get(1)?,
                    r.get(2)?,
                    r.get(3)?,
                    r.get(4)?,
                    r.get(5)?,
                ))
            })
            .map_err(sql_error)?
            .collect::<Result<_, _>>()
            .map_err(sql_error)?;
        let Some((_, _, _, _, created_at, expires_at)) = stored.first().cloned() else {
            continue;
        };
        let mut list = Vec::with_capacity(message_len(msg, end)?);
        for key in msg..=end {
            match stored.iter().find(|s| s.0 == key) {
                Some((_, id, binding, address, ..)) => list.push(crate::stores::NewRecord {
                    id: id.clone(),
                    binding: binding.as_str().into(),
                    address: address.as_str().into(),
                }),
                None => {
                    list.push(crate::stores::NewRecord {
                        id: String::new(),
                        binding: "".into(),
                        address: "".into(),
                    });
                    conn.prepare_cached("INSERT INTO outbox_done (key) VALUES (?1)")
                        .map_err(sql_error)?
                        .execute([key])
                        .map_err(sql_error)?;
                }
            }
        }
        conn.execute(
            "INSERT INTO outbox_messages (msg, pid, first_seq, last_seq, created_at_ns, \
             expires_at_ns, records, envelope) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            params![
                msg,
                keys.pid(),
                first_seq,
                last_seq,
                created_at,
                expires_at,
                record_list::encode(&list),
                blob(row, 3)?
            ],
        )
        .map_err(sql_error)?;
        conn.execute(
            "UPDATE outbox_records SET msg=?1 WHERE key BETWEEN ?1 AND ?2",
            [msg, end],
        )
        .map_err(sql_error)?;
    }
    Ok(())
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
        let undurable = Arc::clone(&self.undurable);
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
                    undurable: &undurable,
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
        let undurable = Arc::clone(&self.undurable);
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
                    undurable: &undurable,
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

    /// Invariant 8: a claim or an expiry takes no fresh record whose append's
    /// group is not yet durable, and takes it once it is. The durability is
    /// driven by hand here, on a connection of the test's own; the store's
    /// syncer is what drives it in use.
    #[tokio::test]
    async fn claims_and_expiries_take_only_what_durable_appends_wrote() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let (store, options) = opened(&dir).await;
        // Durable: appended through the store, which answered it.
        assert_eq!(
            store.append("p", message(&["x", "y"])).await,
            Ok(vec![1, 2])
        );
        store.close().await;
        let conn = Connection::open(&options.path).expect("open the file");
        let durability = Durability::new(true);
        let undurable = Undurable::new(Arc::clone(&durability));
        let group = durability.begin_group();
        let expiring = NewMessage {
            expires_at: Some(t(2)),
            ..message(&["x", "y"])
        };
        let appended =
            append_all(&conn, vec![("p".to_owned(), expiring)], &undurable).expect("appended");
        assert_eq!(appended, vec![Ok(vec![3, 4])]);
        let args = |now| ClaimArgs {
            partition: "p",
            owner: "o",
            version: 1,
            limit: 10,
            now,
            stale_after: Duration::from_secs(60),
            undurable: &undurable,
        };
        let seqs = |records: Vec<OutboxRecord>| records.iter().map(|r| r.seq).collect::<Vec<_>>();

        assert_eq!(
            expire(&conn, args(t(3))).map(seqs),
            Ok(vec![]),
            "not durable"
        );
        assert_eq!(
            claim(&conn, args(t(1))).map(seqs),
            Ok(vec![1, 2]),
            "not durable"
        );
        durability.synced_to(group);
        assert_eq!(
            expire(&conn, args(t(3))).map(seqs),
            Ok(vec![3, 4]),
            "durable"
        );
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

    /// What the file holds for a partition: `(seq, state)` of each record
    /// row, the seqs in `outbox_done`, and `(first seq, last seq, version,
    /// fresh)` of each run.
    #[derive(Debug, PartialEq, Eq)]
    struct Layout {
        rows: Vec<(i64, i64)>,
        done: Vec<i64>,
        runs: Vec<(i64, i64, i64, i64)>,
    }

    fn layout(options: &SqliteOptions) -> Layout {
        let conn = Connection::open(&options.path).expect("open the file");
        let seq = MAX_SEQ as i64;
        let rows = conn
            .prepare("SELECT key & ?1, state FROM outbox_records ORDER BY key")
            .expect("prepare")
            .query_map([seq], |r| Ok((r.get(0)?, r.get(1)?)))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows");
        let done = conn
            .prepare("SELECT key & ?1 FROM outbox_done ORDER BY key")
            .expect("prepare")
            .query_map([seq], |r| r.get(0))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows");
        let runs = conn
            .prepare("SELECT first_key & ?1, last_key & ?1, version, fresh FROM outbox_claims")
            .expect("prepare")
            .query_map([seq], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows");
        Layout { rows, done, runs }
    }

    fn seqs(records: &[OutboxRecord]) -> Vec<u64> {
        records.iter().map(|r| r.seq).collect()
    }

    /// Invariant 7: an append writes no record row; a claim of fresh records
    /// writes one run row; a release gives a record a row of its own; the
    /// run goes with its last fresh record; a newer version voids the run.
    #[tokio::test]
    async fn a_fresh_record_has_no_row_and_a_claim_of_fresh_records_writes_one_run() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let (store, options) = opened(&dir).await;
        for _ in 0..5 {
            store.append("p", message(&["x"])).await.expect("append");
        }
        let empty = Layout {
            rows: vec![],
            done: vec![],
            runs: vec![],
        };
        assert_eq!(layout(&options), empty, "no record row");
        let claimed = store.claim("p", "o", 1, 3, t(2)).await.expect("claim");
        assert_eq!(seqs(&claimed), [1, 2, 3]);
        assert!(
            claimed
                .iter()
                .all(|r| r.claim.as_ref().is_some_and(|c| c.version == 1))
        );
        assert_eq!(layout(&options).runs, vec![(1, 3, 1, 3)]);

        let untried = Release::Untried;
        assert_eq!(store.release("p", 1, &[2], untried).await, Ok(vec![2]));
        assert_eq!(store.complete("p", 1, &[1]).await, Ok(vec![1]));
        assert_eq!(
            layout(&options),
            Layout {
                rows: vec![(2, 0)],
                done: vec![],
                runs: vec![(1, 3, 1, 1)],
            },
            "seq 2 pending in its row; seq 3 still claimed by the run"
        );
        // Seq 3 is claimed: the next claim takes 2, then fresh 4 and 5.
        let again = store.claim("p", "o", 1, 10, t(3)).await.expect("claim");
        assert_eq!(seqs(&again), [2, 4, 5]);
        assert_eq!(store.complete("p", 1, &[3]).await, Ok(vec![3]));
        assert_eq!(
            layout(&options),
            Layout {
                rows: vec![(2, 1)],
                done: vec![],
                runs: vec![(4, 5, 1, 2)],
            },
            "the first run went with seq 3"
        );

        // A newer version: the run is void and its records pending again.
        let taken = store.claim("p", "n", 2, 10, t(4)).await.expect("claim");
        assert_eq!(seqs(&taken), [2, 4, 5]);
        assert_eq!(store.complete("p", 1, &[2, 4, 5]).await.ok(), None);
        assert_eq!(store.complete("p", 2, &[2, 4, 5]).await, Ok(vec![2, 4, 5]));
        assert_eq!(layout(&options), empty);
        assert_eq!(store.envelopes("p").await, Ok(0));
    }

    /// Invariant 2: a record completed while its message holds others is
    /// kept in `outbox_done`, so it is neither claimed nor counted again;
    /// the last record takes the message and those marks with it.
    #[tokio::test]
    async fn a_record_completed_before_the_rest_of_its_message_stays_completed() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let (store, options) = opened(&dir).await;
        store
            .append("p", message(&["x", "y", "z"]))
            .await
            .expect("append");
        let claimed = store.claim("p", "o", 1, 10, t(2)).await.expect("claim");
        assert_eq!(seqs(&claimed), [1, 2, 3]);
        assert_eq!(store.complete("p", 1, &[2]).await, Ok(vec![2]));
        assert_eq!(store.complete("p", 1, &[2]).await, Ok(vec![]), "once");
        let failed = Release::Failed {
            error: "e".into(),
            attempted_at: t(3),
        };
        assert_eq!(store.release("p", 1, &[3], failed).await, Ok(vec![3]));
        assert_eq!(
            layout(&options),
            Layout {
                rows: vec![(3, 0)],
                done: vec![2],
                runs: vec![(1, 3, 1, 1)],
            }
        );
        let stats = store.stats("p").await.expect("stats");
        assert_eq!((stats.total.depth, stats.total.claimed), (2, 1));
        // A newer version makes seq 1 pending again, but not seq 2.
        let again = store.claim("p", "n", 2, 10, t(4)).await.expect("claim");
        assert_eq!(seqs(&again), [1, 3]);
        assert_eq!(store.complete("p", 2, &[1, 3]).await, Ok(vec![1, 3]));
        assert_eq!(
            layout(&options),
            Layout {
                rows: vec![],
                done: vec![],
                runs: vec![],
            }
        );
        assert_eq!(store.envelopes("p").await, Ok(0));
    }

    /// Invariant 7: a stale run taken back in parts (the claim's `limit`)
    /// counts down by what each claim took, and goes with its last record.
    #[tokio::test]
    async fn a_stale_run_taken_back_in_parts_counts_down_and_goes() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let (store, options) = opened(&dir).await;
        for _ in 0..3 {
            store.append("p", message(&["x"])).await.expect("append");
        }
        let claimed = store.claim("p", "o", 1, 10, t(2)).await.expect("claim");
        assert_eq!(seqs(&claimed), [1, 2, 3]);
        assert_eq!(layout(&options).runs, vec![(1, 3, 1, 3)]);
        let stale = t(2) + crate::stores::conformance::STALE;
        let back = store.claim("p", "o", 1, 2, stale).await.expect("claim");
        assert_eq!(seqs(&back), [1, 2]);
        assert_eq!(
            layout(&options),
            Layout {
                rows: vec![(1, 1), (2, 1)],
                done: vec![],
                runs: vec![(1, 3, 1, 1)],
            }
        );
        let back = store.claim("p", "o", 1, 2, stale).await.expect("claim");
        assert_eq!(seqs(&back), [3]);
        assert_eq!(layout(&options).runs, vec![], "the run went with seq 3");
        assert_eq!(store.complete("p", 1, &[1, 2, 3]).await, Ok(vec![1, 2, 3]));
        assert_eq!(store.envelopes("p").await, Ok(0));
    }
}
