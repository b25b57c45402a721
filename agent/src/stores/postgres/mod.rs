//! PostgreSQL backends: stores that several agents share.
//!
//! Each store is a pool of connections to one database (TLS, `search_path`
//! and the recorded migrations are [`ferry_shared::postgres`]'s). The three
//! stores may share a database and a schema: their tables do not overlap,
//! and each records its own schema version (`ferry_outbox_schema`,
//! `ferry_lease_schema`, `ferry_dlq_schema`, a row per version applied).
//!
//! # Invariants and how SQL keeps them
//!
//! 1. **Migrations at open.** Opening a store applies the missing steps of
//!    its tables in one transaction under an advisory lock and records each
//!    version; a database recording a newer version than this build knows is
//!    refused (`Invalid`, naming the fix) and left unchanged. With `schema`,
//!    `CREATE SCHEMA IF NOT EXISTS` runs first and every connection starts
//!    with `search_path` set to it, so statements name tables unqualified.
//! 2. **Every write is one transaction**, committed before the call answers
//!    (`synchronous_commit` as the server has it; the default `on` makes an
//!    acknowledged write survive a crash of the server). A transaction that
//!    lost a race (deadlock, serialization failure, a key inserted meanwhile)
//!    runs again from the start, a bounded number of times; it had changed
//!    nothing.
//! 3. **Errors say what is known.** A refused connection, a broken one or a
//!    failed `COMMIT` is `Unavailable`; a statement cancelled by a timeout is
//!    `Timeout`; a full disk is `Full` (the server rolled back). Only the
//!    store's own decisions (`Stale`, `NotFound`, ...) are certain.
//! 4. The outbox ([`outbox`]) and the lease store ([`lease`]) state how they
//!    keep the stores' invariants (`crate::stores`) under concurrent agents.
//! 5. **A paused agent does not hold the others up.** Its row locks (the
//!    lease row, the outbox's partition row) last until its transaction
//!    ends; a session idle inside a transaction for 2 s is ended by the
//!    server (`ferry_shared::postgres`, invariant 6), which rolls it back.
//!    So a drainer frozen mid-transaction delays the next holder's claim by
//!    at most that, well inside a lease TTL; its own next statement fails
//!    (`Unavailable`) and the fence refuses whatever it does after.
//!
//! Times are stored as nanoseconds since the Unix epoch (`BIGINT`, exact
//! round trips); envelopes as [`Envelope::encode`](ferry_shared::envelope::Envelope::encode).

mod dlq;
mod lease;
mod outbox;
mod schema;

pub use dlq::PostgresDlqStore;
pub use lease::PostgresLeaseStore;
pub use outbox::PostgresOutboxStore;

use std::fmt;
use std::time::Duration;

use deadpool_postgres::{Object, Pool};
use ferry_shared::config::secret::mask_url;
use ferry_shared::postgres::{self as pg, Migrations, PoolOptions, PostgresError};

use super::{StoreError, StoreResult};

/// How often a transaction runs when it keeps losing races (invariant 2).
const MAX_ATTEMPTS: u32 = 8;

/// How to open a PostgreSQL store.
#[derive(Clone, PartialEq, Eq)]
pub struct PostgresOptions {
    /// `postgres://user:password@host:port/database` (or libpq key=value);
    /// `sslmode=require` connects with TLS.
    pub url: String,
    /// The schema holding the tables (created if missing); `None`: the
    /// server's `search_path` (normally `public`).
    pub schema: Option<String>,
    /// Outbox only: how old an owner's claim must be before `claim` gives it
    /// back to the same owner (default 30 s).
    pub stale_claim_duration: Duration,
    /// Connections at most (default 8).
    pub pool_size: usize,
    /// How long a call waits for a connection (default 5 s).
    pub connect_timeout: Duration,
}

impl PostgresOptions {
    /// Options for `url` with the defaults.
    pub fn new(url: impl Into<String>) -> Self {
        PostgresOptions {
            url: url.into(),
            schema: None,
            stale_claim_duration: Duration::from_secs(30),
            pool_size: 8,
            connect_timeout: Duration::from_secs(5),
        }
    }
}

