//! SQLite backends: a single durable node.
//!
//! Each store opens its own database (the same file may back several
//! stores; their tables do not overlap). A store has one writer thread
//! owning the write connection ([`writer`]: group commit, answers after
//! `COMMIT`), with `synchronous=FULL` a thread syncing the WAL after the
//! writer's commits ([`syncer`]: durable writes answered after the sync),
//! and one read connection used from the blocking pool, so reads never wait
//! for a group to commit. The database runs in WAL mode with
//! `synchronous=FULL` by default: an acknowledged write is on disk even if
//! the machine loses power; `NORMAL` keeps it across a process crash only.
//!
//! Free pages go back to the file system when the writer is idle
//! ([`vacuum`]: incremental auto-vacuum, WAL truncation), so a store shrinks
//! back after a backlog drains.
//!
//! Times are stored as nanoseconds since the Unix epoch (exact round trips);
//! envelopes as [`Envelope::encode`](ferry_shared::envelope::Envelope::encode).

mod dlq;
mod lease;
mod outbox;
mod record_list;
mod schema;
mod syncer;
mod vacuum;
mod writer;

pub use dlq::SqliteDlqStore;
pub use lease::SqliteLeaseStore;
pub use outbox::SqliteOutboxStore;
#[cfg(any(test, feature = "conformance"))]
pub use outbox::stats_of_file;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rusqlite::config::DbConfig;
use rusqlite::{Connection, ErrorCode, OpenFlags};

use super::{StoreError, StoreResult};
pub(crate) use writer::Batch;
use writer::{PageLimit, Writer};

/// Prepared statements kept per connection: more than the stores use, so a
/// statement is parsed once per connection.
const STATEMENT_CACHE: usize = 64;

/// How hard SQLite syncs a commit to disk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Synchronous {
    /// A commit that stores a message is synced before it is answered:
    /// survives power loss.
    #[default]
    Full,
    /// fsync at checkpoints only: survives a process crash, not power loss.
    Normal,
}

/// How to open a SQLite store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SqliteOptions {
    /// The database file; created if missing.
    pub path: PathBuf,
    /// Commit durability (default `Full`).
    pub synchronous: Synchronous,
    /// How long a connection waits for another one's lock before failing
    /// with `Timeout` (default 5 s).
    pub busy_timeout: Duration,
    /// Outbox only: how old an owner's claim must be before `claim` gives it
    /// back to the same owner (default 30 s).
    pub stale_claim_duration: Duration,
    /// The largest the database file may grow (`max_page_count`); a write
    /// that needs more fails with [`StoreError::Full`]. Synced writes
    /// (appends, DLQ puts) stop an eighth below it, so that drain writes
    /// still fit (see [`writer`]). `None`: no limit.
    pub max_size_bytes: Option<u64>,
}

impl SqliteOptions {
    /// Options for `path` with the defaults.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        SqliteOptions {
            path: path.into(),
            synchronous: Synchronous::Full,
            busy_timeout: Duration::from_secs(5),
            stale_claim_duration: Duration::from_secs(30),
            max_size_bytes: None,
        }
    }
}

/// Maps a SQLite error: a lock wait that ran out is `Timeout`; a full disk
/// or size limit is `Full` (SQLite rolled the transaction back); anything
/// else is `Unavailable` (the caller cannot know more).
pub(crate) fn sql_error(e: rusqlite::Error) -> StoreError {
    match e.sqlite_error_code() {
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => {
            StoreError::Timeout(format!("sqlite: {e}"))
        }
        Some(ErrorCode::DiskFull) => StoreError::Full(format!("sqlite: {e}")),
        _ => StoreError::Unavailable(format!("sqlite: {e}")),
    }
}

/// An integer column as the unsigned value it was stored from.
pub(crate) fn to_u64(n: i64) -> StoreResult<u64> {
    u64::try_from(n).map_err(|_| StoreError::Corrupt(format!("negative value {n}")))
}

/// An unsigned value as an integer column.
pub(crate) fn to_i64(n: u64) -> StoreResult<i64> {
    i64::try_from(n).map_err(|_| StoreError::Invalid(format!("value {n} exceeds i64")))
}

