//! PostgreSQL plumbing shared by the control plane's state store and the
//! agent's stores: a connection pool (TLS with rustls), a migration runner
//! that records what it applied, and the classification of errors.
//!
//! # Invariants
//!
//! 1. A URL is never shown with its password: every message about a
//!    connection names it through [`mask_url`].
//! 2. TLS: `sslmode=require` connects with rustls (ring provider) and the
//!    system's trust store; `disable` and `prefer` (libpq's default) connect
//!    without TLS, so `prefer` never fails on a server certificate the
//!    system does not trust.
//! 3. With a `schema`, every pooled connection starts with `search_path` set
//!    to it (a startup option), so statements name tables unqualified and one
//!    database can hold several independent sets of tables.
//! 4. [`connect`] opens one unpooled connection with the same TLS rule, for a
//!    caller that needs the server's notifications (`LISTEN`); a task drives
//!    it and forwards them, and ends with the connection.
//! 5. [`migrate`] applies the missing steps and records each version in the
//!    same transaction (all or nothing), under an advisory lock so that
//!    processes starting at once migrate one after the other; a database
//!    whose recorded version is newer than the steps known is refused and
//!    left as it is.
//! 6. **A frozen holder does not block the others.** Every pooled session
//!    starts with `idle_in_transaction_session_timeout` and `lock_timeout`
//!    set ([`PoolOptions`]): a process paused (SIGSTOP, a frozen VM) between
//!    a statement that took row locks and its `COMMIT` has its session ended
//!    by the server, which rolls its transaction back and frees the locks;
//!    and a wait for a lock that is still not free gives up with
//!    `lock_not_available` ([`timed_out`]) instead of hanging. Ferry's
//!    transactions send their statements back to back, so neither fires in
//!    normal operation. Migrations wait for their locks without limit.

use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;
use tokio_postgres::config::SslMode;
use tokio_postgres::error::SqlState;
use tokio_postgres::{AsyncMessage, Client, NoTls, Notification};

use crate::config::secret::mask_url;

/// Serializes schema migrations of processes starting at once.
const MIGRATION_LOCK: i64 = 0x0046_6572_7279; // "Ferry"

/// What went wrong while connecting or migrating.
#[derive(Debug, thiserror::Error)]
pub enum PostgresError {
    /// The URL or an option is invalid. Nothing was attempted.
    #[error("{0}")]
    Invalid(String),
    /// The database holds a newer schema than this build knows. Nothing was
    /// changed.
    #[error(
        "{what} has schema version {found}, newer than this build knows ({known}): run the newer \
         build, or point this one at another database or schema"
    )]
    Newer {
        /// What the schema belongs to.
        what: String,
        /// The version recorded in the database.
        found: i64,
        /// The highest version this build knows.
        known: i64,
    },
    /// The pool could not hand out a connection (server unreachable, wait
    /// timed out).
    #[error("postgres connection: {0}")]
    Connect(String),
    /// A statement failed.
    #[error("postgres: {}", describe(.0))]
    Db(#[from] tokio_postgres::Error),
}

/// How to open a pool.
#[derive(Clone, Debug)]
pub struct PoolOptions {
    /// Connections at most.
    pub max_size: usize,
    /// How long to wait for a connection (to be made or to come free).
    pub connect_timeout: Duration,
    /// The schema to set as `search_path` on every connection.
    pub schema: Option<String>,
    /// How long a session may sit idle inside a transaction before the
    /// server ends it (invariant 6).
    pub idle_in_transaction_timeout: Duration,
    /// How long a statement waits for a lock (invariant 6).
    pub lock_timeout: Duration,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            max_size: 16,
            connect_timeout: Duration::from_secs(10),
            schema: None,
            idle_in_transaction_timeout: Duration::from_secs(2),
            lock_timeout: Duration::from_secs(10),
        }
    }
}

