//! The control plane's durable state: bridge configurations and their
//! history, agents and what they run, leases, dead letters and the latest
//! metrics of every agent, behind one [`StateStore`] trait.
//!
//! Backends: [`sqlite`] (embedded, one file; the default) and [`postgres`]
//! (several control-plane replicas sharing one database), chosen by URL with
//! [`open_state_store`]. Both pass one conformance suite.
//!
//! # Invariants every backend keeps
//!
//! - **Configuration versions** start at 1 and grow by exactly 1 per stored
//!   change; an apply whose document and selector equal the current version
//!   stores nothing. `expected_version` is checked and the new version
//!   written in one transaction that holds the bridge's row locked, so two
//!   concurrent applies (also from two replicas) never produce the same
//!   version and never lose an update; with the same `expected_version`
//!   exactly one wins, the other gets `Conflict` and nothing is stored.
//!   Deleting a configuration deletes its history; applying it again starts
//!   at version 1. Every stored version keeps who applied it
//!   ([`AppliedBy`]); an unchanged apply keeps the author of the version it
//!   matched.
//! - **Lease fencing versions** strictly increase per key and never repeat:
//!   every grant to a new holder is `last version + 1`, decided and written
//!   in one transaction holding the key's row locked. The row is never
//!   deleted (a release only clears the holder), so the counter survives
//!   releases, restarts and replicas. The rules themselves are in one place
//!   (`leases.rs`) for every backend.
//! - **Dead letters** are idempotent by id: a second write of an id changes
//!   nothing and reports `created = false`. Listings are ordered by
//!   `dead_lettered_at`, then id.
//! - **Metrics**: one snapshot per agent, the one with the latest
//!   `captured_at` (an older snapshot arriving late is ignored).
//! - Every write is durable when its future resolves `Ok`. An
//!   [`StateError::Unavailable`] means it may or may not have been applied.
//! - Paging is by keyset (never offsets); page tokens are opaque and tied to
//!   their listing.
//!
//! Times are taken as arguments where tests need to control them (leases,
//! agent events, dead letters, metrics); configuration versions are stamped
//! with the store's clock.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

mod agents;
mod codec;
mod configs;
mod dlq;
mod error;
mod leases;
mod paging;
mod rows;
mod sql;
mod types;

pub mod postgres;
pub mod sqlite;

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod conformance;

pub use error::{StateError, StateResult};
pub use paging::{DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, Page, PageRequest};
pub use types::{
    AgentBridgeEvent, AgentBridgeStatus, AgentHello, AgentRecord, AppliedBy, AppliedConfig,
    ApplyConfig, ConfigAckRecord, ConfigNackRecord, ConfigPushRecord, ConfigVersion, DlqEntry,
    DlqFilter, DlqReason, DlqStat, Labels, Lease, LeaseAcquisition, MetricsRecord, StoredConfig,
};

/// The future every [`StateStore`] operation returns (boxed, so the trait
/// can be used as `Arc<dyn StateStore>`).
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = StateResult<T>> + Send + 'a>>;

