//! The `stores:` block: outbox, lease and dead-letter stores, each a `type` plus typed
//! `options`.
//!
//! Each store is a serde enum adjacently tagged by `type` with its `options` as content, so every
//! backend has its own option struct with unknown fields denied. `options` is always required
//! (write `options: {}` when every option has a default).

use serde::Deserialize;

use super::duration::Duration;

/// The three stores. Each may be absent; the validator says which routes need which.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stores {
    /// Where `shared_outbox` routes persist one record per binding.
    #[serde(default)]
    pub outbox: Option<OutboxStoreConfig>,
    /// Where drainers take the lease (with its fencing version) of their partition.
    #[serde(default)]
    pub lease: Option<LeaseStoreConfig>,
    /// Where dead letters go (`on_expired: dlq`, `on_permanent_failure: dlq`).
    #[serde(default)]
    pub dlq: Option<DlqStoreConfig>,
}

/// `stores.outbox`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(
    tag = "type",
    content = "options",
    rename_all = "snake_case",
    deny_unknown_fields
)]
pub enum OutboxStoreConfig {
    /// In process memory: lost on restart (development only).
    Memory(MemoryOptions),
    /// A local SQLite file (single instance).
    Sqlite(SqliteOutboxOptions),
    /// A DynamoDB table (several instances).
    Dynamodb(DynamoDbOutboxOptions),
    /// A PostgreSQL table (several instances).
    Postgres(PostgresOutboxOptions),
}

/// `stores.lease`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(
    tag = "type",
    content = "options",
    rename_all = "snake_case",
    deny_unknown_fields
)]
pub enum LeaseStoreConfig {
    /// In process memory: fencing versions restart at zero with the process.
    Memory(MemoryOptions),
    /// A local SQLite file.
    Sqlite(SqliteOptions),
    /// A DynamoDB table.
    Dynamodb(DynamoDbOptions),
    /// The control plane's LeaseService.
    ControlPlane(ControlPlaneOptions),
}

/// `stores.dlq`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(
    tag = "type",
    content = "options",
    rename_all = "snake_case",
    deny_unknown_fields
)]
pub enum DlqStoreConfig {
    /// In process memory: lost on restart (development only).
    Memory(MemoryOptions),
    /// A local SQLite file.
    Sqlite(SqliteOptions),
    /// A DynamoDB table.
    Dynamodb(DynamoDbOptions),
    /// The control plane's DlqService.
    ControlPlane(ControlPlaneOptions),
}

impl OutboxStoreConfig {
    /// The `type` as written.
    pub fn type_name(&self) -> &'static str {
        match self {
            OutboxStoreConfig::Memory(_) => "memory",
            OutboxStoreConfig::Sqlite(_) => "sqlite",
            OutboxStoreConfig::Dynamodb(_) => "dynamodb",
            OutboxStoreConfig::Postgres(_) => "postgres",
        }
    }

    /// Whether records survive a restart of the agent.
    pub fn is_durable(&self) -> bool {
        !matches!(self, OutboxStoreConfig::Memory(_))
    }

    /// `stale_claim_duration` with its default (`None` for the memory store, which has none).
    pub fn stale_claim_duration(&self) -> Option<Duration> {
        let explicit = match self {
            OutboxStoreConfig::Memory(_) => return None,
            OutboxStoreConfig::Sqlite(o) => o.stale_claim_duration,
            OutboxStoreConfig::Dynamodb(o) => o.stale_claim_duration,
            OutboxStoreConfig::Postgres(o) => o.stale_claim_duration,
        };
        Some(explicit.unwrap_or_else(default_stale_claim_duration))
    }
}

impl LeaseStoreConfig {
    /// The `type` as written.
    pub fn type_name(&self) -> &'static str {
        match self {
            LeaseStoreConfig::Memory(_) => "memory",
            LeaseStoreConfig::Sqlite(_) => "sqlite",
            LeaseStoreConfig::Dynamodb(_) => "dynamodb",
            LeaseStoreConfig::ControlPlane(_) => "control_plane",
        }
    }

    /// Whether fencing versions survive a restart of the agent.
    pub fn is_durable(&self) -> bool {
        !matches!(self, LeaseStoreConfig::Memory(_))
    }
}

impl DlqStoreConfig {
    /// The `type` as written.
    pub fn type_name(&self) -> &'static str {
        match self {
            DlqStoreConfig::Memory(_) => "memory",
            DlqStoreConfig::Sqlite(_) => "sqlite",
            DlqStoreConfig::Dynamodb(_) => "dynamodb",
            DlqStoreConfig::ControlPlane(_) => "control_plane",
        }
    }
}

