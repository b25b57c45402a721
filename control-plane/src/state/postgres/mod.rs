//! The shared state store: a PostgreSQL database that several control-plane
//! replicas use at once.
//!
//! Every write runs in one READ COMMITTED transaction that first locks the
//! row it decides on (`SELECT ... FOR UPDATE`; for leases the row is
//! created first with `INSERT ... ON CONFLICT DO NOTHING`, so there is always
//! a row to lock), then decides with the shared rules and writes. Two
//! replicas deciding on one key therefore run one after the other. The one
//! race a lock cannot cover — two replicas creating the same configuration
//! at once — ends in a unique violation for one of them, which is retried
//! like serialization failures and deadlocks: the whole transaction again, a
//! bounded number of times. A failure while committing is reported as
//! `Unavailable` (it may or may not have been applied).
//!
//! TLS: `sslmode=disable` and `prefer` connect without TLS;
//! `sslmode=require` is refused for now (the connector is chosen in one place,
//! [`PostgresStore::connect`], where `tokio-postgres-rustls` will plug in).

use std::str::FromStr;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::NoTls;
use tokio_postgres::config::SslMode;
use tokio_postgres::error::SqlState;

use super::error::{StateError, StateResult};

/// Schema migrations, in order; the schema version is the number applied.
const MIGRATIONS: &[&str] = &[include_str!("schema_v1.sql"), include_str!("schema_v2.sql")];

/// Serializes schema migrations of replicas starting at once.
const MIGRATION_LOCK: i64 = 0x0046_6572_7279; // "Ferry"

/// How often a transaction is tried when it loses a race.
pub(super) const MAX_ATTEMPTS: u32 = 8;

/// Connections per store.
const POOL_SIZE: usize = 16;

/// How long to wait for a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The PostgreSQL [`StateStore`].
#[derive(Clone)]
pub struct PostgresStore {
    pool: Pool,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("status", &self.pool.status())
            .finish()
    }
}

/// The outcome of one step inside a transaction: a database error (maybe
/// retryable) or a decided domain error.
pub(super) enum TxError {
    Db(tokio_postgres::Error),
    State(StateError),
}

impl From<tokio_postgres::Error> for TxError {
    fn from(error: tokio_postgres::Error) -> Self {
        Self::Db(error)
    }
}

impl From<StateError> for TxError {
    fn from(error: StateError) -> Self {
        Self::State(error)
    }
}

impl From<TxError> for StateError {
    fn from(error: TxError) -> Self {
        match error {
            TxError::Db(e) => db_err(e),
            TxError::State(e) => e,
        }
    }
}

pub(super) type TxResult<T> = Result<T, TxError>;

impl PostgresStore {
    /// Connects to the database a `postgres://` URL names (libpq syntax) and
    /// brings its schema up to date.
    pub async fn connect(url: &str) -> StateResult<Self> {
        let config = tokio_postgres::Config::from_str(url)
            .map_err(|e| StateError::invalid(format!("postgres url: {e}")))?;
        if config.get_ssl_mode() == SslMode::Require {
            return Err(StateError::invalid(
                "postgres url: sslmode=require is not supported yet; use sslmode=disable",
            ));
        }
        let manager = Manager::from_config(
            config,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(POOL_SIZE)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(CONNECT_TIMEOUT))
            .create_timeout(Some(CONNECT_TIMEOUT))
            .build()
            .map_err(|e| StateError::invalid(format!("postgres pool: {e}")))?;
        let store = Self { pool };
        store.migrate().await?;
        Ok(store)
    }

    async fn client(&self) -> StateResult<deadpool_postgres::Object> {
        self.pool
            .get()
            .await
            .map_err(|e| StateError::Unavailable(format!("postgres connection: {e}")))
    }

