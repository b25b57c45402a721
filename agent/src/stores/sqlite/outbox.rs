//! The SQLite outbox. Every operation but `stats` is one job of the writer
//! (so it is atomic and, when answered, committed); `stats` reads on the
//! read connection. Only `append` waits for an fsync: a claim, completion,
//! release or expiry lost to a power cut makes a record pending again, so it
//! is sent once more — at-least-once holds — while an acknowledged append
//! lost would be a message lost.

use std::time::{Duration, SystemTime};

use ferry_shared::envelope::Envelope;
use rusqlite::{Connection, OptionalExtension, Row, params};

use super::{Db, SqliteOptions, schema, sql_error, to_i64, to_u64};
use crate::stores::outbox::{stale, validate_append};
use crate::stores::{
    BindingStats, BoxFuture, Claim, NewRecord, OutboxRecord, OutboxStats, OutboxStore, Release,
    StoreError, StoreResult, from_unix_nanos, unix_nanos,
};

const COLUMNS: &str = "partition, seq, id, binding, address, envelope, created_at_ns, \
    expires_at_ns, claim_version, claim_owner, claimed_at_ns, replay_count, \
    first_attempt_at_ns, last_error";

/// An outbox in a SQLite database.
pub struct SqliteOutboxStore {
    db: Db,
    options: SqliteOptions,
}

