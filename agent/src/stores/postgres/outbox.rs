//! The PostgreSQL outbox: one message row and one narrow record row per
//! binding (`docs/adr/0007-outbox-layout.md`), shared by every agent that
//! drains or feeds the partition.
//!
//! # Layout
//!
//! - `ferry_outbox_partitions`: a row per partition: its `pid` (the key of
//!   the other tables), the fencing `hwm` and the `last_seq` assigned.
//! - `ferry_outbox_messages`: a row per message, keyed `(pid, first_seq)`:
//!   the encoded envelope and the seqs `first_seq..=last_seq` of its records.
//! - `ferry_outbox_records`: a row per (message, binding), keyed `(pid,
//!   seq)`; `msg` is its message's `first_seq`; `claim_version` is `NULL`
//!   while pending. Partial indexes hold the pending, the claimed and the
//!   expiring pending records.
//!
//! # How the invariants hold with several agents
//!
//! 1. **Seqs** come from the partition row's counter:
//!    `INSERT … ON CONFLICT DO UPDATE SET last_seq = last_seq + n RETURNING`
//!    in the append's transaction, so the row stays locked until the records
//!    are committed; a rolled-back append gives its seqs back with the
//!    counter, a committed one never (strictly increasing, never reused).
//! 2. **Appends are grouped** (group commit): appends waiting while a
//!    transaction commits go into the next one, together, as the SQLite
//!    writer does — one counter update per partition (partitions locked in
//!    name order, so two agents' groups cannot deadlock), one multi-row
//!    insert of messages and one of records. The group commits or fails as
//!    a whole, and every append of it is answered only after `COMMIT`.
//! 3. **The fence.** Every operation carrying a version first locks the
//!    partition row `FOR KEY SHARE` and reads `hwm`: below it is `Stale`.
//!    Raising the mark (a claim or expiry with a higher version) takes the
//!    row `FOR UPDATE`, which waits for every transaction holding it at the
//!    old mark and is waited for by every later one; in that transaction it
//!    sets `hwm` and makes every older claim pending. Appends update only
//!    `last_seq` (a `FOR NO KEY UPDATE` lock), which does not conflict with
//!    `FOR KEY SHARE`: claims and completions do not wait for appends.
//! 4. **Complete and release** check the version in the same statement that
//!    changes the records: `… FROM partitions p WHERE claim_version = $v AND
//!    $v >= p.hwm`, the partition row locked by that statement; they act only
//!    on records claimed with exactly `$v`.
//! 5. **Claims** pick pending records (and the owner's own claims older than
//!    `stale_claim_duration` at the `now` passed in) oldest first with
//!    `FOR UPDATE SKIP LOCKED` and mark them in the same statement: two
//!    agents claiming at once never get the same record, and neither waits
//!    for the other's rows.
//! 6. **A message goes with its last record.** A completion locks the
//!    message rows of the records it deleted (in key order), then, in a
//!    statement that starts after those locks are held and so sees every
//!    completion committed before, deletes those left without a record in
//!    their seq range: of two completions emptying one message, the later
//!    one deletes it.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use tokio::sync::{mpsc, oneshot};
use tokio_postgres::{GenericClient, Row};

use super::{Db, PostgresOptions, TxError, in_transaction, schema, to_i64, to_u64};
use crate::stores::outbox::{Names, RawRecord, into_records, stale, stale_before, validate_append};
use crate::stores::{
    BoxFuture, NewMessage, OutboxRecord, OutboxStats, OutboxStore, Release, StoreError,
    StoreResult, from_unix_nanos, unix_nanos,
};

/// Appends committed in one transaction at most.
const MAX_GROUP: usize = 256;

/// Appends waiting for a group at most; more wait to be queued.
const QUEUE: usize = 1024;

/// A record row's columns, in [`raw_record`]'s order, of the table aliased `r`.
const COLUMNS: &str = "r.seq, r.msg, r.id, r.binding, r.address, r.created_at_ns, \
    r.expires_at_ns, r.claim_version, r.claim_owner, r.claimed_at_ns, r.replay_count, \
    r.first_attempt_at_ns, r.last_error";

/// Locks a partition row for an operation at the current mark (invariant 3).
const FENCE: &str =
    "SELECT pid, hwm FROM ferry_outbox_partitions WHERE partition = $1 FOR KEY SHARE";

