//! Table definitions. Each store owns its tables and records its schema
//! version in `ferry_schema` (not `user_version`, because several stores may
//! share one file). An older version is migrated in place when the store
//! opens, in the transaction that checks the version (all of it or none);
//! a database written by a newer build is refused rather than misread.

use rusqlite::{Connection, OptionalExtension, params};

use super::sql_error;
use crate::stores::{StoreError, StoreResult};

/// The outbox's partitions and messages as layout 2 created them (layout 4
/// adds `claimed_to`; layout and invariants: `super::outbox`).
const OUTBOX_PARTITIONS_AND_MESSAGES: &str = "
CREATE TABLE IF NOT EXISTS outbox_partitions (
    pid       INTEGER PRIMARY KEY,
    partition TEXT    NOT NULL UNIQUE,
    -- the fencing high-water mark
    hwm       INTEGER NOT NULL,
    -- the last seq assigned; seqs are never reused
    last_seq  INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS outbox_messages (
    msg       INTEGER PRIMARY KEY,
    pid       INTEGER NOT NULL,
    -- the seqs of the message's records
    first_seq INTEGER NOT NULL,
    last_seq  INTEGER NOT NULL,
    envelope  BLOB    NOT NULL
);
";

/// The outbox's records in layout 2, keyed `(pid, seq)`.
const OUTBOX_RECORDS_V2: &str = "
CREATE TABLE IF NOT EXISTS outbox_records (
    pid                 INTEGER NOT NULL,
    seq                 INTEGER NOT NULL,
    msg                 INTEGER NOT NULL,
    id                  TEXT    NOT NULL,
    binding             TEXT    NOT NULL,
    address             TEXT    NOT NULL,
    created_at_ns       INTEGER NOT NULL,
    expires_at_ns       INTEGER,
    -- 0 pending, 1 claimed
    state               INTEGER NOT NULL,
    claim_version       INTEGER,
    claim_owner         TEXT,
    claimed_at_ns       INTEGER,
    replay_count        INTEGER NOT NULL,
    first_attempt_at_ns INTEGER,
    last_error          TEXT,
    PRIMARY KEY (pid, seq)
) WITHOUT ROWID;
-- claim: pending (or own stale) records of a partition in seq order
CREATE INDEX IF NOT EXISTS outbox_records_state ON outbox_records (pid, state, seq);
CREATE INDEX IF NOT EXISTS outbox_records_expiry ON outbox_records (pid, expires_at_ns)
    WHERE expires_at_ns IS NOT NULL;
";

/// The outbox's records since layout 3: keyed by one integer, `key = pid <<
/// 40 | seq`, the table's rowid (`super::outbox`, invariant 5).
const OUTBOX_RECORDS_V3: &str = "
CREATE TABLE IF NOT EXISTS outbox_records (
    key                 INTEGER PRIMARY KEY,
    msg                 INTEGER NOT NULL,
    id                  TEXT    NOT NULL,
    binding             TEXT    NOT NULL,
    address             TEXT    NOT NULL,
    created_at_ns       INTEGER NOT NULL,
    expires_at_ns       INTEGER,
    -- 0 pending, 1 claimed (from layout 4: 1 by a claim, 2 by an expiry)
    state               INTEGER NOT NULL,
    claim_version       INTEGER,
    claim_owner         TEXT,
    claimed_at_ns       INTEGER,
    replay_count        INTEGER NOT NULL,
    first_attempt_at_ns INTEGER,
    last_error          TEXT
);
-- claim: pending (or own stale) records of a partition (a key range) in key order
CREATE INDEX IF NOT EXISTS outbox_records_state ON outbox_records (state, key);
-- expire: by partition (`key >> 40`, spelled so by the query too), then expiry time
CREATE INDEX IF NOT EXISTS outbox_records_expiry ON outbox_records (key >> 40, expires_at_ns)
    WHERE expires_at_ns IS NOT NULL;
";

/// From layout 3 to 4 (`super::outbox`, invariant 6): only pending records
/// and records claimed by `expire` (state 2, rare) are indexed by state, and
/// each partition keeps the highest key a claim marked (`claimed_to`), below
/// which every other claimed record lies. A claim then removes one index
/// entry per record instead of moving it, and a completion touches none.
/// Layout 3 did not tell a claim from an expiry's, and an expiry may claim
/// records far ahead, so every record claimed in layout 3 goes to state 2:
/// found through its index wherever it lies, and `claimed_to` starts at 0.
/// Also the last step of creating the tables afresh.
const OUTBOX_V3_TO_V4: &str = "
ALTER TABLE outbox_partitions ADD COLUMN claimed_to INTEGER NOT NULL DEFAULT 0;
UPDATE outbox_records SET state=2 WHERE state=1;
DROP INDEX outbox_records_state;
-- claim: a partition's pending records (a key range) in key order
CREATE INDEX outbox_records_pending ON outbox_records (key) WHERE state=0;
-- claim: records claimed by expire, which may lie above `claimed_to`
CREATE INDEX outbox_records_expiring ON outbox_records (key) WHERE state=2;
";

/// From layout 4 to 5 (`super::outbox`, invariant 7): a claim of records
/// appended since (state 3, in no state index) writes one row here for the
/// run it took instead of one per record. Records already stored keep their
/// states and indexes.
const OUTBOX_V4_TO_V5: &str = "
CREATE TABLE outbox_claims (
    -- the run's lowest and highest record key (of one partition)
    first_key     INTEGER PRIMARY KEY,
    last_key      INTEGER NOT NULL,
    version       INTEGER NOT NULL,
    owner         TEXT    NOT NULL,
    claimed_at_ns INTEGER NOT NULL
);
";

/// From layout 5 to 6 (`super::outbox`, invariant 7): a run counts the
/// fresh records it still holds, so that it goes with the last of them
/// without a search.
const OUTBOX_V6_CLAIMS: &str = "
ALTER TABLE outbox_claims ADD COLUMN fresh INTEGER NOT NULL DEFAULT 0;
";

/// Layout 6's messages (`super::outbox`, invariant 7): a fresh record has
/// no row; its message row holds its id, binding and address (`records`,
/// see `super::record_list`) and its times. `outbox_done` holds the records
/// completed while their message still has others, so that they are not
/// taken for fresh ones.
const OUTBOX_V6_TABLES: &str = "
CREATE TABLE outbox_messages (
    -- the key of its first record: pid << 40 | first_seq
    msg           INTEGER PRIMARY KEY,
    pid           INTEGER NOT NULL,
    -- the seqs of the message's records
    first_seq     INTEGER NOT NULL,
    last_seq      INTEGER NOT NULL,
    created_at_ns INTEGER NOT NULL,
    expires_at_ns INTEGER,
    -- each record's id, binding and address, in seq order
    records       BLOB    NOT NULL,
    envelope      BLOB    NOT NULL
);
-- expire: a partition's messages by expiry time
CREATE INDEX outbox_messages_expiry ON outbox_messages (pid, expires_at_ns)
    WHERE expires_at_ns IS NOT NULL;
CREATE TABLE outbox_done (
    key INTEGER PRIMARY KEY
);
";

/// Layout 2's records out of the way of layout 3's.
const OUTBOX_V2_SET_ASIDE: &str = "
DROP INDEX outbox_records_state;
DROP INDEX outbox_records_expiry;
ALTER TABLE outbox_records RENAME TO outbox_records_v2;
";

/// Layout 2's records in layout 3's table: the same rows under their key.
const OUTBOX_V2_COPY: &str = "
INSERT INTO outbox_records (key, msg, id, binding, address, created_at_ns, expires_at_ns, state,
        claim_version, claim_owner, claimed_at_ns, replay_count, first_attempt_at_ns, last_error)
    SELECT (pid << 40) | seq, msg, id, binding, address, created_at_ns, expires_at_ns, state,
        claim_version, claim_owner, claimed_at_ns, replay_count, first_attempt_at_ns, last_error
    FROM outbox_records_v2 ORDER BY pid, seq;
";

/// The first layout's tables out of the way of the second's.
const OUTBOX_V1_SET_ASIDE: &str = "
DROP INDEX outbox_records_state;
DROP INDEX outbox_records_expiry;
ALTER TABLE outbox_records RENAME TO outbox_records_v1;
ALTER TABLE outbox_partitions RENAME TO outbox_partitions_v1;
";

/// The first layout's rows in the second's tables (see [`outbox_v1_to_v2`]).
const OUTBOX_V1_COPY: &str = "
INSERT INTO outbox_partitions (partition, hwm, last_seq)
    SELECT partition, hwm, last_seq FROM outbox_partitions_v1 ORDER BY partition;
INSERT INTO outbox_messages (msg, pid, first_seq, last_seq, envelope)
    SELECT r.rowid, p.pid, r.seq, r.seq, r.envelope
    FROM outbox_records_v1 r JOIN outbox_partitions p ON p.partition = r.partition;
INSERT INTO outbox_records (pid, seq, msg, id, binding, address, created_at_ns, expires_at_ns,
        state, claim_version, claim_owner, claimed_at_ns, replay_count, first_attempt_at_ns,
        last_error)
    SELECT p.pid, r.seq, r.rowid, r.id, r.binding, r.address, r.created_at_ns, r.expires_at_ns,
        r.state, r.claim_version, r.claim_owner, r.claimed_at_ns, r.replay_count,
        r.first_attempt_at_ns, r.last_error
    FROM outbox_records_v1 r JOIN outbox_partitions p ON p.partition = r.partition;
";

const LEASE_V1: &str = "
CREATE TABLE IF NOT EXISTS leases (
    key            TEXT PRIMARY KEY,
    -- the last version granted; never decreases
    version        INTEGER NOT NULL,
    -- NULL after a release
    holder         TEXT,
    acquired_at_ns INTEGER,
    expires_at_ns  INTEGER
) WITHOUT ROWID;
";

const DLQ_V1: &str = "
CREATE TABLE IF NOT EXISTS dlq_entries (
    id                  TEXT PRIMARY KEY,
    bridge_id           TEXT    NOT NULL,
    route_id            TEXT    NOT NULL,
    binding_id          TEXT    NOT NULL,
    reason              INTEGER NOT NULL,
    dead_lettered_at_ns INTEGER NOT NULL,
    -- the whole entry, DlqEntry::encode
    entry               BLOB    NOT NULL
);
CREATE INDEX IF NOT EXISTS dlq_entries_order ON dlq_entries (dead_lettered_at_ns, id);
";

/// Turns one schema version into the next, inside the transaction that
/// checks the version.
type Migration = fn(&Connection) -> StoreResult<()>;

/// A component's tables at its current version, and the steps that bring
/// an older version there.
struct Schema {
    component: &'static str,
    version: i64,
    /// The statements that create the current version's tables, in order.
    ddl: &'static [&'static str],
    /// `(from, step)`: `step` turns version `from` into `from + 1`.
    migrations: &'static [(i64, Migration)],
}