impl SqliteOutboxStore {
    /// Opens the outbox at `options.path`, creating the file and tables if
    /// needed.
    pub async fn open(options: SqliteOptions) -> StoreResult<Self> {
        let db = Db::open(options.clone(), "outbox", schema::outbox).await?;
        Ok(SqliteOutboxStore { db, options })
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

    #[cfg(test)]
    pub(crate) async fn dump(&self, partition: &str) -> StoreResult<Vec<OutboxRecord>> {
        let partition = partition.to_owned();
        self.db
            .read(move |conn| {
                let sql =
                    format!("SELECT {COLUMNS} FROM outbox_records WHERE partition=?1 ORDER BY seq");
                let mut stmt = conn.prepare(&sql).map_err(sql_error)?;
                let rows = stmt
                    .query_map([&partition], raw_record)
                    .map_err(sql_error)?;
                rows.map(|r| r.map_err(sql_error)?.into_record()).collect()
            })
            .await
    }
}

/// A row as stored, before its envelope and times are decoded.
struct RawRecord {
    partition: String,
    seq: i64,
    id: String,
    binding: String,
    address: String,
    envelope: Vec<u8>,
    created_at: i64,
    expires_at: Option<i64>,
    claim_version: Option<i64>,
    claim_owner: Option<String>,
    claimed_at: Option<i64>,
    replay_count: i64,
    first_attempt_at: Option<i64>,
    last_error: Option<String>,
}

fn raw_record(r: &Row<'_>) -> rusqlite::Result<RawRecord> {
    Ok(RawRecord {
        partition: r.get(0)?,
        seq: r.get(1)?,
        id: r.get(2)?,
        binding: r.get(3)?,
        address: r.get(4)?,
        envelope: r.get(5)?,
        created_at: r.get(6)?,
        expires_at: r.get(7)?,
        claim_version: r.get(8)?,
        claim_owner: r.get(9)?,
        claimed_at: r.get(10)?,
        replay_count: r.get(11)?,
        first_attempt_at: r.get(12)?,
        last_error: r.get(13)?,
    })
}

impl RawRecord {
    fn into_record(self) -> StoreResult<OutboxRecord> {
        let envelope = Envelope::decode(&self.envelope).map_err(|e| {
            StoreError::Corrupt(format!(
                "outbox record {}/{}: {e}",
                self.partition, self.seq
            ))
        })?;
        let claim = match (self.claim_version, self.claim_owner, self.claimed_at) {
            (Some(version), Some(owner), Some(at)) => Some(Claim {
                version: to_u64(version)?,
                owner,
                claimed_at: from_unix_nanos(at)?,
            }),
            _ => None,
        };
        Ok(OutboxRecord {
            seq: to_u64(self.seq)?,
            partition: self.partition,
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

/// The partition's (hwm, last_seq), if it exists.
fn partition_row(conn: &Connection, partition: &str) -> StoreResult<Option<(u64, u64)>> {
    conn.prepare_cached("SELECT hwm, last_seq FROM outbox_partitions WHERE partition=?1")
        .map_err(sql_error)?
        .query_row([partition], |r| {
            Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?))
        })
        .optional()
        .map_err(sql_error)?
        .map(|(h, s)| Ok((to_u64(h)?, to_u64(s)?)))
        .transpose()
}

/// The high-water mark, failing when `version` is below it; `None` for a
/// partition never written.
fn fence(conn: &Connection, partition: &str, version: u64) -> StoreResult<Option<u64>> {
    match partition_row(conn, partition)? {
        Some((hwm, _)) if version < hwm => Err(stale(partition, version, hwm)),
        Some((hwm, _)) => Ok(Some(hwm)),
        None => Ok(None),
    }
}

fn sql_limit(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

fn append(conn: &Connection, partition: &str, records: Vec<NewRecord>) -> StoreResult<Vec<u64>> {
    validate_append(partition, &records)?;
    let mut last_seq = match partition_row(conn, partition)? {
        Some((_, last)) => last,
        None => {
            conn.execute(
                "INSERT INTO outbox_partitions (partition, hwm, last_seq) VALUES (?1, 0, 0)",
                [partition],
            )
            .map_err(sql_error)?;
            0
        }
    };
    let mut insert = conn
        .prepare_cached(
            "INSERT INTO outbox_records (partition, seq, id, binding, address, envelope, \
             created_at_ns, expires_at_ns, state, replay_count) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, 0, 0)",
        )
        .map_err(sql_error)?;
    let mut seqs = Vec::with_capacity(records.len());
    for r in records {
        last_seq += 1;
        let expires_at = r.expires_at.map(unix_nanos).transpose()?;
        insert
            .execute(params![
                partition,
                to_i64(last_seq)?,
                r.id,
                r.binding,
                r.address,
                r.envelope.encode(),
                unix_nanos(r.created_at)?,
                expires_at,
            ])
            .map_err(sql_error)?;
        seqs.push(last_seq);
    }
    conn.prepare_cached("UPDATE outbox_partitions SET last_seq=?2 WHERE partition=?1")
        .map_err(sql_error)?
        .execute(params![partition, to_i64(last_seq)?])
        .map_err(sql_error)?;
    Ok(seqs)
}

struct ClaimArgs<'a> {
    partition: &'a str,
    owner: &'a str,
    version: u64,
    limit: usize,
    now: SystemTime,
    stale_after: Duration,
}

/// Applies `version` to the partition's fence: `Stale` below the mark; above
/// it the mark rises and every older claim is pending again (invariant 3).
fn advance_fence(conn: &Connection, partition: &str, version: u64) -> StoreResult<()> {
    let v = to_i64(version)?;
    match fence(conn, partition, version)? {
        None => {
            conn.execute(
                "INSERT INTO outbox_partitions (partition, hwm, last_seq) VALUES (?1, ?2, 0)",
                params![partition, v],
            )
            .map_err(sql_error)?;
        }
        Some(hwm) if version > hwm => {
            // A newer lease: every claim of an older one is void at once.
            conn.execute(
                "UPDATE outbox_partitions SET hwm=?2 WHERE partition=?1",
                params![partition, v],
            )
            .map_err(sql_error)?;
            conn.prepare_cached(
                "UPDATE outbox_records SET state=0, claim_version=NULL, claim_owner=NULL, \
                 claimed_at_ns=NULL WHERE partition=?1 AND state=1 AND claim_version<?2",
            )
            .map_err(sql_error)?
            .execute(params![partition, v])
            .map_err(sql_error)?;
        }
        Some(_) => {}
    }
    Ok(())
}

fn claim(conn: &Connection, a: ClaimArgs<'_>) -> StoreResult<Vec<OutboxRecord>> {
    advance_fence(conn, a.partition, a.version)?;
    let now = unix_nanos(a.now)?;
    let stale_ns = i64::try_from(a.stale_after.as_nanos()).unwrap_or(i64::MAX);
    // One statement: the oldest `limit` of the pending records and of this
    // owner's claims old enough to be taken back (two range scans on the
    // (partition, state, seq) index, merged), marked and returned.
    let sql = format!(
        "UPDATE outbox_records SET state=1, claim_version=?3, claim_owner=?4, claimed_at_ns=?5 \
         WHERE partition=?1 AND seq IN ( \
           SELECT seq FROM (SELECT seq FROM outbox_records WHERE partition=?1 AND state=0 \
                            ORDER BY seq LIMIT ?2) \
           UNION ALL \
           SELECT seq FROM (SELECT seq FROM outbox_records WHERE partition=?1 AND state=1 \
                            AND claim_owner=?4 AND claimed_at_ns<=?6 ORDER BY seq LIMIT ?2) \
           ORDER BY seq LIMIT ?2) \
         RETURNING {COLUMNS}"
    );
    let args = params![
        a.partition,
        sql_limit(a.limit),
        to_i64(a.version)?,
        a.owner,
        now,
        now.saturating_sub(stale_ns),
    ];
    marked(conn, &sql, args)
}

/// Runs an `UPDATE … RETURNING {COLUMNS}` and returns the records it marked
/// in `seq` order (`RETURNING` promises no order).
fn marked(
    conn: &Connection,
    sql: &str,
    args: impl rusqlite::Params,
) -> StoreResult<Vec<OutboxRecord>> {
    let mut stmt = conn.prepare_cached(sql).map_err(sql_error)?;
    let rows = stmt.query_map(args, raw_record).map_err(sql_error)?;
    let mut out = rows
        .map(|r| r.map_err(sql_error)?.into_record())
        .collect::<StoreResult<Vec<_>>>()?;
    out.sort_unstable_by_key(|r| r.seq);
    Ok(out)
}

/// Runs `stmt` (parameters: partition, seq, version) for each distinct seq
/// and returns those it changed.
fn per_claimed(
    conn: &Connection,
    partition: &str,
    version: u64,
    seqs: &[u64],
    stmt: &str,
    extra: &[&dyn rusqlite::ToSql],
) -> StoreResult<Vec<u64>> {
    if fence(conn, partition, version)?.is_none() {
        return Ok(Vec::new());
    }
    let version = to_i64(version)?;
    let mut seqs = seqs.to_vec();
    seqs.sort_unstable();
    seqs.dedup();
    let mut stmt = conn.prepare_cached(stmt).map_err(sql_error)?;
    let mut done = Vec::new();
    for seq in seqs {
        let seq_i = to_i64(seq)?;
        let mut args: Vec<&dyn rusqlite::ToSql> = vec![&partition, &seq_i, &version];
        args.extend_from_slice(extra);
        if stmt.execute(args.as_slice()).map_err(sql_error)? == 1 {
            done.push(seq);
        }
    }
    Ok(done)
}

fn complete(
    conn: &Connection,
    partition: &str,
    version: u64,
    seqs: &[u64],
) -> StoreResult<Vec<u64>> {
    per_claimed(
        conn,
        partition,
        version,
        seqs,
        "DELETE FROM outbox_records WHERE partition=?1 AND seq=?2 AND state=1 AND claim_version=?3",
        &[],
    )
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
    const CLAIMED: &str = "WHERE partition=?1 AND seq=?2 AND state=1 AND claim_version=?3";
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
                     first_attempt_at_ns=COALESCE(first_attempt_at_ns, ?4), last_error=?5 {CLAIMED}"
                ),
                &[&at, &error],
            )
        }
    }
}