/// A pool of connections to the database `url` (libpq URL or key=value
/// syntax) names. Connects lazily: a server that is down fails the first
/// [`Pool::get`], not this call.
pub fn pool(url: &str, options: &PoolOptions) -> Result<Pool, PostgresError> {
    let invalid = |e: &dyn std::fmt::Display| {
        PostgresError::Invalid(format!("postgres url {}: {e}", mask_url(url)))
    };
    let mut config = tokio_postgres::Config::from_str(url).map_err(|e| invalid(&e))?;
    // Startup options: `-c name=value` each, after what the URL gives.
    let mut startup: Vec<String> = config
        .get_options()
        .filter(|o| !o.is_empty())
        .map(str::to_owned)
        .into_iter()
        .collect();
    if let Some(schema) = &options.schema {
        if !is_identifier(schema) {
            return Err(PostgresError::Invalid(format!(
                "postgres schema \"{schema}\" is not a plain SQL identifier"
            )));
        }
        startup.push(format!("-c search_path={schema}"));
    }
    startup.push(format!(
        "-c idle_in_transaction_session_timeout={}",
        options.idle_in_transaction_timeout.as_millis()
    ));
    startup.push(format!(
        "-c lock_timeout={}",
        options.lock_timeout.as_millis()
    ));
    config.options(startup.join(" "));
    config.connect_timeout(options.connect_timeout);
    let manager_config = ManagerConfig {
        recycling_method: RecyclingMethod::Fast,
    };
    let manager = if config.get_ssl_mode() == SslMode::Require {
        let tls = tokio_postgres_rustls::MakeRustlsConnect::new(tls_config(None)?);
        Manager::from_config(config, tls, manager_config)
    } else {
        Manager::from_config(config, NoTls, manager_config)
    };
    Pool::builder(manager)
        .max_size(options.max_size)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(options.connect_timeout))
        .create_timeout(Some(options.connect_timeout))
        .recycle_timeout(Some(options.connect_timeout))
        .build()
        .map_err(|e| invalid(&e))
}

/// rustls with the ring provider, trusting `ca_file` or the system's trust store.
fn tls_config(ca_file: Option<&Path>) -> Result<rustls::ClientConfig, PostgresError> {
    let roots = crate::tls::roots(ca_file)
        .map_err(|e| PostgresError::Invalid(format!("sslmode=require: {e}")))?;
    Ok(rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| PostgresError::Invalid(format!("tls: {e}")))?
    .with_root_certificates(roots)
    .with_no_client_auth())
}

/// The notifications of a connection opened by [`connect`]; closed when the
/// connection ends.
pub type Notifications = mpsc::UnboundedReceiver<Notification>;

/// One connection (not pooled) as `config` describes, with rustls when its
/// `sslmode` is `require` (as [`pool`]). A spawned task drives the connection
/// and forwards its notifications. TLS trusts `ca_file` when given, the system's store
/// otherwise.
pub async fn connect(
    config: &tokio_postgres::Config,
    ca_file: Option<&Path>,
) -> Result<(Client, Notifications), PostgresError> {
    if config.get_ssl_mode() == SslMode::Require {
        let tls = tokio_postgres_rustls::MakeRustlsConnect::new(tls_config(ca_file)?);
        let (client, connection) = config.connect(tls).await?;
        Ok((client, drive(connection)))
    } else {
        let (client, connection) = config.connect(NoTls).await?;
        Ok((client, drive(connection)))
    }
}

fn drive<S, T>(mut connection: tokio_postgres::Connection<S, T>) -> Notifications
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                Some(Ok(AsyncMessage::Notification(n))) => {
                    // A receiver that is gone only stops caring about notifications.
                    tx.send(n).ok();
                }
                Some(Ok(_)) => {}
                Some(Err(error)) => {
                    tracing::debug!(%error, "postgres connection ended");
                    break;
                }
                None => break,
            }
        }
    });
    rx
}

/// A connection from `pool`; a failure is [`PostgresError::Connect`].
pub async fn client(pool: &Pool) -> Result<deadpool_postgres::Object, PostgresError> {
    pool.get()
        .await
        .map_err(|e| PostgresError::Connect(e.to_string()))
}

/// A set of tables and the steps that create them.
#[derive(Clone, Copy, Debug)]
pub struct Migrations<'a> {
    /// What the tables belong to, for messages ("the state database").
    pub what: &'a str,
    /// The table recording the versions applied: a row per version.
    pub version_table: &'a str,
    /// Step `i` brings the schema from version `i` to `i + 1`.
    pub steps: &'a [&'a str],
    /// Created (`IF NOT EXISTS`) before anything else, when set: the schema
    /// the connections' `search_path` names.
    pub schema: Option<&'a str>,
}