/// Creates, checks or migrates the outbox tables.
pub(super) fn outbox(conn: &Connection) -> StoreResult<()> {
    ensure(
        conn,
        &Schema {
            component: "outbox",
            version: 6,
            ddl: &[
                OUTBOX_PARTITIONS_AND_MESSAGES,
                OUTBOX_RECORDS_V3,
                OUTBOX_V3_TO_V4,
                OUTBOX_V4_TO_V5,
                OUTBOX_V6_CLAIMS,
                "DROP TABLE outbox_messages;",
                OUTBOX_V6_TABLES,
            ],
            migrations: &[
                (1, outbox_v1_to_v2),
                (2, outbox_v2_to_v3),
                (3, outbox_v3_to_v4),
                (4, outbox_v4_to_v5),
                (5, outbox_v5_to_v6),
            ],
        },
    )
}

/// Creates or checks the lease table.
pub(super) fn lease(conn: &Connection) -> StoreResult<()> {
    ensure(
        conn,
        &Schema {
            component: "lease",
            version: 1,
            ddl: &[LEASE_V1],
            migrations: &[],
        },
    )
}

/// Creates or checks the DLQ table.
pub(super) fn dlq(conn: &Connection) -> StoreResult<()> {
    ensure(
        conn,
        &Schema {
            component: "dlq",
            version: 1,
            ddl: &[DLQ_V1],
            migrations: &[],
        },
    )
}