/// Claims (invariant 5): `$1` pid, `$2` limit, `$3` owner, `$4` version,
/// `$5` claims made at or before this are stale, `$6` now. The rows are
/// updated by `seq = ANY(ARRAY(…))`, a primary-key lookup: joined to the
/// chosen seqs instead, the generic plan hashes every record of the table.
const CLAIM: &str = "
WITH pending AS (
    SELECT seq FROM ferry_outbox_records
    WHERE pid = $1 AND claim_version IS NULL
    ORDER BY seq LIMIT $2 FOR UPDATE SKIP LOCKED
), stale AS (
    SELECT seq FROM ferry_outbox_records
    WHERE pid = $1 AND claim_version IS NOT NULL AND claim_owner = $3 AND claimed_at_ns <= $5
    ORDER BY seq LIMIT $2 FOR UPDATE SKIP LOCKED
)
UPDATE ferry_outbox_records r
SET claim_version = $4, claim_owner = $3, claimed_at_ns = $6
WHERE r.pid = $1 AND r.seq = ANY (ARRAY(
    SELECT seq FROM pending UNION ALL SELECT seq FROM stale ORDER BY seq LIMIT $2))
RETURNING ";

/// Expiry claims: `$1` pid, `$2` limit, `$3` owner, `$4` version, `$5` now.
const EXPIRE: &str = "
WITH chosen AS (
    SELECT seq FROM ferry_outbox_records
    WHERE pid = $1 AND claim_version IS NULL AND expires_at_ns IS NOT NULL
      AND expires_at_ns <= $5
    ORDER BY seq LIMIT $2 FOR UPDATE SKIP LOCKED
)
UPDATE ferry_outbox_records r
SET claim_version = $4, claim_owner = $3, claimed_at_ns = $5
WHERE r.pid = $1 AND r.seq = ANY (ARRAY(SELECT seq FROM chosen))
RETURNING ";

/// Completion (invariant 4): `$1` partition, `$2` version, `$3` seqs.
/// Returns the partition's pid and mark (NULL for an unknown partition),
/// the seqs deleted and their messages.
const COMPLETE: &str = "
WITH p AS (
    SELECT pid, hwm FROM ferry_outbox_partitions WHERE partition = $1 FOR KEY SHARE
), d AS (
    DELETE FROM ferry_outbox_records r USING p
    WHERE r.pid = p.pid AND $2 >= p.hwm AND r.claim_version = $2 AND r.seq = ANY($3)
    RETURNING r.seq, r.msg
)
SELECT (SELECT pid FROM p), (SELECT hwm FROM p),
    ARRAY(SELECT seq FROM d ORDER BY seq), ARRAY(SELECT DISTINCT msg FROM d ORDER BY msg)";

/// Release (invariant 4): `$1` partition, `$2` version, `$3` seqs, `$4` 1
/// for a counted release, `$5` its attempt time, `$6` its error.
const RELEASE: &str = "
WITH p AS (
    SELECT pid, hwm FROM ferry_outbox_partitions WHERE partition = $1 FOR KEY SHARE
), u AS (
    UPDATE ferry_outbox_records r
    SET claim_version = NULL, claim_owner = NULL, claimed_at_ns = NULL,
        replay_count = r.replay_count + $4,
        first_attempt_at_ns = COALESCE(r.first_attempt_at_ns, $5),
        last_error = COALESCE($6, r.last_error)
    FROM p
    WHERE r.pid = p.pid AND $2 >= p.hwm AND r.claim_version = $2 AND r.seq = ANY($3)
    RETURNING r.seq
)
SELECT (SELECT hwm FROM p), ARRAY(SELECT seq FROM u ORDER BY seq)";

/// An outbox in a PostgreSQL database.
pub struct PostgresOutboxStore {
    db: Db,
    options: PostgresOptions,
    appends: mpsc::Sender<AppendJob>,
    groups: Arc<AtomicU64>,
}

/// An append waiting for its group.
struct AppendJob {
    partition: String,
    message: NewMessage,
    reply: oneshot::Sender<StoreResult<Vec<u64>>>,
}