/// Brings the tables of `m` up to date (invariant 5). Returns the version
/// the database had before.
pub async fn migrate(client: &mut Client, m: &Migrations<'_>) -> Result<i64, PostgresError> {
    let tx = client.transaction().await?;
    // A migration waits for other processes' migrations and for the locks
    // its DDL needs however long they take (invariant 6).
    tx.batch_execute("SET LOCAL lock_timeout = 0").await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await?;
    if let Some(schema) = m.schema {
        if !is_identifier(schema) {
            return Err(PostgresError::Invalid(format!(
                "postgres schema \"{schema}\" is not a plain SQL identifier"
            )));
        }
        // Looked up first: `CREATE SCHEMA IF NOT EXISTS` asks for the CREATE
        // privilege on the database even when the schema exists.
        let exists = tx
            .query_opt("SELECT 1 FROM pg_namespace WHERE nspname = $1", &[&schema])
            .await?
            .is_some();
        if !exists {
            tx.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
                .await?;
        }
    }
    tx.batch_execute(&format!(
        "CREATE TABLE IF NOT EXISTS {} (version BIGINT NOT NULL)",
        m.version_table
    ))
    .await?;
    let applied: i64 = tx
        .query_one(
            &format!("SELECT COALESCE(MAX(version), 0) FROM {}", m.version_table),
            &[],
        )
        .await?
        .try_get(0)?;
    let known = i64::try_from(m.steps.len()).unwrap_or(i64::MAX);
    if applied > known {
        return Err(PostgresError::Newer {
            what: m.what.to_owned(),
            found: applied,
            known,
        });
    }
    let insert = format!("INSERT INTO {} (version) VALUES ($1)", m.version_table);
    for (version, sql) in (1_i64..)
        .zip(m.steps)
        .skip(usize::try_from(applied).unwrap_or(0))
    {
        tx.batch_execute(sql).await?;
        tx.execute(&insert, &[&version]).await?;
    }
    tx.commit().await?;
    if applied < known {
        tracing::info!(
            what = m.what,
            from = applied,
            to = known,
            "postgres schema migrated"
        );
    }
    Ok(applied)
}

/// Whether a transaction failed only because a concurrent one won
/// (serialization failure, deadlock, a unique key inserted meanwhile): run
/// it again.
pub fn lost_race(error: &tokio_postgres::Error) -> bool {
    matches!(
        error.code(),
        Some(&SqlState::T_R_SERIALIZATION_FAILURE)
            | Some(&SqlState::T_R_DEADLOCK_DETECTED)
            | Some(&SqlState::UNIQUE_VIOLATION)
    )
}

/// Whether the server refused a write for lack of room (disk full, out of
/// memory, too many connections are not room).
pub fn out_of_room(error: &tokio_postgres::Error) -> bool {
    matches!(
        error.code(),
        Some(&SqlState::DISK_FULL) | Some(&SqlState::INSUFFICIENT_RESOURCES)
    )
}

/// Whether a statement was cancelled by `statement_timeout` or a lock wait
/// timed out.
pub fn timed_out(error: &tokio_postgres::Error) -> bool {
    matches!(
        error.code(),
        Some(&SqlState::QUERY_CANCELED) | Some(&SqlState::LOCK_NOT_AVAILABLE)
    )
}

/// A database error as `code: message`, or the driver's text when the
/// server did not answer.
pub fn describe(error: &tokio_postgres::Error) -> String {
    match error.as_db_error() {
        Some(db) => format!("{}: {}", db.code().code(), db.message()),
        None => match std::error::Error::source(error) {
            Some(cause) => format!("{error}: {cause}"),
            None => error.to_string(),
        },
    }
}

/// A plain SQL identifier: what may be written into a statement unquoted.
pub fn is_identifier(value: &str) -> bool {
    let mut chars = value.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && value.len() <= 63
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_url_is_refused_without_its_password() {
        let Err(e) = pool(
            "postgres://u:hunter2@h:notaport/db",
            &PoolOptions::default(),
        ) else {
            panic!("refused");
        };
        let shown = e.to_string();
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("***"), "{shown}");
    }

    #[test]
    fn a_schema_must_be_a_plain_identifier() {
        let options = PoolOptions {
            schema: Some("a;drop".into()),
            ..PoolOptions::default()
        };
        assert!(matches!(
            pool("postgres://u@h/db", &options),
            Err(PostgresError::Invalid(_))
        ));
        assert!(is_identifier("ferry_1"));
        assert!(!is_identifier("1ferry"));
        assert!(!is_identifier(""));
    }

    #[tokio::test]
    async fn require_builds_a_tls_pool_and_prefer_a_plain_one() {
        for mode in ["require", "prefer", "disable"] {
            let url = format!("postgres://u@127.0.0.1:1/db?sslmode={mode}");
            assert!(pool(&url, &PoolOptions::default()).is_ok(), "{mode}");
        }
    }
}