/// From the first layout (an envelope copy in every record row, keyed by the
/// partition's name) to the second. Every old record becomes a message of
/// its own — the copies of one fan-out cannot be told apart from equal
/// messages — and a record row with its seq, id, claim and counts; the old
/// rowid becomes the message's key. Partitions keep their marks and last
/// seqs. Refused, and rolled back, unless every record was copied.
fn outbox_v1_to_v2(conn: &Connection) -> StoreResult<()> {
    conn.execute_batch(OUTBOX_V1_SET_ASIDE).map_err(sql_error)?;
    conn.execute_batch(OUTBOX_PARTITIONS_AND_MESSAGES)
        .map_err(sql_error)?;
    conn.execute_batch(OUTBOX_RECORDS_V2).map_err(sql_error)?;
    conn.execute_batch(OUTBOX_V1_COPY).map_err(sql_error)?;
    all_copied(
        conn,
        2,
        "outbox_records_v1",
        "a record without its partition row",
    )?;
    conn.execute_batch("DROP TABLE outbox_records_v1; DROP TABLE outbox_partitions_v1;")
        .map_err(sql_error)
}

/// From records keyed `(pid, seq)` to records keyed by `pid << 40 | seq`:
/// the same rows, refused (and rolled back) when a `pid` or a seq (of a
/// record or a partition's last) does not fit in its bits, which no file
/// written by a build of layout 2 holds.
fn outbox_v2_to_v3(conn: &Connection) -> StoreResult<()> {
    let misfits: i64 = conn
        .query_row(
            "SELECT (SELECT COUNT(*) FROM outbox_records WHERE pid NOT BETWEEN 0 AND ?1 \
               OR seq NOT BETWEEN 0 AND ?2) \
             + (SELECT COUNT(*) FROM outbox_partitions WHERE pid NOT BETWEEN 0 AND ?1 \
               OR last_seq NOT BETWEEN 0 AND ?2)",
            params![super::outbox::MAX_PID, super::outbox::MAX_SEQ as i64],
            |r| r.get(0),
        )
        .map_err(sql_error)?;
    if misfits > 0 {
        return Err(StoreError::Corrupt(format!(
            "outbox migration to layout 3: {misfits} rows have a partition id above {} or a \
             seq above {}; the file was left as it was",
            super::outbox::MAX_PID,
            super::outbox::MAX_SEQ
        )));
    }
    conn.execute_batch(OUTBOX_V2_SET_ASIDE).map_err(sql_error)?;
    conn.execute_batch(OUTBOX_RECORDS_V3).map_err(sql_error)?;
    conn.execute_batch(OUTBOX_V2_COPY).map_err(sql_error)?;
    all_copied(conn, 3, "outbox_records_v2", "a row the copy missed")?;
    conn.execute_batch("DROP TABLE outbox_records_v2;")
        .map_err(sql_error)
}

/// See [`OUTBOX_V3_TO_V4`]: the same rows, indexed anew.
fn outbox_v3_to_v4(conn: &Connection) -> StoreResult<()> {
    conn.execute_batch(OUTBOX_V3_TO_V4).map_err(sql_error)
}

/// See [`OUTBOX_V4_TO_V5`]: a table added, no row touched.
fn outbox_v4_to_v5(conn: &Connection) -> StoreResult<()> {
    conn.execute_batch(OUTBOX_V4_TO_V5).map_err(sql_error)
}