fn expire(conn: &Connection, a: ClaimArgs<'_>) -> StoreResult<Vec<OutboxRecord>> {
    advance_fence(conn, a.partition, a.version)?;
    let now = unix_nanos(a.now)?;
    let sql = format!(
        "UPDATE outbox_records SET state=1, claim_version=?3, claim_owner=?4, claimed_at_ns=?5 \
         WHERE partition=?1 AND seq IN ( \
           SELECT seq FROM outbox_records WHERE partition=?1 AND state=0 \
           AND expires_at_ns IS NOT NULL AND expires_at_ns<=?5 ORDER BY seq LIMIT ?2) \
         RETURNING {COLUMNS}"
    );
    let args = params![
        a.partition,
        sql_limit(a.limit),
        to_i64(a.version)?,
        a.owner,
        now
    ];
    marked(conn, &sql, args)
}

fn stats(conn: &Connection, partition: &str) -> StoreResult<OutboxStats> {
    let mut stats = OutboxStats {
        high_water_mark: partition_row(conn, partition)?.map_or(0, |(hwm, _)| hwm),
        ..OutboxStats::default()
    };
    let mut stmt = conn
        .prepare_cached(
            "SELECT binding, state, COUNT(*), MIN(created_at_ns) FROM outbox_records \
             WHERE partition=?1 GROUP BY binding, state",
        )
        .map_err(sql_error)?;
    let rows = stmt
        .query_map([partition], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, i64>(3)?,
            ))
        })
        .map_err(sql_error)?;
    for row in rows {
        let (binding, state, count, oldest) = row.map_err(sql_error)?;
        let count = to_u64(count)?;
        let oldest = from_unix_nanos(oldest)?;
        for s in [&mut stats.total, stats.bindings.entry(binding).or_default()] {
            merge(s, state == 1, count, oldest);
        }
    }
    Ok(stats)
}

fn merge(s: &mut BindingStats, claimed: bool, count: u64, oldest: SystemTime) {
    s.depth += count;
    if claimed {
        s.claimed += count;
    } else {
        s.oldest_pending_created_at = Some(
            s.oldest_pending_created_at
                .map_or(oldest, |t| t.min(oldest)),
        );
    }
}

impl OutboxStore for SqliteOutboxStore {
    fn append<'a>(
        &'a self,
        partition: &'a str,
        records: Vec<NewRecord>,
    ) -> BoxFuture<'a, StoreResult<Vec<u64>>> {
        let partition = partition.to_owned();
        Box::pin(self.db.write(move |c| append(c, &partition, records)))
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