/// Options of a `memory` store.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryOptions {
    /// Acknowledge that what the store holds is lost on restart. A `memory` outbox or DLQ is
    /// rejected unless this is true (a source is settled once its message is in the outbox or
    /// DLQ, so a restart would lose it). Default false; not required for a lease.
    #[serde(default)]
    pub acknowledge_volatile: bool,
}

/// SQLite's `synchronous` pragma.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SqliteSynchronous {
    /// fsync on every commit: an acknowledged write survives a power loss (default).
    #[default]
    Full,
    /// fsync at checkpoints only (WAL): survives a process crash, a power loss may drop the last
    /// commits.
    Normal,
}

/// Options of an `sqlite` lease or DLQ store.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SqliteOptions {
    /// The database file (created if missing).
    pub path: String,
    /// `full` (default) or `normal`.
    #[serde(default)]
    pub synchronous: SqliteSynchronous,
    /// How long a connection waits on a lock before failing. Default 5s.
    #[serde(default = "default_busy_timeout")]
    pub busy_timeout: Duration,
    /// The largest the database file may grow, in bytes (SQLite `max_page_count`). A write
    /// that needs more fails as a full store (nothing acknowledged, the source redelivers).
    /// Default: no limit but the disk's. At least 65536.
    #[serde(default)]
    pub max_size_bytes: Option<u64>,
}

/// Options of an `sqlite` outbox.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SqliteOutboxOptions {
    /// The database file (created if missing).
    pub path: String,
    /// `full` (default) or `normal`.
    #[serde(default)]
    pub synchronous: SqliteSynchronous,
    /// How long a connection waits on a lock before failing. Default 5s.
    #[serde(default = "default_busy_timeout")]
    pub busy_timeout: Duration,
    /// The largest the database file may grow, in bytes (SQLite `max_page_count`). A write
    /// that needs more fails as a full store (nothing acknowledged, the source redelivers).
    /// Default: no limit but the disk's. At least 65536.
    #[serde(default)]
    pub max_size_bytes: Option<u64>,
    /// After how long the owner's own unfinished claim is handed out again. Default 5m; must
    /// exceed every shared_outbox route's `send_timeout`.
    #[serde(default)]
    pub stale_claim_duration: Option<Duration>,
}

/// Options of a `dynamodb` lease or DLQ store.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DynamoDbOptions {
    /// The table.
    pub table_name: String,
    /// AWS region (default: the SDK's region chain).
    #[serde(default)]
    pub region: Option<String>,
    /// Endpoint override, e.g. a local emulator.
    #[serde(default)]
    pub endpoint_url: Option<String>,
}

/// Options of a `dynamodb` outbox.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DynamoDbOutboxOptions {
    /// The table.
    pub table_name: String,
    /// AWS region (default: the SDK's region chain).
    #[serde(default)]
    pub region: Option<String>,
    /// Endpoint override, e.g. a local emulator.
    #[serde(default)]
    pub endpoint_url: Option<String>,
    /// After how long the owner's own unfinished claim is handed out again. Default 5m; must
    /// exceed every shared_outbox route's `send_timeout`.
    #[serde(default)]
    pub stale_claim_duration: Option<Duration>,
}

/// Options of a `postgres` outbox.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PostgresOutboxOptions {
    /// Connection URL, `postgres://user:password@host:port/database` (use `${VAR}` for the
    /// password).
    pub url: String,
    /// Schema of the outbox table. Default `public`.
    #[serde(default = "default_postgres_schema")]
    pub schema: String,
    /// The outbox table. Default `ferry_outbox`.
    #[serde(default = "default_postgres_table")]
    pub table: String,
    /// After how long the owner's own unfinished claim is handed out again. Default 5m; must
    /// exceed every shared_outbox route's `send_timeout`.
    #[serde(default)]
    pub stale_claim_duration: Option<Duration>,
}

/// Options of a `control_plane` lease or DLQ store.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlPlaneOptions {
    /// The control plane's gRPC endpoint (`http://` or `https://`). Default: the control plane
    /// the agent gets its configuration from.
    #[serde(default)]
    pub endpoint: Option<String>,
}

/// The smallest `max_size_bytes` a SQLite store accepts: 16 pages of 4 KiB, room for its
/// schema and a few rows.
pub const SQLITE_MIN_MAX_SIZE: u64 = 65_536;

/// Default SQLite `busy_timeout`.
pub fn default_busy_timeout() -> Duration {
    Duration::from_secs(5)
}

/// Default outbox `stale_claim_duration`.
pub fn default_stale_claim_duration() -> Duration {
    Duration::from_secs(300)
}

/// Default PostgreSQL outbox schema.
pub fn default_postgres_schema() -> String {
    "public".to_owned()
}

/// Default PostgreSQL outbox table.
pub fn default_postgres_table() -> String {
    "ferry_outbox".to_owned()
}
