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
//! Connecting (TLS with rustls for `sslmode=require`, none for `disable` and
//! `prefer`) and the recorded schema migrations are
//! [`ferry_shared::postgres`]'s, shared with the agent's PostgreSQL stores.

use deadpool_postgres::Pool;
use ferry_shared::postgres::{self, Migrations, PoolOptions, PostgresError};

use super::error::{StateError, StateResult};

/// Schema migrations, in order; the schema version is the number applied.
const MIGRATIONS: &[&str] = &[include_str!("schema_v1.sql"), include_str!("schema_v2.sql")];

/// How often a transaction is tried when it loses a race.
pub(super) const MAX_ATTEMPTS: u32 = 8;

/// Connections per store.
const POOL_SIZE: usize = 16;

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
        Self::connect_with(url, PoolOptions::default()).await
    }

    /// [`PostgresStore::connect`] with `options` (its pool size aside).
    async fn connect_with(url: &str, options: PoolOptions) -> StateResult<Self> {
        let options = PoolOptions {
            max_size: POOL_SIZE,
            ..options
        };
        let pool = postgres::pool(url, &options).map_err(shared_err)?;
        let store = Self { pool };
        let mut client = store.client().await?;
        postgres::migrate(
            &mut client,
            &Migrations {
                what: "the state database",
                version_table: "ferry_schema",
                steps: MIGRATIONS,
                schema: None,
            },
        )
        .await
        .map_err(shared_err)?;
        Ok(store)
    }

    async fn client(&self) -> StateResult<deadpool_postgres::Object> {
        postgres::client(&self.pool).await.map_err(shared_err)
    }
}

/// A refusal or failure of the shared PostgreSQL plumbing as a state error.
fn shared_err(error: PostgresError) -> StateError {
    match error {
        PostgresError::Invalid(_) | PostgresError::Newer { .. } => {
            StateError::invalid(error.to_string())
        }
        PostgresError::Connect(_) => StateError::Unavailable(error.to_string()),
        PostgresError::Db(e) => db_err(e),
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

pub(super) use ferry_shared::postgres::lost_race;

/// Maps a database error to what is known about the operation.
pub(super) fn db_err(error: tokio_postgres::Error) -> StateError {
    StateError::Unavailable(format!("postgres: {}", postgres::describe(&error)))
}

#[cfg(test)]
mod tests {
    use super::testing::TestDatabase;
    use super::{PoolOptions, PostgresStore};
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

        /// With a lock timeout far above the default 10 s: the race tests
        /// queue 20 writes on one row, which a loaded two-core machine
        /// (CI beside other builds) once took longer than that to serve.
        async fn open(&self) -> PostgresStore {
            let options = PoolOptions {
                lock_timeout: std::time::Duration::from_secs(120),
                ..PoolOptions::default()
            };
            PostgresStore::connect_with(self.database.url(), options)
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