/// The control plane's durable state. See the module documentation for the
/// invariants every implementation keeps.
pub trait StateStore: Send + Sync + 'static {
    // --- configurations ---------------------------------------------------

    /// Stores `apply` as the bridge's next version (current + 1, first = 1)
    /// unless document and selector equal the current version
    /// (`changed = false`). `Conflict` when `expected_version` does not
    /// match; nothing is stored then.
    fn apply_config(&self, apply: ApplyConfig) -> StoreFuture<'_, AppliedConfig>;

    /// One version of a configuration; `None` reads the current one.
    fn get_config<'a>(
        &'a self,
        bridge_id: &'a str,
        version: Option<u64>,
    ) -> StoreFuture<'a, StoredConfig>;

    /// The current version of every configuration, ordered by bridge id.
    fn list_configs(&self, page: PageRequest) -> StoreFuture<'_, Page<StoredConfig>>;

    /// A configuration's history, newest first. `NotFound` for an unknown
    /// bridge.
    fn list_config_versions<'a>(
        &'a self,
        bridge_id: &'a str,
        page: PageRequest,
    ) -> StoreFuture<'a, Page<ConfigVersion>>;

    /// Deletes a configuration and its history. `NotFound` for an unknown
    /// bridge (unless `expected_version` is given: then `Conflict`),
    /// `Conflict` when `expected_version` does not match.
    fn delete_config<'a>(
        &'a self,
        bridge_id: &'a str,
        expected_version: Option<u64>,
    ) -> StoreFuture<'a, ()>;

    // --- agents -------------------------------------------------------------

    /// Records an agent's hello: creates or updates it, connected now, seen
    /// now. Its per-bridge status is kept.
    fn upsert_agent(&self, hello: AgentHello) -> StoreFuture<'_, ()>;

    /// Records that something arrived from the agent at `at`.
    fn mark_agent_seen<'a>(&'a self, agent_id: &'a str, at: SystemTime) -> StoreFuture<'a, ()>;

    /// Records that the agent's stream ended (or went silent) at `at`.
    fn mark_agent_disconnected<'a>(
        &'a self,
        agent_id: &'a str,
        at: SystemTime,
    ) -> StoreFuture<'a, ()>;

    /// Records a push, ACK, NACK or withdrawal of one bridge for one agent.
    fn record_agent_bridge<'a>(
        &'a self,
        agent_id: &'a str,
        bridge_id: &'a str,
        event: AgentBridgeEvent,
        at: SystemTime,
    ) -> StoreFuture<'a, ()>;

    /// One agent with its per-bridge status.
    fn get_agent<'a>(&'a self, agent_id: &'a str) -> StoreFuture<'a, AgentRecord>;

    /// Every agent ever seen, ordered by id.
    fn list_agents(&self) -> StoreFuture<'_, Vec<AgentRecord>>;

    // --- leases -------------------------------------------------------------

    /// Takes the lease when free, expired, or already held by `holder`,
    /// always at a new version; otherwise reports the live holder (rules:
    /// [`ferry_shared::lease`]).
    fn acquire_lease<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        ttl: Duration,
        now: SystemTime,
    ) -> StoreFuture<'a, LeaseAcquisition>;

    /// Extends the lease to `now + ttl`; only `holder` at `version`, before
    /// it expired, may (`LeaseLost` otherwise).
    fn renew_lease<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
        ttl: Duration,
        now: SystemTime,
    ) -> StoreFuture<'a, Lease>;

    /// Gives the lease up (idempotent for its holder); `LeaseLost` when
    /// `holder` does not hold it at `version`.
    fn release_lease<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
    ) -> StoreFuture<'a, ()>;

    /// Leases whose key starts with `prefix`, held or not, ordered by key.
    fn list_leases<'a>(
        &'a self,
        prefix: &'a str,
        page: PageRequest,
    ) -> StoreFuture<'a, Page<Lease>>;

    // --- dead letters -------------------------------------------------------

    /// Stores an entry, durably; `false` when its id already existed
    /// (nothing changed).
    fn put_dlq(&self, entry: DlqEntry) -> StoreFuture<'_, bool>;

    /// Entries matching `filter`, oldest first.
    fn list_dlq<'a>(
        &'a self,
        filter: &'a DlqFilter,
        page: PageRequest,
    ) -> StoreFuture<'a, Page<DlqEntry>>;

    /// One entry.
    fn get_dlq<'a>(&'a self, id: &'a str) -> StoreFuture<'a, DlqEntry>;

    /// Deletes one entry; `NotFound` when there is none.
    fn delete_dlq<'a>(&'a self, id: &'a str) -> StoreFuture<'a, ()>;

    /// Deletes every entry matching `filter`; returns how many.
    fn purge_dlq<'a>(&'a self, filter: &'a DlqFilter) -> StoreFuture<'a, u64>;

    /// Counts per bridge, route, binding and reason, with the oldest entry,
    /// ordered by those four.
    fn dlq_stats<'a>(&'a self, filter: &'a DlqFilter) -> StoreFuture<'a, Vec<DlqStat>>;

    // --- metrics ------------------------------------------------------------

    /// Keeps `record` as the agent's latest snapshot unless a newer one is
    /// stored.
    fn put_metrics(&self, record: MetricsRecord) -> StoreFuture<'_, ()>;

    /// The latest snapshot of one agent.
    fn get_metrics<'a>(&'a self, agent_id: &'a str) -> StoreFuture<'a, MetricsRecord>;

    /// The latest snapshot of every agent, ordered by agent id.
    fn list_metrics(&self) -> StoreFuture<'_, Vec<MetricsRecord>>;
}