fn connect(options: &SqliteOptions) -> StoreResult<Connection> {
    let conn = Connection::open_with_flags(
        &options.path,
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(sql_error)?;
    conn.busy_timeout(options.busy_timeout).map_err(sql_error)?;
    // Plans do not depend on bound values (query planner stability): without
    // it SQLite re-prepares a statement whenever a bound value it looked at
    // while planning changes — every claim, as `now` always does.
    conn.set_db_config(DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true)
        .map_err(sql_error)?;
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    let sync = match options.synchronous {
        Synchronous::Full => "FULL",
        Synchronous::Normal => "NORMAL",
    };
    // Before WAL: switching to WAL writes the file's first page, after which
    // the mode only changes with a VACUUM (a whole rewrite at every first
    // open). On an existing file this changes nothing; `vacuum` converts it.
    conn.execute_batch("PRAGMA auto_vacuum=INCREMENTAL")
        .map_err(sql_error)?;
    // journal_mode returns a row, so it is queried rather than executed.
    let mode: String = conn
        .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
        .map_err(sql_error)?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Unavailable(format!(
            "{}: cannot enable WAL (journal mode is {mode})",
            options.path.display()
        )));
    }
    conn.execute_batch(&format!(
        "PRAGMA synchronous={sync}; PRAGMA foreign_keys=OFF;"
    ))
    .map_err(sql_error)?;
    if let Some(bytes) = options.max_size_bytes {
        let page_size: i64 = conn
            .query_row("PRAGMA page_size", [], |r| r.get(0))
            .map_err(sql_error)?;
        let pages = (bytes / to_u64(page_size)?.max(1)).max(1);
        // Returns the limit in force (never below the current size).
        let _: i64 = conn
            .query_row(&format!("PRAGMA max_page_count={pages}"), [], |r| r.get(0))
            .map_err(sql_error)?;
    }
    Ok(conn)
}

/// The writer and the read connection of one store.
pub(crate) struct Db {
    writer: Writer,
    reader: Arc<Mutex<Connection>>,
}

impl Db {
    /// Opens (creating if needed) the database, applies `schema` on the
    /// write connection and starts the writer. Blocking work runs on the
    /// blocking pool.
    pub(crate) async fn open(
        options: SqliteOptions,
        name: &'static str,
        schema: fn(&Connection) -> StoreResult<()>,
    ) -> StoreResult<Self> {
        let full = options.synchronous == Synchronous::Full;
        let (write, read, limit) = tokio::task::spawn_blocking(move || {
            let write = connect(&options)?;
            // Before the first table: the file shrinks after a backlog.
            vacuum::enable_incremental(&write, &options.path)?;
            schema(&write)?;
            let read = connect(&options)?;
            let limit = match options.max_size_bytes {
                Some(_) => {
                    let pages: i64 = write
                        .query_row("PRAGMA max_page_count", [], |r| r.get(0))
                        .map_err(sql_error)?;
                    Some(PageLimit(to_u64(pages)?))
                }
                None => None,
            };
            Ok::<_, StoreError>((write, read, limit))
        })
        .await
        .map_err(|e| StoreError::Unavailable(format!("open task failed: {e}")))??;
        Ok(Db {
            writer: Writer::start(write, name, full, limit)?,
            reader: Arc::new(Mutex::new(read)),
        })
    }