impl PostgresOutboxStore {
    /// Connects, creates or migrates the tables, and starts the task that
    /// commits appends in groups (it ends when the store is dropped).
    pub async fn open(options: PostgresOptions) -> StoreResult<Self> {
        let db = Db::open(&options, "outbox", schema::OUTBOX).await?;
        let (appends, jobs) = mpsc::channel(QUEUE);
        let groups = Arc::new(AtomicU64::new(0));
        tokio::spawn(group_commit(db.clone(), jobs, Arc::clone(&groups)));
        Ok(PostgresOutboxStore {
            db,
            options,
            appends,
            groups,
        })
    }

    /// The options it was opened with.
    pub fn options(&self) -> &PostgresOptions {
        &self.options
    }

    /// Append transactions committed since open: against the number of
    /// appends it shows how many share one commit.
    pub fn append_commits(&self) -> u64 {
        self.groups.load(Ordering::Relaxed)
    }

    /// Every record of `partition`, in seq order.
    #[cfg(test)]
    pub(crate) async fn dump(&self, partition: &str) -> StoreResult<Vec<OutboxRecord>> {
        let client = self.db.client().await?;
        let sql = format!(
            "SELECT {COLUMNS}, p.pid FROM ferry_outbox_records r \
             JOIN ferry_outbox_partitions p ON p.pid = r.pid WHERE p.partition = $1"
        );
        let rows = client
            .query(&sql, &[&partition])
            .await
            .map_err(super::pg_error)?;
        let Some(pid) = rows.first().map(|r| r.get::<_, i64>(13)) else {
            return Ok(Vec::new());
        };
        let mut names = Names::default();
        let raw = rows
            .iter()
            .map(|r| raw_record(r, &mut names))
            .collect::<Result<_, _>>();
        let raw = raw.map_err(super::pg_error)?;
        with_envelopes(&**client, partition, pid, raw)
            .await
            .map_err(|e| match e {
                TxError::Db(e) => super::pg_error(e),
                TxError::Store(e) => e,
            })
    }

    /// Message rows (stored envelopes) of `partition`.
    #[cfg(test)]
    pub(crate) async fn envelopes(&self, partition: &str) -> StoreResult<usize> {
        let client = self.db.client().await?;
        let n: i64 = client
            .query_one(
                "SELECT COUNT(*) FROM ferry_outbox_messages m \
                 JOIN ferry_outbox_partitions p ON p.pid = m.pid WHERE p.partition = $1",
                &[&partition],
            )
            .await
            .and_then(|r| r.try_get(0))
            .map_err(super::pg_error)?;
        Ok(usize::try_from(n).unwrap_or(0))
    }
}

/// A record row, its binding and address shared through `names` with the
/// rows read before it.
fn raw_record(r: &Row, names: &mut Names) -> Result<RawRecord, tokio_postgres::Error> {
    Ok(RawRecord {
        seq: r.try_get(0)?,
        msg: r.try_get(1)?,
        id: r.try_get(2)?,
        binding: names.get(r.try_get(3)?),
        address: names.get(r.try_get(4)?),
        created_at: r.try_get(5)?,
        expires_at: r.try_get(6)?,
        claim_version: r.try_get(7)?,
        claim_owner: r.try_get(8)?,
        claimed_at: r.try_get(9)?,
        replay_count: r.try_get::<_, i32>(10)?.into(),
        first_attempt_at: r.try_get(11)?,
        last_error: r.try_get(12)?,
    })
}

/// Reads the envelopes of `rows`' messages in one query and turns the rows
/// into records sharing them (invariant 8 of the stores).
async fn with_envelopes(
    client: &(impl GenericClient + Sync),
    partition: &str,
    pid: i64,
    rows: Vec<RawRecord>,
) -> Result<Vec<OutboxRecord>, TxError> {
    let mut msgs: Vec<i64> = rows.iter().map(|r| r.msg).collect();
    msgs.sort_unstable();
    msgs.dedup();
    let found = client
        .query(
            "SELECT first_seq, envelope FROM ferry_outbox_messages \
             WHERE pid = $1 AND first_seq = ANY($2)",
            &[&pid, &msgs],
        )
        .await?;
    let mut bytes: HashMap<i64, Vec<u8>> = HashMap::with_capacity(found.len());
    for row in found {
        bytes.insert(row.try_get(0)?, row.try_get(1)?);
    }
    Ok(into_records(partition, rows, |msg| Ok(bytes.remove(&msg)))?)
}

