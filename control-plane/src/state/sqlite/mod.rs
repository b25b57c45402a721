//! The embedded state store: one SQLite file.
//!
//! One connection lives on its own thread; async callers send it closures
//! over a bounded channel and await the answer, so no SQLite call ever runs
//! on the async runtime. WAL journal, `synchronous = FULL` (a write is on
//! disk when its future resolves), a busy timeout for a second process on
//! the same file, and `BEGIN IMMEDIATE` for every write transaction, so the
//! read-decide-write of a version happens under the database's write lock.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rusqlite::{Connection, ErrorCode, TransactionBehavior};
use tokio::sync::{mpsc, oneshot};

use super::error::{StateError, StateResult};

mod agents;
mod configs;
mod dlq;
mod leases;
mod metrics;
mod query;
mod store;

use query::{exec, query_all, query_opt};

/// Schema migrations, in order; the schema version is the number applied.
const MIGRATIONS: &[&str] = &[include_str!("schema_v1.sql"), include_str!("schema_v2.sql")];

/// How long a write waits for another process holding the file's lock.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// How many requests may wait for the connection thread.
const QUEUE_DEPTH: usize = 256;

type Job = Box<dyn FnOnce(&mut Connection) + Send>;

/// The SQLite [`StateStore`].
pub struct SqliteStore {
    jobs: mpsc::Sender<Job>,
    closed: oneshot::Receiver<()>,
    path: PathBuf,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .finish()
    }
}

impl SqliteStore {
    /// Opens (creating if missing) the store at `path` and brings its schema
    /// up to date. The parent directory must exist.
    pub async fn open(path: impl AsRef<Path>) -> StateResult<Self> {
        let path = path.as_ref().to_path_buf();
        let (jobs, mut queue) = mpsc::channel::<Job>(QUEUE_DEPTH);
        let (opened_tx, opened) = oneshot::channel();
        let (closed_tx, closed) = oneshot::channel();
        let thread_path = path.clone();
        std::thread::Builder::new()
            .name("ferry-state-sqlite".into())
            .spawn(move || {
                let mut conn = match open_connection(&thread_path) {
                    Ok(conn) => {
                        // The opener may have given up waiting; then there is
                        // nobody to serve and the thread just ends.
                        let _ = opened_tx.send(Ok(()));
                        conn
                    }
                    Err(e) => {
                        let _ = opened_tx.send(Err(e));
                        return;
                    }
                };
                while let Some(job) = queue.blocking_recv() {
                    job(&mut conn);
                }
                drop(conn);
                // Nobody may be waiting for the close; that is fine.
                let _ = closed_tx.send(());
            })
            .map_err(|e| StateError::Unavailable(format!("starting the sqlite thread: {e}")))?;
        opened.await.map_err(|_| {
            StateError::Unavailable("the sqlite thread died while opening".into())
        })??;
        Ok(Self { jobs, closed, path })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Closes the connection once every queued request is answered.
    pub async fn close(self) {
        let Self { jobs, closed, .. } = self;
        drop(jobs);
        // An error only means the thread is already gone.
        let _ = closed.await;
    }

    /// Runs `work` on the connection thread.
    async fn call<T: Send + 'static>(
        &self,
        work: impl FnOnce(&mut Connection) -> StateResult<T> + Send + 'static,
    ) -> StateResult<T> {
        let (answer_tx, answer) = oneshot::channel();
        let job: Job = Box::new(move |conn| {
            // The caller may have been cancelled; the work is done anyway.
            let _ = answer_tx.send(work(conn));
        });
        self.jobs
            .send(job)
            .await
            .map_err(|_| StateError::Unavailable("the sqlite store is closed".into()))?;
        answer.await.map_err(|_| {
            StateError::Unavailable("the sqlite thread stopped during the operation".into())
        })?
    }

    /// Runs `work` in a `BEGIN IMMEDIATE` transaction on the connection
    /// thread; commits when it returns `Ok`, rolls back otherwise.
    async fn write<T: Send + 'static>(
        &self,
        work: impl FnOnce(&rusqlite::Transaction<'_>) -> StateResult<T> + Send + 'static,
    ) -> StateResult<T> {
        self.call(move |conn| {
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(db_err)?;
            let out = work(&tx)?;
            tx.commit().map_err(db_err)?;
            Ok(out)
        })
        .await
    }
}

fn open_connection(path: &Path) -> StateResult<Connection> {
    let mut conn = Connection::open(path).map_err(db_err)?;
    conn.busy_timeout(BUSY_TIMEOUT).map_err(db_err)?;
    conn.pragma_update(None, "journal_mode", "WAL")
        .map_err(db_err)?;
    conn.pragma_update(None, "synchronous", "FULL")
        .map_err(db_err)?;
    conn.pragma_update(None, "foreign_keys", "ON")
        .map_err(db_err)?;
    migrate(&mut conn)?;
    Ok(conn)
}

fn migrate(conn: &mut Connection) -> StateResult<()> {
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(db_err)?;
    tx.execute_batch("CREATE TABLE IF NOT EXISTS ferry_schema (version INTEGER NOT NULL);")
        .map_err(db_err)?;
    let applied: i64 = tx
        .query_row(
            "SELECT COALESCE(MAX(version), 0) FROM ferry_schema",
            [],
            |r| r.get(0),
        )
        .map_err(db_err)?;
    let applied = usize::try_from(applied)
        .map_err(|_| StateError::corrupt(format!("schema version {applied}")))?;
    if applied > MIGRATIONS.len() {
        return Err(StateError::invalid(format!(
            "the state database has schema version {applied}, newer than this build ({})",
            MIGRATIONS.len()
        )));
    }
    for (index, sql) in MIGRATIONS.iter().enumerate().skip(applied) {
        tx.execute_batch(sql).map_err(db_err)?;
        tx.execute(
            "INSERT INTO ferry_schema (version) VALUES (?1)",
            [index as i64 + 1],
        )
        .map_err(db_err)?;
    }
    tx.commit().map_err(db_err)
}

/// Maps a SQLite error to what is known about the operation.
pub(super) fn db_err(error: rusqlite::Error) -> StateError {
    match error.sqlite_error_code() {
        Some(ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase) => {
            StateError::Corrupt(error.to_string())
        }
        _ => StateError::Unavailable(format!("sqlite: {error}")),
    }
}

#[cfg(test)]
mod tests {
    use super::SqliteStore;
    use crate::state::conformance::{TestBackend, state_store_suite};

    /// A fresh database file in a temporary directory.
    struct SqliteBackend {
        dir: tempfile::TempDir,
    }

    impl TestBackend for SqliteBackend {
        type Store = SqliteStore;

        async fn create() -> Self {
            Self {
                dir: tempfile::tempdir().expect("temporary directory"),
            }
        }

        async fn open(&self) -> SqliteStore {
            SqliteStore::open(self.dir.path().join("state.db"))
                .await
                .expect("open sqlite store")
        }

        fn schema_v1(&self) -> &'static str {
            super::MIGRATIONS[0]
        }

        async fn execute_raw(&self, sql: &str) {
            rusqlite::Connection::open(self.dir.path().join("state.db"))
                .and_then(|conn| conn.execute_batch(sql))
                .expect("raw sqlite statements");
        }
    }

    state_store_suite!(SqliteBackend);
}