    /// Runs `work` in the writer's next group transaction; durable (as the
    /// store's `synchronous` setting makes it) when it returns.
    pub(crate) async fn write<T, F>(&self, work: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    {
        self.writer.execute(true, work).await
    }

    /// Like [`Db::write`], but the commit need not be fsynced: it is atomic,
    /// visible and survives a process crash, but a power loss may take it
    /// back (with whatever was committed after the last durable write). Only
    /// for writes whose loss repeats work and loses nothing.
    pub(crate) async fn write_unsynced<T, F>(&self, work: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    {
        self.writer.execute(false, work).await
    }

    /// The writer's group numbers and how far they are durable.
    pub(crate) fn durability(&self) -> Arc<syncer::Durability> {
        self.writer.durability()
    }

    /// Runs `item` in `batch`'s next job ([`writer::Batch`]): as
    /// [`Db::write`] or [`Db::write_unsynced`], as the batch was made.
    pub(crate) async fn write_batched<I, T>(
        &self,
        batch: &Arc<Batch<I, T>>,
        item: I,
    ) -> StoreResult<T>
    where
        I: Send + 'static,
        T: Send + 'static,
    {
        self.writer.execute_batched(batch, item).await
    }

    /// Runs `work` on the read connection, in one read transaction, on the
    /// blocking pool.
    pub(crate) async fn read<T, F>(&self, work: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    {
        let reader = Arc::clone(&self.reader);
        tokio::task::spawn_blocking(move || {
            let conn = reader
                .lock()
                .map_err(|_| StoreError::Unavailable("sqlite reader poisoned".into()))?;
            conn.execute_batch("BEGIN").map_err(sql_error)?;
            let out = work(&conn);
            // A read transaction changes nothing; ending it cannot lose
            // data, but it must end so the next read sees new commits.
            if conn.execute_batch("COMMIT").is_err() {
                let _ = conn.execute_batch("ROLLBACK");
            }
            out
        })
        .await
        .map_err(|e| StoreError::Unavailable(format!("read task failed: {e}")))?
    }

    /// Transactions the writer has committed.
    pub(crate) fn commits(&self) -> u64 {
        self.writer.commits()
    }

    /// Waits for the writer to finish what it was sent, then closes both
    /// connections.
    pub(crate) async fn close(self) {
        self.writer.close().await;
    }
}

#[cfg(test)]
mod tests {
    use prost::bytes::Bytes;

    use super::*;
    use crate::stores::conformance::{envelope, sqlite_options, t};
    use crate::stores::{NewMessage, NewRecord, OutboxStore, Release};

    /// A message for binding `x` with a payload of `kib` KiB.
    fn message(name: &str, kib: usize) -> NewMessage {
        let mut e = envelope(name);
        e.payload = Bytes::from(vec![b'x'; kib * 1024]);
        NewMessage::new(e, t(0), vec![NewRecord::new("x", "out")])
    }

    fn big_record(i: usize) -> NewMessage {
        message(&format!("m{i}"), 16)
    }

    /// `max_size_bytes` is a full disk the tests can make: an append that
    /// does not fit fails as `Full`, writes nothing, and reopening with room
    /// lets the same append through.
    #[tokio::test]
    async fn an_append_past_max_size_fails_as_full_and_writes_nothing() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let limited = SqliteOptions {
            max_size_bytes: Some(128 * 1024),
            ..sqlite_options(&dir, "outbox.db")
        };
        let store = SqliteOutboxStore::open(limited.clone())
            .await
            .expect("open");
        let mut appended = 0;
        let error = loop {
            match store.append("p", big_record(appended)).await {
                Ok(_) => appended += 1,
                Err(e) => break e,
            }
            assert!(appended < 100, "the size limit never applied");
        };
        assert!(matches!(error, StoreError::Full(_)), "{error:?}");
        assert!(error.outcome_known());
        let stats = store.stats("p").await.expect("stats");
        assert_eq!(stats.total.depth, appended as u64);
        store.close().await;

        let store = SqliteOutboxStore::open(SqliteOptions {
            max_size_bytes: None,
            ..limited
        })
        .await
        .expect("reopen");
        store
            .append("p", big_record(appended))
            .await
            .expect("room again");
        let stats = store.stats("p").await.expect("stats");
        assert_eq!(stats.total.depth, appended as u64 + 1);
        store.close().await;
    }

    /// Appends made together into a store that fills up share batches, and
    /// SQLite rolls a whole transaction back when one of them does not fit:
    /// exactly the appends answered `Ok` are stored, whatever the others of
    /// their batch and group were answered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn appends_made_together_into_a_filling_store_are_ok_exactly_when_stored() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let limited = SqliteOptions {
            max_size_bytes: Some(256 * 1024),
            ..sqlite_options(&dir, "outbox.db")
        };
        let store = SqliteOutboxStore::open(limited).await.expect("open");
        let (mut stored, mut full) = (0u64, false);
        for round in 0..40 {
            let appends = (0..8).map(|i| store.append("p", message(&format!("r{round}-{i}"), 12)));
            for result in futures::future::join_all(appends).await {
                match result {
                    Ok(_) => stored += 1,
                    Err(e) => full |= matches!(e, StoreError::Full(_)),
                }
            }
            if full {
                break;
            }
        }
        assert!(full, "the size limit never applied");
        let stats = store.stats("p").await.expect("stats");
        assert_eq!(stats.total.depth, stored);
        store.close().await;
    }