impl fmt::Debug for PostgresOptions {
    /// The URL with its password masked.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresOptions")
            .field("url", &mask_url(&self.url))
            .field("schema", &self.schema)
            .field("stale_claim_duration", &self.stale_claim_duration)
            .field("pool_size", &self.pool_size)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

/// The pool of one store, its tables migrated.
#[derive(Clone)]
pub(crate) struct Db {
    pool: Pool,
}

impl Db {
    /// Opens a pool and brings `component`'s tables up to date
    /// (invariant 1).
    pub(crate) async fn open(
        options: &PostgresOptions,
        component: &str,
        steps: &[&str],
    ) -> StoreResult<Self> {
        let pool = pg::pool(
            &options.url,
            &PoolOptions {
                max_size: options.pool_size,
                connect_timeout: options.connect_timeout,
                schema: options.schema.clone(),
                ..PoolOptions::default()
            },
        )
        .map_err(shared_error)?;
        let db = Db { pool };
        let mut client = db.client().await?;
        pg::migrate(
            &mut client,
            &Migrations {
                what: &format!("the {component} store"),
                version_table: &format!("ferry_{component}_schema"),
                steps,
                schema: options.schema.as_deref(),
            },
        )
        .await
        .map_err(shared_error)?;
        Ok(db)
    }

    /// A pooled connection.
    pub(crate) async fn client(&self) -> StoreResult<Object> {
        pg::client(&self.pool).await.map_err(shared_error)
    }
}

/// The failure of one step inside a transaction: a database error (maybe
/// a lost race, run again) or the store's own decision.
pub(crate) enum TxError {
    Db(tokio_postgres::Error),
    Store(StoreError),
}

impl From<tokio_postgres::Error> for TxError {
    fn from(e: tokio_postgres::Error) -> Self {
        TxError::Db(e)
    }
}

impl From<StoreError> for TxError {
    fn from(e: StoreError) -> Self {
        TxError::Store(e)
    }
}

pub(crate) type TxResult<T> = Result<T, TxError>;

/// Runs `$body` (an expression using `$tx: &deadpool_postgres::Transaction`
/// and giving a `TxResult` future) in a transaction on a connection of
/// `$db` and commits it; runs it again when it lost a race (invariant 2).
/// A macro rather than a function taking an async closure, so that the
/// body borrows the caller's arguments and the future stays `Send`.
macro_rules! in_transaction {
    ($db:expr, |$tx:ident| $body:expr) => {{
        let mut attempt = 1;
        loop {
            let mut client = $db.client().await?;
            let $tx = client
                .transaction()
                .await
                .map_err($crate::stores::postgres::pg_error)?;
            let outcome: $crate::stores::postgres::TxResult<_> = match $body.await {
                Ok(value) => $tx.commit().await.map(|()| value).map_err(|e| {
                    // A failed COMMIT may or may not have been applied.
                    $crate::stores::postgres::TxError::Store(
                        $crate::stores::StoreError::Unavailable(format!(
                            "postgres commit: {}",
                            ferry_shared::postgres::describe(&e)
                        )),
                    )
                }),
                // Dropping the transaction rolls it back.
                Err(error) => Err(error),
            };
            match outcome {
                Err($crate::stores::postgres::TxError::Db(e))
                    if attempt < $crate::stores::postgres::MAX_ATTEMPTS
                        && ferry_shared::postgres::lost_race(&e) =>
                {
                    attempt += 1
                }
                Err($crate::stores::postgres::TxError::Db(e)) => {
                    break Err($crate::stores::postgres::pg_error(e));
                }
                Err($crate::stores::postgres::TxError::Store(e)) => break Err(e),
                Ok(value) => break Ok(value),
            }
        }
    }};
}
pub(crate) use in_transaction;

/// Maps a database error (invariant 3).
pub(crate) fn pg_error(e: tokio_postgres::Error) -> StoreError {
    let shown = format!("postgres: {}", pg::describe(&e));
    if pg::timed_out(&e) {
        StoreError::Timeout(shown)
    } else if pg::out_of_room(&e) {
        StoreError::Full(shown)
    } else {
        StoreError::Unavailable(shown)
    }
}

/// Maps a failure to connect or migrate.
fn shared_error(e: PostgresError) -> StoreError {
    match e {
        PostgresError::Invalid(_) | PostgresError::Newer { .. } => {
            StoreError::Invalid(e.to_string())
        }
        PostgresError::Connect(_) => StoreError::Unavailable(e.to_string()),
        PostgresError::Db(e) => pg_error(e),
    }
}

/// A `BIGINT` column as the unsigned value it was stored from.
pub(crate) fn to_u64(n: i64) -> StoreResult<u64> {
    u64::try_from(n).map_err(|_| StoreError::Corrupt(format!("negative value {n}")))
}

/// An unsigned value as a `BIGINT` column.
pub(crate) fn to_i64(n: u64) -> StoreResult<i64> {
    i64::try_from(n).map_err(|_| StoreError::Invalid(format!("value {n} exceeds i64")))
}