/// The task that commits appends in groups (invariant 2).
async fn group_commit(db: Db, mut jobs: mpsc::Receiver<AppendJob>, groups: Arc<AtomicU64>) {
    while let Some(first) = jobs.recv().await {
        let mut group = vec![first];
        while group.len() < MAX_GROUP {
            match jobs.try_recv() {
                Ok(job) => group.push(job),
                Err(_) => break,
            }
        }
        let outcome = append_group(&db, &group).await;
        if outcome.is_ok() {
            groups.fetch_add(1, Ordering::Relaxed);
        }
        match outcome {
            Ok(seqs) => {
                for (job, seqs) in group.into_iter().zip(seqs) {
                    // A caller that stopped waiting needs no answer.
                    let _ = job.reply.send(Ok(seqs));
                }
            }
            Err(e) => {
                for job in group {
                    let _ = job.reply.send(Err(e.clone()));
                }
            }
        }
    }
}

/// The columns of a group's rows, for one multi-row insert per table.
#[derive(Default)]
struct GroupRows {
    msg_pid: Vec<i64>,
    msg_first: Vec<i64>,
    msg_last: Vec<i64>,
    msg_envelope: Vec<Vec<u8>>,
    pid: Vec<i64>,
    seq: Vec<i64>,
    msg: Vec<i64>,
    id: Vec<String>,
    binding: Vec<String>,
    address: Vec<String>,
    created_at: Vec<i64>,
    expires_at: Vec<Option<i64>>,
}

/// A message of the group, encoded before the transaction.
struct Encoded<'a> {
    job: usize,
    partition: &'a str,
    message: &'a NewMessage,
    envelope: Vec<u8>,
    created_at: i64,
    expires_at: Option<i64>,
}

/// Commits `group` in one transaction; the seqs of each job, in order.
async fn append_group(db: &Db, group: &[AppendJob]) -> StoreResult<Vec<Vec<u64>>> {
    let mut encoded = Vec::with_capacity(group.len());
    for (job, j) in group.iter().enumerate() {
        encoded.push(Encoded {
            job,
            partition: &j.partition,
            message: &j.message,
            envelope: j.message.envelope.encode(),
            created_at: unix_nanos(j.message.created_at)?,
            expires_at: j.message.expires_at.map(unix_nanos).transpose()?,
        });
    }
    // Partition rows are locked in name order (invariant 2); a stable sort
    // keeps each partition's appends in arrival order.
    encoded.sort_by(|a, b| a.partition.cmp(b.partition));
    in_transaction!(db, |tx| async {
        let counter = tx
            .prepare_cached(
                "INSERT INTO ferry_outbox_partitions AS p (partition, hwm, last_seq) \
                 VALUES ($1, 0, $2) ON CONFLICT (partition) \
                 DO UPDATE SET last_seq = p.last_seq + EXCLUDED.last_seq \
                 RETURNING pid, last_seq",
            )
            .await?;
        let mut seqs = vec![Vec::new(); group.len()];
        let mut rows = GroupRows::default();
        for same in encoded.chunk_by(|a, b| a.partition == b.partition) {
            let n: usize = same.iter().map(|e| e.message.records.len()).sum();
            let n = i64::try_from(n).map_err(|_| StoreError::Invalid("too many records".into()))?;
            let row = tx.query_one(&counter, &[&same[0].partition, &n]).await?;
            let (pid, last): (i64, i64) = (row.try_get(0)?, row.try_get(1)?);
            let mut next = last - n + 1;
            for e in same {
                let first = next;
                let count = e.message.records.len() as i64;
                rows.msg_pid.push(pid);
                rows.msg_first.push(next);
                rows.msg_last.push(next + count - 1);
                rows.msg_envelope.push(e.envelope.clone());
                for r in &e.message.records {
                    rows.pid.push(pid);
                    rows.seq.push(next);
                    rows.msg.push(first);
                    rows.id.push(r.id.clone());
                    rows.binding.push(r.binding.to_string());
                    rows.address.push(r.address.to_string());
                    rows.created_at.push(e.created_at);
                    rows.expires_at.push(e.expires_at);
                    seqs[e.job].push(to_u64(next)?);
                    next += 1;
                }
            }
        }
        let messages = tx
            .prepare_cached(
                "INSERT INTO ferry_outbox_messages (pid, first_seq, last_seq, envelope) \
                 SELECT * FROM UNNEST($1::int8[], $2::int8[], $3::int8[], $4::bytea[])",
            )
            .await?;
        let records = tx
            .prepare_cached(
                "INSERT INTO ferry_outbox_records (pid, seq, msg, id, binding, address, \
                 created_at_ns, expires_at_ns) SELECT * FROM UNNEST($1::int8[], $2::int8[], \
                 $3::int8[], $4::text[], $5::text[], $6::text[], $7::int8[], $8::int8[])",
            )
            .await?;
        tx.execute(
            &messages,
            &[
                &rows.msg_pid,
                &rows.msg_first,
                &rows.msg_last,
                &rows.msg_envelope,
            ],
        )
        .await?;
        tx.execute(
            &records,
            &[
                &rows.pid,
                &rows.seq,
                &rows.msg,
                &rows.id,
                &rows.binding,
                &rows.address,
                &rows.created_at,
                &rows.expires_at,
            ],
        )
        .await?;
        Ok::<_, TxError>(seqs)
    })
}