    async fn migrate(&self) -> StateResult<()> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(db_err)?;
        tx.batch_execute("CREATE TABLE IF NOT EXISTS ferry_schema (version BIGINT NOT NULL)")
            .await
            .map_err(db_err)?;
        let applied: i64 = tx
            .query_one("SELECT COALESCE(MAX(version), 0) FROM ferry_schema", &[])
            .await
            .and_then(|row| row.try_get(0))
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
            tx.batch_execute(sql).await.map_err(db_err)?;
            let version = index as i64 + 1;
            tx.execute(
                "INSERT INTO ferry_schema (version) VALUES ($1)",
                &[&version],
            )
            .await
            .map_err(db_err)?;
        }
        tx.commit().await.map_err(db_err)
    }
}

/// Runs `$body` (an expression using `$tx: &tokio_postgres::Transaction`
/// and returning a `TxResult` future) in a transaction and commits it; runs
/// it again in a new transaction when it lost a race, at most
/// [`MAX_ATTEMPTS`] times. (A macro rather than a function taking an async
/// closure: the resulting futures must be `Send` for `StoreFuture`.)
macro_rules! in_transaction {
    ($store:expr, |$tx:ident| $body:expr) => {{
        let mut attempt = 1;
        loop {
            let mut client = $store.client().await?;
            let $tx = client.transaction().await.map_err(db_err)?;
            let outcome: TxResult<_> = match $body.await {
                Ok(value) => $tx.commit().await.map(|()| value).map_err(TxError::Db),
                // Dropping the transaction rolls it back.
                Err(error) => Err(error),
            };
            match outcome {
                Err(TxError::Db(e)) if attempt < MAX_ATTEMPTS && lost_race(&e) => attempt += 1,
                other => break other.map_err(StateError::from),
            }
        }
    }};
}

/// Runs `$body` (an expression using `$client: &tokio_postgres::Client`)
/// on a pooled connection, outside a transaction.
macro_rules! on_connection {
    ($store:expr, |$client:ident| $body:expr) => {{
        let pooled = $store.client().await?;
        let $client: &tokio_postgres::Client = &pooled;
        $body.await.map_err(StateError::from)
    }};
}

mod agents;
mod configs;
mod dlq;
mod leases;
mod metrics;
mod query;
mod store;
#[cfg(test)]
pub(crate) mod testing;

use query::{exec, pg, query_all, query_opt};

/// Whether a transaction failed only because a concurrent one won.
pub(super) fn lost_race(error: &tokio_postgres::Error) -> bool {
    matches!(
        error.code(),
        Some(&SqlState::T_R_SERIALIZATION_FAILURE)
            | Some(&SqlState::T_R_DEADLOCK_DETECTED)
            | Some(&SqlState::UNIQUE_VIOLATION)
    )
}

/// Maps a database error to what is known about the operation.
pub(super) fn db_err(error: tokio_postgres::Error) -> StateError {
    match error.as_db_error() {
        Some(db) => {
            StateError::Unavailable(format!("postgres: {}: {}", db.code().code(), db.message()))
        }
        None => StateError::Unavailable(format!("postgres: {error}")),
    }
}

#[cfg(test)]
mod tests {
    use super::PostgresStore;
    use super::testing::TestDatabase;
    use crate::state::conformance::{TestBackend, state_store_suite};

    /// A fresh database on the test server; every `open` is a new pool.
    struct PostgresBackend {
        database: TestDatabase,
    }

    impl TestBackend for PostgresBackend {
        type Store = PostgresStore;

        async fn create() -> Self {
            Self {
                database: TestDatabase::create().await,
            }
        }

        async fn open(&self) -> PostgresStore {
            PostgresStore::connect(self.database.url())
                .await
                .expect("connect postgres store")
        }

        fn schema_v1(&self) -> &'static str {
            super::MIGRATIONS[0]
        }

        async fn execute_raw(&self, sql: &str) {
            self.database.execute(sql).await;
        }
    }

    state_store_suite!(PostgresBackend);
}