/// From layout 5 to 6: every message row is copied with its records' ids,
/// bindings and addresses (from their rows) under the key of its first
/// record, each record completed while its message lived on gets a row in
/// `outbox_done`, each run counts its fresh records, and the fresh records'
/// rows go. Refused, and rolled back, unless every message was copied.
fn outbox_v5_to_v6(conn: &Connection) -> StoreResult<()> {
    conn.execute_batch(OUTBOX_V6_CLAIMS).map_err(sql_error)?;
    conn.execute_batch(
        "UPDATE outbox_claims SET fresh = (SELECT COUNT(*) FROM outbox_records \
           WHERE key BETWEEN outbox_claims.first_key AND outbox_claims.last_key AND state=3);
         ALTER TABLE outbox_messages RENAME TO outbox_messages_v5;",
    )
    .map_err(sql_error)?;
    conn.execute_batch(OUTBOX_V6_TABLES).map_err(sql_error)?;
    super::outbox::copy_v5_messages(conn)?;
    let count = |table: &str| -> StoreResult<i64> {
        conn.query_row(&format!("SELECT COUNT(*) FROM {table}"), [], |r| r.get(0))
            .map_err(sql_error)
    };
    let (old, new) = (count("outbox_messages_v5")?, count("outbox_messages")?);
    if old != new {
        return Err(StoreError::Corrupt(format!(
            "outbox migration to layout 6: {} of {old} messages have no record row; the file \
             was left as it was",
            old - new
        )));
    }
    conn.execute_batch("DELETE FROM outbox_records WHERE state=3; DROP TABLE outbox_messages_v5;")
        .map_err(sql_error)
}

/// Fails a migration to `layout` unless `outbox_records` holds as many rows
/// as `old`; `why` names what would have been lost.
fn all_copied(conn: &Connection, layout: u32, old: &str, why: &str) -> StoreResult<()> {
    let count = |table: &str| -> StoreResult<i64> {
        conn.query_row(&format!("SELECT COUNT(*) FROM {table}"), [], |r| r.get(0))
            .map_err(sql_error)
    };
    let (old, new) = (count(old)?, count("outbox_records")?);
    if old != new {
        return Err(StoreError::Corrupt(format!(
            "outbox migration to layout {layout} copied {new} of {old} records ({why}); the \
             file was left as it was"
        )));
    }
    Ok(())
}

fn ensure(conn: &Connection, schema: &Schema) -> StoreResult<()> {
    conn.execute_batch("BEGIN IMMEDIATE").map_err(sql_error)?;
    if let Err(error) = create(conn, schema) {
        // A failed step may have made SQLite roll back already (a full disk,
        // `max_size_bytes`): the ROLLBACK then fails, and the step's error is
        // the one that says why.
        let _ = conn.execute_batch("ROLLBACK");
        return Err(error);
    }
    conn.execute_batch("COMMIT").map_err(sql_error)
}