/// Where the state lives, as named by a state URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateUrl {
    /// An SQLite database file.
    Sqlite(std::path::PathBuf),
    /// A PostgreSQL database (the URL, libpq syntax).
    Postgres(String),
}

impl StateUrl {
    /// Parses `sqlite:///abs/path/state.db` (absolute),
    /// `sqlite://relative/state.db` (relative to the working directory), or
    /// `postgres://...` / `postgresql://...`.
    pub fn parse(url: &str) -> StateResult<Self> {
        if let Some(path) = url.strip_prefix("sqlite://") {
            if path.is_empty() {
                return Err(StateError::invalid(format!(
                    "state url {url:?} names no file (expected sqlite:///path/state.db)"
                )));
            }
            Ok(Self::Sqlite(path.into()))
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(Self::Postgres(url.to_owned()))
        } else {
            Err(StateError::invalid(format!(
                "unsupported state url {url:?}: expected sqlite:///path/state.db or postgres://..."
            )))
        }
    }
}

/// Opens the state store a URL names (see [`StateUrl::parse`]): an SQLite
/// file is created, with its directory (mode 0700), if missing; a PostgreSQL database
/// must exist. Either way the schema is created or brought up to date.
pub async fn open_state_store(url: &str) -> StateResult<Arc<dyn StateStore>> {
    match StateUrl::parse(url)? {
        StateUrl::Sqlite(path) => {
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                // Private, like every directory Ferry creates (`ferry_shared::os`).
                tokio::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(ferry_shared::os::PRIVATE_DIR_MODE)
                    .create(parent)
                    .await
                    .map_err(|e| {
                        StateError::Unavailable(format!("creating {}: {e}", parent.display()))
                    })?;
            }
            Ok(Arc::new(sqlite::SqliteStore::open(path).await?))
        }
        StateUrl::Postgres(url) => Ok(Arc::new(postgres::PostgresStore::connect(&url).await?)),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn parses_state_urls() {
        assert_eq!(
            StateUrl::parse("sqlite:///var/lib/ferry/state.db").unwrap(),
            StateUrl::Sqlite("/var/lib/ferry/state.db".into())
        );
        assert_eq!(
            StateUrl::parse("sqlite://data/state.db").unwrap(),
            StateUrl::Sqlite("data/state.db".into())
        );
        for url in [
            "postgres://u@h/db",
            "postgresql://u@h:5432/db?sslmode=disable",
        ] {
            assert_eq!(
                StateUrl::parse(url).unwrap(),
                StateUrl::Postgres(url.into())
            );
        }
        for bad in ["sqlite://", "mysql://h/db", "/var/lib/state.db", ""] {
            assert!(
                matches!(StateUrl::parse(bad), Err(StateError::Invalid(_))),
                "{bad}"
            );
        }
    }

    #[tokio::test]
    async fn opens_sqlite_by_url_and_reopens_it() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/nested/dir/state.db", dir.path().display());
        let apply = ApplyConfig {
            bridge_id: "b".into(),
            yaml: "a: 1".into(),
            selector: Labels::new(),
            change_note: String::new(),
            expected_version: None,
            applied_by: AppliedBy::default(),
        };
        {
            let store = open_state_store(&url).await.unwrap();
            assert_eq!(store.apply_config(apply).await.unwrap().config.version, 1);
        }
        let store = open_state_store(&url).await.unwrap();
        assert_eq!(store.get_config("b", None).await.unwrap().yaml, "a: 1");
    }

    #[tokio::test]
    async fn opens_postgres_by_url() {
        let database = postgres::testing::TestDatabase::create().await;
        let store = open_state_store(database.url()).await.unwrap();
        assert!(store.list_agents().await.unwrap().is_empty());
        // TLS with the system's trust store: the test server's self-signed
        // certificate (or its lack of TLS) is refused when connecting.
        let tls = format!("{}?sslmode=require", database.url());
        assert!(matches!(
            open_state_store(&tls).await.map(drop),
            Err(StateError::Unavailable(_))
        ));
    }
}