    /// A full outbox drains: claims (which grow the record rows they mark)
    /// and completions still fit once appends no longer do, so room comes
    /// back and appends go on.
    #[tokio::test]
    async fn a_full_outbox_still_claims_and_completes() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let limited = SqliteOptions {
            max_size_bytes: Some(128 * 1024),
            ..sqlite_options(&dir, "outbox.db")
        };
        let store = SqliteOutboxStore::open(limited).await.expect("open");
        let mut appended = 0u64;
        loop {
            match store.append("p", message(&format!("m{appended}"), 1)).await {
                Ok(_) => appended += 1,
                Err(StoreError::Full(_)) => break,
                Err(e) => panic!("{e}"),
            }
            assert!(appended < 1000, "the size limit never applied");
        }
        // Sends fail (their errors are stored), a restart takes everything
        // back under a new version, and then the records are delivered.
        let owner = "a-drainer-with-a-long-owner-id/bridge/route";
        let mut seqs = Vec::new();
        for version in 1..=3 {
            let claimed = store
                .claim("p", owner, version, 500, t(version))
                .await
                .expect("claim when full");
            assert_eq!(claimed.len() as u64, appended);
            seqs = claimed.iter().map(|r| r.seq).collect();
            let failed = Release::Failed {
                error: format!("connection refused by the destination {}", "x".repeat(200)),
                attempted_at: t(version),
            };
            let released = store
                .release("p", version, &seqs[..seqs.len() / 2], failed)
                .await;
            assert_eq!(released.expect("release when full").len(), seqs.len() / 2);
        }
        store.claim("p", owner, 4, 500, t(4)).await.expect("claim");
        assert_eq!(store.complete("p", 4, &seqs).await, Ok(seqs));
        store
            .append("p", message("after", 1))
            .await
            .expect("room again");
        store.close().await;
    }

    fn file_bytes(dir: &tempfile::TempDir, name: &str) -> u64 {
        ["", "-wal"]
            .iter()
            .filter_map(|suffix| std::fs::metadata(dir.path().join(format!("{name}{suffix}"))).ok())
            .map(|m| m.len())
            .sum()
    }

    /// A backlog of 3 000 records of 4 KiB grows the file past 12 MB; once
    /// they are drained (claimed and completed) the idle writer gives the
    /// space back: the database and its WAL end below 2 MB.
    #[tokio::test]
    async fn the_outbox_file_shrinks_back_after_a_backlog_drains() {
        const RECORDS: usize = 3_000;
        let dir = tempfile::tempdir().expect("temporary directory");
        let store = SqliteOutboxStore::open(sqlite_options(&dir, "outbox.db"))
            .await
            .expect("open");
        for chunk in 0..RECORDS / 100 {
            // A hundred at once share a commit (group commit).
            let appends = (0..100).map(|i| store.append("p", message(&format!("m{chunk}-{i}"), 4)));
            futures::future::try_join_all(appends)
                .await
                .expect("append");
        }
        let grown = file_bytes(&dir, "outbox.db");
        assert!(grown > 12_000_000, "the backlog took {grown} bytes");
        loop {
            let claimed = store.claim("p", "o", 1, 500, t(1)).await.expect("claim");
            if claimed.is_empty() {
                break;
            }
            let seqs: Vec<u64> = claimed.iter().map(|r| r.seq).collect();
            store.complete("p", 1, &seqs).await.expect("complete");
        }
        assert_eq!(store.stats("p").await.expect("stats").total.depth, 0);
        // The writer shrinks when idle, after the last completion; wait for
        // it with a deadline.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut size = file_bytes(&dir, "outbox.db");
        while size > 2_000_000 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
            size = file_bytes(&dir, "outbox.db");
        }
        assert!(
            size <= 2_000_000,
            "{size} bytes left after draining {grown}"
        );
        store.close().await;
    }

    /// A new database is created in incremental auto-vacuum mode, not
    /// converted by a `VACUUM` after its first page is written.
    #[test]
    fn a_new_database_starts_in_incremental_auto_vacuum() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let conn = connect(&sqlite_options(&dir, "new.db")).expect("connect");
        let mode: i64 = conn
            .query_row("PRAGMA auto_vacuum", [], |r| r.get(0))
            .expect("auto_vacuum");
        assert_eq!(mode, 2, "incremental before any table or VACUUM");
    }

    /// An existing database without incremental auto-vacuum is converted
    /// once when it is opened.
    #[tokio::test]
    async fn an_existing_database_is_converted_to_incremental_auto_vacuum() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let path = dir.path().join("old.db");
        {
            let conn = Connection::open(&path).expect("open");
            conn.execute_batch("PRAGMA auto_vacuum=NONE; CREATE TABLE legacy (x INTEGER);")
                .expect("legacy schema");
        }
        let store = SqliteOutboxStore::open(sqlite_options(&dir, "old.db"))
            .await
            .expect("open");
        store.close().await;
        let conn = Connection::open(&path).expect("reopen");
        let mode: i64 = conn
            .query_row("PRAGMA auto_vacuum", [], |r| r.get(0))
            .expect("auto_vacuum");
        assert_eq!(mode, 2, "incremental");
    }
}