/// Locks the partition row for an operation under `version` (invariant 3):
/// `Stale` below the mark; above it the mark rises and every older claim is
/// pending again. Creates the partition row when missing. Its pid.
async fn advance_fence(
    tx: &deadpool_postgres::Transaction<'_>,
    partition: &str,
    version: u64,
) -> Result<i64, TxError> {
    let fence = tx.prepare_cached(FENCE).await?;
    let row = match tx.query_opt(&fence, &[&partition]).await? {
        Some(row) => row,
        None => {
            tx.execute(
                "INSERT INTO ferry_outbox_partitions (partition, hwm, last_seq) \
                 VALUES ($1, 0, 0) ON CONFLICT (partition) DO NOTHING",
                &[&partition],
            )
            .await?;
            tx.query_one(&fence, &[&partition]).await?
        }
    };
    let pid: i64 = row.try_get(0)?;
    let hwm = to_u64(row.try_get(1)?)?;
    if version < hwm {
        return Err(stale(partition, version, hwm).into());
    }
    if version > hwm {
        // Waits for every transaction at the old mark (invariant 3); the
        // mark may have risen meanwhile.
        let row = tx
            .query_one(
                "SELECT hwm FROM ferry_outbox_partitions WHERE pid = $1 FOR UPDATE",
                &[&pid],
            )
            .await?;
        let hwm = to_u64(row.try_get(0)?)?;
        if version < hwm {
            return Err(stale(partition, version, hwm).into());
        }
        let v = to_i64(version)?;
        tx.execute(
            "UPDATE ferry_outbox_partitions SET hwm = $2 WHERE pid = $1",
            &[&pid, &v],
        )
        .await?;
        // A newer lease: every claim of an older one is void at once.
        tx.execute(
            "UPDATE ferry_outbox_records SET claim_version = NULL, claim_owner = NULL, \
             claimed_at_ns = NULL WHERE pid = $1 AND claim_version IS NOT NULL \
             AND claim_version < $2",
            &[&pid, &v],
        )
        .await?;
    }
    Ok(pid)
}

/// What a claiming call picks.
#[derive(Clone, Copy)]
enum Pick {
    /// Pending records and the owner's claims made at or before this time.
    Claim { stale_before: i64 },
    /// Pending records expired at `now`.
    Expire,
}