fn create(conn: &Connection, schema: &Schema) -> StoreResult<()> {
    let Schema {
        component,
        version,
        ddl,
        migrations,
    } = *schema;
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS ferry_schema (
            component TEXT PRIMARY KEY,
            version   INTEGER NOT NULL
        ) WITHOUT ROWID;",
    )
    .map_err(sql_error)?;
    let found: Option<i64> = conn
        .query_row(
            "SELECT version FROM ferry_schema WHERE component = ?1",
            [component],
            |r| r.get(0),
        )
        .optional()
        .map_err(sql_error)?;
    match found {
        Some(v) if v == version => Ok(()),
        Some(v) if v > version => Err(StoreError::Invalid(format!(
            "{component} schema version {v} was written by a newer ferry-agent (this one knows \
             up to {version}): run that version, or point the store at another file"
        ))),
        Some(v) => {
            for from in v..version {
                let step = migrations
                    .iter()
                    .find(|(f, _)| *f == from)
                    .map(|(_, step)| step)
                    .ok_or_else(|| {
                        StoreError::Invalid(format!(
                            "{component} schema version {from} cannot be migrated by this \
                             ferry-agent: open it with an older version and drain it first"
                        ))
                    })?;
                step(conn)?;
            }
            conn.execute(
                "UPDATE ferry_schema SET version = ?2 WHERE component = ?1",
                params![component, version],
            )
            .map_err(sql_error)?;
            tracing::info!(component, from = v, to = version, "sqlite schema migrated");
            Ok(())
        }
        None => {
            for statements in ddl {
                conn.execute_batch(statements).map_err(sql_error)?;
            }
            conn.execute(
                "INSERT INTO ferry_schema (component, version) VALUES (?1, ?2)",
                params![component, version],
            )
            .map_err(sql_error)?;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use rusqlite::Connection;
    use rusqlite::types::Value;

    use crate::stores::conformance::{STALE, envelope, sqlite_options, t};
    use crate::stores::sqlite::{SqliteOptions, SqliteOutboxStore};
    use crate::stores::{NewMessage, NewRecord, OutboxStore, Release, StoreError, unix_nanos};

    /// The first layout, as builds before it created it.
    const OUTBOX_V1: &str = "
    CREATE TABLE ferry_schema (component TEXT PRIMARY KEY, version INTEGER NOT NULL) WITHOUT ROWID;
    INSERT INTO ferry_schema VALUES ('outbox', 1);
    CREATE TABLE outbox_partitions (
        partition TEXT PRIMARY KEY, hwm INTEGER NOT NULL, last_seq INTEGER NOT NULL
    ) WITHOUT ROWID;
    CREATE TABLE outbox_records (
        partition TEXT NOT NULL, seq INTEGER NOT NULL, id TEXT NOT NULL, binding TEXT NOT NULL,
        address TEXT NOT NULL, envelope BLOB NOT NULL, created_at_ns INTEGER NOT NULL,
        expires_at_ns INTEGER, state INTEGER NOT NULL, claim_version INTEGER,
        claim_owner TEXT, claimed_at_ns INTEGER, replay_count INTEGER NOT NULL,
        first_attempt_at_ns INTEGER, last_error TEXT,
        PRIMARY KEY (partition, seq)
    );
    CREATE INDEX outbox_records_state ON outbox_records (partition, state, seq);
    CREATE INDEX outbox_records_expiry ON outbox_records (partition, expires_at_ns)
        WHERE expires_at_ns IS NOT NULL;
    ";

    /// A test record's columns from `state` to `last_error`: claimed under
    /// `claim` by `old-owner` at `at`, or pending; `replays` failures, the
    /// first at `at`.
    fn state_columns(claim: Option<i64>, replays: i64, at: i64) -> [Value; 7] {
        [
            i64::from(claim.is_some()).into(),
            claim.into(),
            claim.map(|_| "old-owner".to_owned()).into(),
            claim.map(|_| at).into(),
            replays.into(),
            (replays > 0).then_some(at).into(),
            (replays > 0).then_some("refused".to_owned()).into(),
        ]
    }

    /// A record row of the first layout: `(partition, seq, binding, name)`,
    /// claimed under `claim` or pending, with `replay_count` failures.
    fn insert_v1(
        conn: &Connection,
        row: (&str, i64, &str, &str),
        claim: Option<i64>,
        replays: i64,
    ) {
        let (partition, seq, binding, name) = row;
        let at = unix_nanos(t(1)).expect("time");
        conn.execute(
            "INSERT INTO outbox_records (partition, seq, id, binding, address, envelope, \
             created_at_ns, expires_at_ns, state, claim_version, claim_owner, claimed_at_ns, \
             replay_count, first_attempt_at_ns, last_error) \
             VALUES (?1, ?2, ?3, ?4, 'out', ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
            rusqlite::params_from_iter(
                [
                    Value::from(partition.to_owned()),
                    seq.into(),
                    format!("id-{partition}-{seq}").into(),
                    binding.to_owned().into(),
                    envelope(name).encode().into(),
                    at.into(),
                    (binding == "x")
                        .then_some(unix_nanos(t(100)).expect("time"))
                        .into(),
                ]
                .into_iter()
                .chain(state_columns(claim, replays, at)),
            ),
        )
        .expect("insert v1 record");
    }

    /// A file of the first layout with two partitions: a fan-out ×3 of which
    /// one record was delivered (seq 2 gone), one claimed, one failed twice,
    /// and a partition fenced at version 7 whose records were all delivered.
    fn v1_file(dir: &tempfile::TempDir) -> std::path::PathBuf {
        let path = dir.path().join("outbox.db");
        let conn = Connection::open(&path).expect("open");
        conn.execute_batch(OUTBOX_V1).expect("v1 schema");
        conn.execute_batch(
            "INSERT INTO outbox_partitions VALUES ('b/r', 3, 4), ('b/empty', 7, 12);",
        )
        .expect("partitions");
        insert_v1(&conn, ("b/r", 1, "x", "fan"), Some(3), 0);
        insert_v1(&conn, ("b/r", 3, "z", "fan"), None, 2);
        insert_v1(&conn, ("b/r", 4, "y", "solo"), None, 0);
        path
    }

    /// A file `file` writes, and the store that opened (and migrated) it.
    async fn migrated(
        file: fn(&tempfile::TempDir) -> std::path::PathBuf,
    ) -> (tempfile::TempDir, std::path::PathBuf, SqliteOutboxStore) {
        let dir = tempfile::tempdir().expect("temporary directory");
        let path = file(&dir);
        let store = SqliteOutboxStore::open(sqlite_options(&dir, "outbox.db"))
            .await
            .expect("open migrates");
        (dir, path, store)
    }

    #[tokio::test]
    async fn an_outbox_of_the_first_layout_is_migrated_when_opened() {
        let (_dir, path, store) = migrated(v1_file).await;
        let records = store.dump("b/r").await.expect("dump");
        let summary: Vec<_> = records
            .iter()
            .map(|r| {
                (
                    r.seq,
                    r.id.as_str(),
                    &*r.binding,
                    r.envelope.payload.as_ref(),
                    r.claim.as_ref().map(|c| (c.version, c.owner.as_str())),
                    r.replay_count,
                    r.last_error.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                (
                    1,
                    "id-b/r-1",
                    "x",
                    &b"fan"[..],
                    Some((3, "old-owner")),
                    0,
                    None
                ),
                (3, "id-b/r-3", "z", &b"fan"[..], None, 2, Some("refused")),
                (4, "id-b/r-4", "y", &b"solo"[..], None, 0, None),
            ]
        );
        assert_eq!(records[0].expires_at, Some(t(100)));
        assert_eq!(records[0].created_at, t(1));
        assert_eq!(records[1].first_attempt_at, Some(t(1)));
        assert_eq!(store.stats("b/r").await.expect("stats").high_water_mark, 3);
        assert_eq!(
            store.stats("b/empty").await.expect("stats").high_water_mark,
            7
        );
        // Seqs go on from where they were; fences hold.
        let message = NewMessage::new(envelope("new"), t(2), vec![NewRecord::new("x", "out")]);
        assert_eq!(store.append("b/empty", message).await, Ok(vec![13]));
        assert!(matches!(
            store.claim("b/empty", "o", 6, 10, t(3)).await,
            Err(StoreError::Stale(_))
        ));
        let failed = Release::Failed {
            error: "e".into(),
            attempted_at: t(3),
        };
        assert_eq!(store.release("b/r", 3, &[1], failed).await, Ok(vec![1]));
        let all = store.claim("b/r", "o", 4, 10, t(4)).await.expect("claim");
        assert_eq!(all.len(), 3);
        assert_eq!(
            store.complete("b/r", 4, &[1, 3, 4]).await,
            Ok(vec![1, 3, 4])
        );
        assert_eq!(store.envelopes("b/r").await, Ok(0));
        store.close().await;

        let conn = Connection::open(&path).expect("reopen");
        let version: i64 = conn
            .query_row(
                "SELECT version FROM ferry_schema WHERE component='outbox'",
                [],
                |r| r.get(0),
            )
            .expect("version");
        assert_eq!(version, 6);
        let old: i64 = conn
            .query_row(
                "SELECT COUNT(*) FROM sqlite_master WHERE name LIKE '%_v1'",
                [],
                |r| r.get(0),
            )
            .expect("tables");
        assert_eq!(old, 0, "the first layout's tables are gone");
    }

    /// A migration that would lose a record is rolled back whole: the file
    /// stays in the first layout and the store does not open.
    #[tokio::test]
    async fn a_migration_that_would_lose_records_changes_nothing() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let path = v1_file(&dir);
        {
            let conn = Connection::open(&path).expect("open");
            insert_v1(&conn, ("b/unknown", 1, "x", "orphan"), None, 0);
        }
        refused_unchanged(&dir, "copied 3 of 4 records", (1, 4)).await;
    }

    /// Opening the outbox in `dir` fails with an error that says `why`, and
    /// the file is left at `(schema version, records)`.
    async fn refused_unchanged(dir: &tempfile::TempDir, why: &str, left: (i64, i64)) {
        let error = SqliteOutboxStore::open(sqlite_options(dir, "outbox.db"))
            .await
            .err()
            .expect("refused");
        assert!(error.to_string().contains(why), "{error}");
        assert_eq!(version_and_records(dir), left);
    }

    /// The outbox file's schema version and number of records.
    fn version_and_records(dir: &tempfile::TempDir) -> (i64, i64) {
        Connection::open(dir.path().join("outbox.db"))
            .expect("reopen")
            .query_row(
                "SELECT (SELECT version FROM ferry_schema WHERE component='outbox'), \
                 (SELECT COUNT(*) FROM outbox_records)",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .expect("state")
    }

    /// A file of layout 2 (records keyed `(pid, seq)`): partition `b/r`
    /// (pid 1, fenced at 3) with a message fanned out to seqs 1..=2 — seq 1
    /// claimed, seq 2 failed twice — and one to seq 4 that expires;
    /// partition `b/s` (pid 2) with seq 7 pending.
    fn v2_file(dir: &tempfile::TempDir) -> std::path::PathBuf {
        let path = dir.path().join("outbox.db");
        let conn = Connection::open(&path).expect("open");
        conn.execute_batch(
            "CREATE TABLE ferry_schema (component TEXT PRIMARY KEY, version INTEGER NOT NULL) \
             WITHOUT ROWID; INSERT INTO ferry_schema VALUES ('outbox', 2);",
        )
        .expect("schema table");
        conn.execute_batch(super::OUTBOX_PARTITIONS_AND_MESSAGES)
            .expect("v2 partitions and messages");
        conn.execute_batch(super::OUTBOX_RECORDS_V2)
            .expect("v2 records");
        let expires = unix_nanos(t(100)).expect("time");
        conn.execute(
            "INSERT INTO outbox_partitions VALUES (1, 'b/r', 3, 4), (2, 'b/s', 0, 7)",
            [],
        )
        .expect("partitions");
        for (msg, pid, first, last, payload) in [
            (1, 1, 1, 2, "fan"),
            (2, 1, 4, 4, "solo"),
            (3, 2, 7, 7, "other"),
        ] {
            conn.execute(
                "INSERT INTO outbox_messages VALUES (?1, ?2, ?3, ?4, ?5)",
                rusqlite::params![msg, pid, first, last, envelope(payload).encode()],
            )
            .expect("message");
        }
        for (pid, seq, msg, claim, replays, expiry) in [
            (1, 1, 1, Some(3), 0, None),
            (1, 2, 1, None, 2, None),
            (1, 4, 2, None, 0, Some(expires)),
            (2, 7, 3, None, 0, None),
        ] {
            let id = format!("id-{pid}-{seq}");
            insert_v2(&conn, (pid, seq, msg, &id), claim, replays, expiry);
        }
        path
    }

    /// A record row of layout 2: `(pid, seq, msg, id)`, claimed under
    /// `claim` or pending, with `replays` failures, expiring at `expiry`.
    fn insert_v2(
        conn: &Connection,
        row: (i64, i64, i64, &str),
        claim: Option<i64>,
        replays: i64,
        expiry: Option<i64>,
    ) {
        let (pid, seq, msg, id) = row;
        let at = unix_nanos(t(1)).expect("time");
        conn.execute(
            "INSERT INTO outbox_records VALUES (?1, ?2, ?3, ?4, 'x', 'out', ?5, ?6, ?7, ?8, ?9, \
             ?10, ?11, ?12, ?13)",
            rusqlite::params_from_iter(
                [
                    Value::from(pid),
                    seq.into(),
                    msg.into(),
                    id.to_owned().into(),
                    at.into(),
                    expiry.into(),
                ]
                .into_iter()
                .chain(state_columns(claim, replays, at)),
            ),
        )
        .expect("record");
    }

    /// A migration needs room for its copy of the records: under
    /// `max_size_bytes` without it, the store refuses to open as `full` and
    /// the file is left as it was.
    #[tokio::test]
    async fn a_migration_without_room_for_its_copy_is_refused_as_full() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let path = v2_file(&dir);
        {
            let conn = Connection::open(&path).expect("open");
            for seq in 8..1_008 {
                let id = format!("{seq:0>200}");
                insert_v2(&conn, (2, seq, 3, &id), None, 0, None);
            }
        }
        let size = std::fs::metadata(&path).expect("size").len();
        let options = SqliteOptions {
            max_size_bytes: Some(size),
            ..sqlite_options(&dir, "outbox.db")
        };
        let error = SqliteOutboxStore::open(options)
            .await
            .err()
            .expect("refused");
        assert!(matches!(error, StoreError::Full(_)), "{error}");
        assert_eq!(version_and_records(&dir), (2, 1_004));
    }

    /// A migrated record as the migration tests compare it: seq, id,
    /// payload, claim, replays, last error and expiry.
    type Summary = (
        u64,
        String,
        String,
        Option<(u64, String)>,
        u32,
        Option<String>,
        Option<std::time::SystemTime>,
    );

    fn summary(records: Vec<crate::stores::OutboxRecord>) -> Vec<Summary> {
        records
            .into_iter()
            .map(|r| {
                (
                    r.seq,
                    r.id,
                    String::from_utf8_lossy(&r.envelope.payload).into_owned(),
                    r.claim.map(|c| (c.version, c.owner)),
                    r.replay_count,
                    r.last_error,
                    r.expires_at,
                )
            })
            .collect()
    }

    #[tokio::test]
    async fn an_outbox_of_the_second_layout_is_migrated_when_opened() {
        let (_dir, path, store) = migrated(v2_file).await;
        let owner = Some((3, "old-owner".to_owned()));
        let refused = Some("refused".to_owned());
        assert_eq!(
            summary(store.dump("b/r").await.expect("dump")),
            vec![
                (1, "id-1-1".into(), "fan".into(), owner, 0, None, None),
                (2, "id-1-2".into(), "fan".into(), None, 2, refused, None),
                (
                    4,
                    "id-1-4".into(),
                    "solo".into(),
                    None,
                    0,
                    None,
                    Some(t(100))
                ),
            ]
        );
        assert_eq!(
            summary(store.dump("b/s").await.expect("dump")),
            vec![(7, "id-2-7".into(), "other".into(), None, 0, None, None)]
        );
        // The migrated claim is found once stale (in state 2, through its
        // index): it comes before the pending seqs 2 and 4.
        let stale = store.claim("b/r", "old-owner", 3, 1, t(1) + STALE).await;
        assert_eq!(stale.map(|r| r[0].seq), Ok(1));
        // Seqs go on from where they were, fences hold, and every
        // operation finds the migrated records by their seqs.
        let message = NewMessage::new(envelope("new"), t(2), vec![NewRecord::new("x", "out")]);
        assert_eq!(store.append("b/r", message).await, Ok(vec![5]));
        assert!(matches!(
            store.claim("b/r", "o", 2, 10, t(3)).await,
            Err(StoreError::Stale(_))
        ));
        let expired = store.expire("b/r", "o", 3, t(200), 10).await;
        assert_eq!(expired.map(|r| r.len()), Ok(1));
        let claimed = store.claim("b/r", "o", 4, 10, t(3)).await.expect("claim");
        let seqs: Vec<u64> = claimed.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, vec![1, 2, 4, 5]);
        assert_eq!(
            store.complete("b/r", 4, &[1, 2, 4, 5]).await,
            Ok(vec![1, 2, 4, 5])
        );
        assert_eq!(store.envelopes("b/r").await, Ok(0));
        assert_eq!(store.envelopes("b/s").await, Ok(1));
        store.close().await;

        let conn = Connection::open(&path).expect("reopen");
        let (version, old): (i64, i64) = conn
            .query_row(
                "SELECT (SELECT version FROM ferry_schema WHERE component='outbox'), \
                 (SELECT COUNT(*) FROM sqlite_master WHERE name LIKE '%_v2')",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .expect("state");
        assert_eq!((version, old), (6, 0), "layout 6, layout 2's table gone");
    }

    /// A file of layout 5: message 1 (seqs 1–3) with seq 1 completed, seq 2
    /// fresh in a run of version 3 and seq 3 released; message 2 (seqs 4, 5)
    /// with seq 4 in the run and seq 5 pending; message 3 (seq 6) pending.
    fn v5_file(dir: &tempfile::TempDir) -> std::path::PathBuf {
        let path = dir.path().join("outbox.db");
        let conn = Connection::open(&path).expect("open");
        conn.execute_batch(
            "CREATE TABLE ferry_schema (component TEXT PRIMARY KEY, version INTEGER NOT NULL) \
             WITHOUT ROWID; INSERT INTO ferry_schema VALUES ('outbox', 5);",
        )
        .expect("schema table");
        for ddl in [
            super::OUTBOX_PARTITIONS_AND_MESSAGES,
            super::OUTBOX_RECORDS_V3,
            super::OUTBOX_V3_TO_V4,
            super::OUTBOX_V4_TO_V5,
        ] {
            conn.execute_batch(ddl).expect("layout 5");
        }
        let key = |seq: i64| (1 << 40) | seq;
        let at = unix_nanos(t(1)).expect("time");
        conn.execute(
            "INSERT INTO outbox_partitions VALUES (1, 'b/r', 3, 6, ?1)",
            [key(4)],
        )
        .expect("partition");
        for (msg, first, last, payload) in [(7, 1, 3, "fan"), (8, 4, 5, "two"), (9, 6, 6, "one")] {
            conn.execute(
                "INSERT INTO outbox_messages VALUES (?1, 1, ?2, ?3, ?4)",
                rusqlite::params![msg, first, last, envelope(payload).encode()],
            )
            .expect("message");
        }
        for (seq, msg, binding, state, replays) in [
            (2, 7, "y", 3, 0),
            (3, 7, "z", 0, 1),
            (4, 8, "x", 3, 0),
            (5, 8, "y", 3, 0),
            (6, 9, "x", 3, 0),
        ] {
            let error = (replays > 0).then_some("refused");
            conn.execute(
                "INSERT INTO outbox_records (key, msg, id, binding, address, created_at_ns, \
                 state, replay_count, last_error) VALUES (?1, ?2, ?3, ?4, 'out', ?5, ?6, ?7, ?8)",
                rusqlite::params![
                    key(seq),
                    msg,
                    format!("id-{seq}"),
                    binding,
                    at,
                    state,
                    replays,
                    error
                ],
            )
            .expect("record");
        }
        conn.execute(
            "INSERT INTO outbox_claims VALUES (?1, ?2, 3, 'o', ?3)",
            [key(1), key(4), at],
        )
        .expect("run");
        path
    }

    /// Layout 5's fresh records lose their rows and are found through their
    /// messages, with the claims of their runs; a record completed earlier
    /// stays completed; the run goes with its last fresh record.
    #[tokio::test]
    async fn an_outbox_of_the_fifth_layout_is_migrated_when_opened() {
        let (_dir, path, store) = migrated(v5_file).await;
        let dumped = store.dump("b/r").await.expect("dump");
        let bindings: Vec<&str> = dumped.iter().map(|r| &*r.binding).collect();
        assert_eq!(bindings, ["y", "z", "x", "y", "x"]);
        let run = || Some((3, "o".to_owned()));
        let refused = Some("refused".to_owned());
        assert_eq!(
            summary(dumped),
            vec![
                (2, "id-2".into(), "fan".into(), run(), 0, None, None),
                (3, "id-3".into(), "fan".into(), None, 1, refused, None),
                (4, "id-4".into(), "two".into(), run(), 0, None, None),
                (5, "id-5".into(), "two".into(), None, 0, None, None),
                (6, "id-6".into(), "one".into(), None, 0, None, None),
            ]
        );
        let stats = store.stats("b/r").await.expect("stats");
        assert_eq!((stats.total.depth, stats.total.claimed), (5, 2));
        assert_eq!(store.complete("b/r", 3, &[1, 2, 4]).await, Ok(vec![2, 4]));
        let claimed = store.claim("b/r", "o", 3, 10, t(2)).await.expect("claim");
        let seqs: Vec<u64> = claimed.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, vec![3, 5, 6]);
        assert_eq!(store.complete("b/r", 3, &seqs).await, Ok(vec![3, 5, 6]));
        assert_eq!(store.envelopes("b/r").await, Ok(0));
        store.close().await;

        let conn = Connection::open(&path).expect("reopen");
        let left: (i64, i64, i64, i64) = conn
            .query_row(
                "SELECT (SELECT version FROM ferry_schema WHERE component='outbox'), \
                 (SELECT COUNT(*) FROM outbox_records), (SELECT COUNT(*) FROM outbox_done), \
                 (SELECT COUNT(*) FROM outbox_claims)",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .expect("state");
        assert_eq!(left, (6, 0, 0, 0), "layout 6, nothing left");
    }

    /// A record whose seq does not fit in a key stops the migration before
    /// it changes anything.
    #[tokio::test]
    async fn a_seq_too_large_for_a_key_stops_the_migration() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let path = v2_file(&dir);
        Connection::open(&path)
            .expect("open")
            .execute("UPDATE outbox_records SET seq = 1 << 40 WHERE seq = 7", [])
            .expect("a seq past 2^40");
        refused_unchanged(&dir, "layout 3: 1 rows", (2, 4)).await;
    }

    #[tokio::test]
    async fn an_outbox_of_a_newer_layout_is_refused() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let path = dir.path().join("outbox.db");
        Connection::open(&path)
            .expect("open")
            .execute_batch(
                "CREATE TABLE ferry_schema (component TEXT PRIMARY KEY, version INTEGER NOT NULL);
                 INSERT INTO ferry_schema VALUES ('outbox', 7);",
            )
            .expect("newer schema");
        let error = SqliteOutboxStore::open(sqlite_options(&dir, "outbox.db"))
            .await
            .err()
            .expect("refused");
        assert!(
            error
                .to_string()
                .contains("outbox schema version 7 was written by a newer"),
            "{error}"
        );
    }

    /// A fresh record of layout 5 keeps its expiry through the migration.
    #[tokio::test]
    async fn a_migrated_fresh_record_keeps_its_expiry() {
        fn expiring(dir: &tempfile::TempDir) -> std::path::PathBuf {
            let path = v5_file(dir);
            let at = unix_nanos(t(5)).expect("time");
            Connection::open(&path)
                .expect("open")
                .execute(
                    "UPDATE outbox_records SET expires_at_ns=?1 WHERE msg=9",
                    [at],
                )
                .expect("an expiry");
            path
        }
        let (_dir, _path, store) = migrated(expiring).await;
        let dumped = store.dump("b/r").await.expect("dump");
        let six = dumped.iter().find(|r| r.seq == 6).expect("seq 6");
        assert_eq!(six.expires_at, Some(t(5)));
        let expired = store
            .expire("b/r", "o", 3, t(10), 10)
            .await
            .expect("expire");
        assert_eq!(expired.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![6]);
    }
}
