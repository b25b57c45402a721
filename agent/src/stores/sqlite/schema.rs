//! Table definitions. Each store owns its tables and records its schema
//! version in `ferry_schema` (not `user_version`, because several stores may
//! share one file). A database written by a newer build is refused rather
//! than misread.

use rusqlite::{Connection, OptionalExtension, params};

use super::sql_error;
use crate::stores::{StoreError, StoreResult};

const OUTBOX_V1: &str = "
CREATE TABLE IF NOT EXISTS outbox_partitions (
    partition TEXT PRIMARY KEY,
    -- the fencing high-water mark
    hwm       INTEGER NOT NULL,
    -- the last seq assigned; seqs are never reused
    last_seq  INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS outbox_records (
    partition           TEXT    NOT NULL,
    seq                 INTEGER NOT NULL,
    id                  TEXT    NOT NULL,
    binding             TEXT    NOT NULL,
    address             TEXT    NOT NULL,
    envelope            BLOB    NOT NULL,
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
    PRIMARY KEY (partition, seq)
);
-- claim: pending (or own stale) records of a partition in seq order
CREATE INDEX IF NOT EXISTS outbox_records_state ON outbox_records (partition, state, seq);
CREATE INDEX IF NOT EXISTS outbox_records_expiry ON outbox_records (partition, expires_at_ns)
    WHERE expires_at_ns IS NOT NULL;
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

/// Creates or checks the outbox tables.
pub(super) fn outbox(conn: &Connection) -> StoreResult<()> {
    ensure(conn, "outbox", 1, OUTBOX_V1)
}

/// Creates or checks the lease table.
pub(super) fn lease(conn: &Connection) -> StoreResult<()> {
    ensure(conn, "lease", 1, LEASE_V1)
}

/// Creates or checks the DLQ table.
pub(super) fn dlq(conn: &Connection) -> StoreResult<()> {
    ensure(conn, "dlq", 1, DLQ_V1)
}

fn ensure(conn: &Connection, component: &str, version: i64, ddl: &str) -> StoreResult<()> {
    conn.execute_batch("BEGIN IMMEDIATE").map_err(sql_error)?;
    let result = create(conn, component, version, ddl);
    let end = if result.is_ok() { "COMMIT" } else { "ROLLBACK" };
    conn.execute_batch(end).map_err(sql_error)?;
    result
}

fn create(conn: &Connection, component: &str, version: i64, ddl: &str) -> StoreResult<()> {
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
        Some(v) => Err(StoreError::Invalid(format!(
            "{component} schema version {v} is not {version}, the version this build knows"
        ))),
        None => {
            conn.execute_batch(ddl).map_err(sql_error)?;
            conn.execute(
                "INSERT INTO ferry_schema (component, version) VALUES (?1, ?2)",
                params![component, version],
            )
            .map_err(sql_error)?;
            Ok(())
        }
    }
}