fn sql_limit(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

/// Seqs as the `BIGINT[]` a statement takes, sorted and distinct.
fn seq_array(seqs: &[u64]) -> StoreResult<Vec<i64>> {
    let mut out = seqs
        .iter()
        .map(|s| to_i64(*s))
        .collect::<StoreResult<Vec<_>>>()?;
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

fn to_seqs(seqs: Vec<i64>) -> StoreResult<Vec<u64>> {
    seqs.into_iter().map(to_u64).collect()
}

impl PostgresOutboxStore {
    async fn claiming(
        &self,
        partition: &str,
        owner: &str,
        version: u64,
        limit: usize,
        now: SystemTime,
        pick: Pick,
    ) -> StoreResult<Vec<OutboxRecord>> {
        let now = unix_nanos(now)?;
        let v = to_i64(version)?;
        let limit = sql_limit(limit);
        let sql = match pick {
            Pick::Claim { .. } => format!("{CLAIM}{COLUMNS}"),
            Pick::Expire => format!("{EXPIRE}{COLUMNS}"),
        };
        in_transaction!(self.db, |tx| async {
            let pid = advance_fence(&tx, partition, version).await?;
            let stmt = tx.prepare_cached(&sql).await?;
            let rows = match pick {
                Pick::Claim { stale_before } => {
                    tx.query(&stmt, &[&pid, &limit, &owner, &v, &stale_before, &now])
                        .await?
                }
                Pick::Expire => tx.query(&stmt, &[&pid, &limit, &owner, &v, &now]).await?,
            };
            let mut names = Names::default();
            let raw = rows
                .iter()
                .map(|r| raw_record(r, &mut names))
                .collect::<Result<Vec<_>, _>>()?;
            with_envelopes(&*tx, partition, pid, raw).await
        })
    }
}

impl OutboxStore for PostgresOutboxStore {
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
            let (reply, answer) = oneshot::channel();
            let job = AppendJob {
                partition: partition.to_owned(),
                message,
                reply,
            };
            self.appends
                .send(job)
                .await
                .map_err(|_| StoreError::Unavailable("postgres appender has stopped".into()))?;
            answer.await.map_err(|_| {
                StoreError::Unavailable("postgres appender stopped before answering".into())
            })?
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
        Box::pin(async move {
            let stale_before = stale_before(now, self.options.stale_claim_duration)?;
            self.claiming(
                partition,
                owner,
                version,
                limit,
                now,
                Pick::Claim { stale_before },
            )
            .await
        })
    }

    fn complete<'a>(
        &'a self,
        partition: &'a str,
        version: u64,
        seqs: &'a [u64],
    ) -> BoxFuture<'a, StoreResult<Vec<u64>>> {
        Box::pin(async move {
            let v = to_i64(version)?;
            let seqs = seq_array(seqs)?;
            in_transaction!(self.db, |tx| async {
                let stmt = tx.prepare_cached(COMPLETE).await?;
                let row = tx.query_one(&stmt, &[&partition, &v, &seqs]).await?;
                let (pid, hwm): (Option<i64>, Option<i64>) = (row.try_get(0)?, row.try_get(1)?);
                let (Some(pid), Some(hwm)) = (pid, hwm) else {
                    return Ok(Vec::new());
                };
                let hwm = to_u64(hwm)?;
                if version < hwm {
                    return Err(stale(partition, version, hwm).into());
                }
                let done: Vec<i64> = row.try_get(2)?;
                let msgs: Vec<i64> = row.try_get(3)?;
                if !msgs.is_empty() {
                    // Invariant 6: lock, then look with a fresh snapshot.
                    let lock = tx
                        .prepare_cached(
                            "SELECT first_seq FROM ferry_outbox_messages \
                             WHERE pid = $1 AND first_seq = ANY($2) ORDER BY first_seq FOR UPDATE",
                        )
                        .await?;
                    let emptied = tx
                        .prepare_cached(
                            "DELETE FROM ferry_outbox_messages m \
                             WHERE m.pid = $1 AND m.first_seq = ANY($2) AND NOT EXISTS ( \
                               SELECT 1 FROM ferry_outbox_records r WHERE r.pid = m.pid \
                               AND r.seq BETWEEN m.first_seq AND m.last_seq)",
                        )
                        .await?;
                    // Sent together; the server runs them in order.
                    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&pid, &msgs];
                    let (locked, deleted) =
                        futures::join!(tx.query(&lock, &params), tx.execute(&emptied, &params));
                    locked?;
                    deleted?;
                }
                Ok::<_, TxError>(to_seqs(done)?)
            })
        })
    }

    fn release<'a>(
        &'a self,
        partition: &'a str,
        version: u64,
        seqs: &'a [u64],
        how: Release,
    ) -> BoxFuture<'a, StoreResult<Vec<u64>>> {
        Box::pin(async move {
            let v = to_i64(version)?;
            let seqs = seq_array(seqs)?;
            let (counted, at, error): (i32, Option<i64>, Option<String>) = match how {
                Release::Untried => (0, None, None),
                Release::Failed {
                    error,
                    attempted_at,
                } => (1, Some(unix_nanos(attempted_at)?), Some(error)),
            };
            in_transaction!(self.db, |tx| async {
                let stmt = tx.prepare_cached(RELEASE).await?;
                let row = tx
                    .query_one(&stmt, &[&partition, &v, &seqs, &counted, &at, &error])
                    .await?;
                let Some(hwm) = row.try_get::<_, Option<i64>>(0)? else {
                    return Ok(Vec::new());
                };
                let hwm = to_u64(hwm)?;
                if version < hwm {
                    return Err(stale(partition, version, hwm).into());
                }
                Ok::<_, TxError>(to_seqs(row.try_get(1)?)?)
            })
        })
    }

    fn expire<'a>(
        &'a self,
        partition: &'a str,
        owner: &'a str,
        version: u64,
        now: SystemTime,
        limit: usize,
    ) -> BoxFuture<'a, StoreResult<Vec<OutboxRecord>>> {
        Box::pin(self.claiming(partition, owner, version, limit, now, Pick::Expire))
    }

    fn stats<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, StoreResult<OutboxStats>> {
        Box::pin(async move {
            let client = self.db.client().await?;
            let stmt = client
                .prepare_cached(
                    "SELECT p.hwm, r.binding, r.claim_version IS NOT NULL, COUNT(r.seq), \
                     MIN(r.created_at_ns) FROM ferry_outbox_partitions p \
                     LEFT JOIN ferry_outbox_records r ON r.pid = p.pid \
                     WHERE p.partition = $1 GROUP BY p.hwm, 2, 3",
                )
                .await
                .map_err(super::pg_error)?;
            let rows = client
                .query(&stmt, &[&partition])
                .await
                .map_err(super::pg_error)?;
            let mut stats = OutboxStats::default();
            for row in rows {
                let group = || -> Result<_, tokio_postgres::Error> {
                    Ok((
                        row.try_get::<_, i64>(0)?,
                        row.try_get::<_, Option<String>>(1)?,
                        row.try_get::<_, Option<bool>>(2)?,
                        row.try_get::<_, i64>(3)?,
                        row.try_get::<_, Option<i64>>(4)?,
                    ))
                };
                let (hwm, binding, claimed, count, oldest) = group().map_err(super::pg_error)?;
                stats.high_water_mark = to_u64(hwm)?;
                // A partition without records joins one row of NULLs.
                let (Some(binding), Some(claimed), Some(oldest)) = (binding, claimed, oldest)
                else {
                    continue;
                };
                let (count, oldest) = (to_u64(count)?, from_unix_nanos(oldest)?);
                stats.total.add_group(claimed, count, oldest);
                stats
                    .bindings
                    .entry(binding)
                    .or_default()
                    .add_group(claimed, count, oldest);
            }
            Ok(stats)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::net::ToSocketAddrs;
    use std::sync::Arc;
    use std::time::Duration;

    use ferry_tests::proxy::TcpProxy;

    use super::*;
    use crate::stores::NewRecord;
    use crate::stores::conformance::{envelope, postgres_database, t};

    fn message(name: &str) -> NewMessage {
        let records = ["a", "b"]
            .iter()
            .map(|b| NewRecord::new(*b, format!("{b}/topic")))
            .collect();
        NewMessage::new(envelope(name), t(0), records)
    }

    fn payloads(records: &[OutboxRecord]) -> Vec<(u64, String)> {
        records
            .iter()
            .map(|r| {
                let payload = String::from_utf8_lossy(&r.envelope.payload).into_owned();
                (r.seq, payload)
            })
            .collect()
    }

    /// The server unreachable (connections dropped, new ones refused): appends
    /// and claims fail with an unknown outcome, nothing of them is stored,
    /// and the store works again, with every acknowledged record, once the
    /// server is back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_outage_acknowledges_nothing_and_loses_nothing() {
        let (options, database) = postgres_database().await;
        let (host, port) = database.server_address().expect("server address");
        let target = (host.as_str(), port)
            .to_socket_addrs()
            .expect("resolve")
            .next()
            .expect("an address");
        let proxy = TcpProxy::start(target).await.expect("proxy");
        let options = PostgresOptions {
            url: database
                .url_via(&proxy.addr().to_string())
                .expect("proxy url"),
            connect_timeout: Duration::from_secs(2),
            ..options
        };
        let store = PostgresOutboxStore::open(options).await.expect("open");
        assert_eq!(store.append("p", message("before")).await, Ok(vec![1, 2]));

        proxy.cut().await;
        let refused = store.append("p", message("during")).await;
        assert!(
            refused.as_ref().is_err_and(|e| !e.outcome_known()),
            "{refused:?}"
        );
        let claim = store.claim("p", "o", 1, 10, t(1)).await;
        assert!(claim.is_err_and(|e| !e.outcome_known()));

        proxy.restore().await.expect("restore");
        assert_eq!(store.append("p", message("after")).await, Ok(vec![3, 4]));
        let claimed = store.claim("p", "o", 1, 10, t(2)).await.expect("claim");
        assert_eq!(
            payloads(&claimed),
            vec![
                (1, "before".to_owned()),
                (2, "before".to_owned()),
                (3, "after".to_owned()),
                (4, "after".to_owned()),
            ]
        );
    }

    /// Appends sent at once share transactions, and each gets its own seqs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_appends_share_commits() {
        let (options, _database) = postgres_database().await;
        let store = Arc::new(PostgresOutboxStore::open(options).await.expect("open"));
        let mut calls = Vec::new();
        for i in 0..200 {
            let store = Arc::clone(&store);
            let partition = if i % 2 == 0 { "p0" } else { "p1" };
            calls.push(tokio::spawn(async move {
                store.append(partition, message(&format!("m{i}"))).await
            }));
        }
        let mut seqs = Vec::new();
        for call in calls {
            seqs.extend(call.await.expect("task").expect("append"));
        }
        seqs.sort_unstable();
        let mut expected: Vec<u64> = (1..=200).chain(1..=200).collect();
        expected.sort_unstable();
        assert_eq!(seqs, expected, "each partition's seqs 1..=200, none twice");
        assert!(
            store.append_commits() < 200,
            "{} commits for 200 appends",
            store.append_commits()
        );
    }

    /// Two stores (two agents) on one outbox: a claim at a higher version
    /// fences out the older holder's completions and releases, and the newer
    /// holder gets its records.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_second_agent_takes_over_and_fences_the_first() {
        let (options, _database) = postgres_database().await;
        let first = PostgresOutboxStore::open(options.clone())
            .await
            .expect("open");
        let second = PostgresOutboxStore::open(options).await.expect("open");
        first.append("p", message("m")).await.expect("append");
        let mine = first.claim("p", "a", 1, 10, t(1)).await.expect("claim");
        assert_eq!(mine.len(), 2);
        let theirs = second.claim("p", "b", 2, 10, t(2)).await.expect("claim");
        assert_eq!(theirs.len(), 2, "older claims are taken back");
        assert!(matches!(
            first.complete("p", 1, &[1, 2]).await,
            Err(StoreError::Stale(_))
        ));
        assert!(matches!(
            first.release("p", 1, &[1], Release::Untried).await,
            Err(StoreError::Stale(_))
        ));
        assert_eq!(second.complete("p", 2, &[1, 2]).await, Ok(vec![1, 2]));
        assert_eq!(first.envelopes("p").await, Ok(0));
    }

    /// A holder paused inside a completion (the partition row locked at its
    /// version, the transaction open) does not stop the next holder's claim
    /// for long: the server ends the paused session (invariant 5 of the
    /// module), the claim goes through, and the paused transaction can no
    /// longer commit anything.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_holder_paused_inside_a_transaction_does_not_block_the_next() {
        let (options, _database) = postgres_database().await;
        let first = PostgresOutboxStore::open(options.clone())
            .await
            .expect("open");
        let second = PostgresOutboxStore::open(options).await.expect("open");
        first.append("p", message("m")).await.expect("append");
        first.claim("p", "a", 1, 10, t(1)).await.expect("claim");
        let mut paused = first.db.client().await.expect("client");
        let paused = paused.transaction().await.expect("begin");
        paused.query_one(FENCE, &[&"p"]).await.expect("fence");

        let takeover =
            tokio::time::timeout(Duration::from_secs(30), second.claim("p", "b", 2, 10, t(2)))
                .await
                .expect("the claim waited on the paused holder's lock for 30 s");
        assert_eq!(takeover.expect("claim").len(), 2);
        let late = paused
            .execute("DELETE FROM ferry_outbox_records", &[])
            .await;
        assert!(late.is_err(), "the paused session was not ended: {late:?}");
        assert_eq!(second.complete("p", 2, &[1, 2]).await, Ok(vec![1, 2]));
    }
}
