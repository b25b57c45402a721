//! The `stores:` block: outbox, lease and dead-letter stores, each a `type` plus typed
//! `options`.
//!
//! Each store is a serde enum adjacently tagged by `type` with its `options` as content, so every
//! backend has its own option struct with unknown fields denied. An absent (or empty) `options`
//! is read as `options: {}`, and no option is required by serde: a key that must be set (a
//! SQLite `path`, a DynamoDB `table_name`) defaults to empty and the validator names it, so
//! every store misconfiguration is answered with its `path: message`.
//!
//! (How: serde hands a missing adjacently tagged content to the variant's type as a missing
//! field, which only `deserialize_option` accepts. So each option struct derives its field-by-
//! field deserializer under `#[serde(remote = "Self")]`, an inherent function, and
//! [`absent_is_empty!`] implements `Deserialize` through `deserialize_option` around it.)

use std::fmt;
use std::marker::PhantomData;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor, value::MapDeserializer};

use super::duration::Duration;
use super::secret::Secret;

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
    /// A PostgreSQL table (several agents).
    Postgres(PostgresOptions),
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
    /// A PostgreSQL table (several agents).
    Postgres(PostgresOptions),
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

    /// Whether several agents (on several nodes) can share it: a database
    /// service rather than a file or memory of one node.
    pub fn is_shared(&self) -> bool {
        matches!(
            self,
            OutboxStoreConfig::Dynamodb(_) | OutboxStoreConfig::Postgres(_)
        )
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
            LeaseStoreConfig::Postgres(_) => "postgres",
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
            DlqStoreConfig::Postgres(_) => "postgres",
            DlqStoreConfig::ControlPlane(_) => "control_plane",
        }
    }
}

/// Options of a `memory` store.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(remote = "Self", deny_unknown_fields)]
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
#[serde(remote = "Self", deny_unknown_fields)]
pub struct SqliteOptions {
    /// The database file (created if missing, with its directory). Required.
    #[serde(default)]
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
#[serde(remote = "Self", deny_unknown_fields)]
pub struct SqliteOutboxOptions {
    /// The database file (created if missing, with its directory). Required.
    #[serde(default)]
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
#[serde(remote = "Self", deny_unknown_fields)]
pub struct DynamoDbOptions {
    /// The table. Required.
    #[serde(default)]
    pub table_name: String,
    /// AWS region (default: the SDK's region chain).
    #[serde(default)]
    pub region: Option<String>,
    /// Endpoint override, e.g. a local emulator.
    #[serde(default)]
    pub endpoint_url: Option<String>,
    /// Create the table (on-demand billing) when it does not exist, and wait until it is
    /// active. Default false: a missing table is a startup error.
    #[serde(default)]
    pub create_tables: bool,
}

/// Options of a `dynamodb` outbox.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(remote = "Self", deny_unknown_fields)]
pub struct DynamoDbOutboxOptions {
    /// The table. Required.
    #[serde(default)]
    pub table_name: String,
    /// AWS region (default: the SDK's region chain).
    #[serde(default)]
    pub region: Option<String>,
    /// Endpoint override, e.g. a local emulator.
    #[serde(default)]
    pub endpoint_url: Option<String>,
    /// Create the table (on-demand billing) when it does not exist, and wait until it is
    /// active. Default false: a missing table is a startup error.
    #[serde(default)]
    pub create_tables: bool,
    /// After how long the owner's own unfinished claim is handed out again. Default 5m; must
    /// exceed every shared_outbox route's `send_timeout`.
    #[serde(default)]
    pub stale_claim_duration: Option<Duration>,
}

/// Options of a `postgres` lease or DLQ store.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(remote = "Self", deny_unknown_fields)]
pub struct PostgresOptions {
    /// Connection URL, `postgres://user:password@host:port/database` (use `${VAR}` for the
    /// password; `?sslmode=require` for TLS). Required; `dsn` is another name for it. A secret
    /// (it holds the password): printed as `***`, shown with its password masked.
    #[serde(default, alias = "dsn")]
    pub url: Secret,
    /// Schema of the store's tables, created if missing. Default `public`.
    #[serde(default = "default_postgres_schema")]
    pub schema: String,
}

/// Options of a `postgres` outbox.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(remote = "Self", deny_unknown_fields)]
pub struct PostgresOutboxOptions {
    /// Connection URL, `postgres://user:password@host:port/database` (use `${VAR}` for the
    /// password; `?sslmode=require` for TLS). Required; `dsn` is another name for it. A secret
    /// (it holds the password): printed as `***`, shown with its password masked.
    #[serde(default, alias = "dsn")]
    pub url: Secret,
    /// Schema of the outbox's tables, created if missing. Default `public`.
    #[serde(default = "default_postgres_schema")]
    pub schema: String,
    /// After how long the owner's own unfinished claim is handed out again. Default 5m; must
    /// exceed every shared_outbox route's `send_timeout`.
    #[serde(default)]
    pub stale_claim_duration: Option<Duration>,
}

/// Options of a `control_plane` lease or DLQ store.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(remote = "Self", deny_unknown_fields)]
pub struct ControlPlaneOptions {
    /// The control plane's gRPC endpoint (`http://` or `https://`). Default: the control plane
    /// the agent gets its configuration from.
    #[serde(default)]
    pub endpoint: Option<String>,
}

/// Implements `Deserialize` for option structs whose `remote = "Self"` inherent function reads
/// their fields: an absent or null `options` is read as an empty mapping, so every field takes
/// its default.
macro_rules! absent_is_empty {
    ($($options:ty),+ $(,)?) => {$(
        impl<'de> Deserialize<'de> for $options {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                deserializer.deserialize_option(AbsentIsEmpty::<$options>(PhantomData))
            }
        }

        impl<'de> Visitor<'de> for AbsentIsEmpty<$options> {
            type Value = $options;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a mapping of store options")
            }

            fn visit_none<E: de::Error>(self) -> Result<$options, E> {
                <$options>::deserialize(MapDeserializer::new(std::iter::empty::<(&str, &str)>()))
            }

            fn visit_unit<E: de::Error>(self) -> Result<$options, E> {
                self.visit_none()
            }

            fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<$options, D::Error> {
                <$options>::deserialize(deserializer)
            }
        }
    )+};
}

/// The visitor [`absent_is_empty!`] implements for each option struct.
struct AbsentIsEmpty<T>(PhantomData<T>);

absent_is_empty!(
    MemoryOptions,
    SqliteOptions,
    SqliteOutboxOptions,
    DynamoDbOptions,
    DynamoDbOutboxOptions,
    PostgresOptions,
    PostgresOutboxOptions,
    ControlPlaneOptions,
);

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

/// Default PostgreSQL schema.
pub fn default_postgres_schema() -> String {
    "public".to_owned()
}

#[cfg(test)]
mod tests {
    use super::super::{CheckError, check_bytes};
    use super::*;

    /// The validator's `path: message` lines about `stores` for a document whose only content
    /// is `stores` (it has no route, which is another error).
    fn check(stores: &str) -> Result<(), Vec<String>> {
        let doc = format!("bridge:\n  id: b\nstores:\n{stores}");
        let errors: Vec<String> = match check_bytes(doc.as_bytes(), &|_: &str| None) {
            Ok(_) => Vec::new(),
            Err(CheckError::Invalid(errors)) => errors
                .iter()
                .filter(|e| e.path.starts_with("stores."))
                .map(ToString::to_string)
                .collect(),
            Err(e @ CheckError::Load(_)) => panic!("a serde error instead of the validator's: {e}"),
        };
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }

    #[test]
    fn a_memory_outbox_without_options_gets_the_validators_explanation() {
        for options in [
            "",
            "    options:\n",
            "    options: ~\n",
            "    options: {}\n",
        ] {
            let errors = check(&format!("  outbox:\n    type: memory\n{options}"))
                .expect_err("volatile not acknowledged");
            assert_eq!(errors.len(), 1, "{errors:?}");
            assert!(
                errors[0].starts_with("stores.outbox.options.acknowledge_volatile: a memory outbox loses its records on restart"),
                "{errors:?}"
            );
        }
        let ok = "  outbox:\n    type: memory\n    options:\n      acknowledge_volatile: true\n";
        assert_eq!(check(ok), Ok(()));
    }

    #[test]
    fn every_store_type_parses_without_options_and_the_validator_names_what_is_missing() {
        let cases = [
            (
                "outbox",
                "sqlite",
                Some("stores.outbox.options.path: must not be empty"),
            ),
            (
                "outbox",
                "dynamodb",
                Some("stores.outbox.options.table_name: must not be empty"),
            ),
            (
                "outbox",
                "postgres",
                Some("stores.outbox.options.url: must be a postgres://"),
            ),
            ("lease", "memory", None),
            (
                "lease",
                "sqlite",
                Some("stores.lease.options.path: must not be empty"),
            ),
            (
                "lease",
                "dynamodb",
                Some("stores.lease.options.table_name: must not be empty"),
            ),
            ("lease", "control_plane", None),
            (
                "dlq",
                "memory",
                Some("stores.dlq.options.acknowledge_volatile: a memory dlq"),
            ),
            (
                "dlq",
                "sqlite",
                Some("stores.dlq.options.path: must not be empty"),
            ),
            (
                "dlq",
                "dynamodb",
                Some("stores.dlq.options.table_name: must not be empty"),
            ),
            ("dlq", "control_plane", None),
        ];
        for (store, kind, expected) in cases {
            let result = check(&format!("  {store}:\n    type: {kind}\n"));
            match expected {
                None => assert_eq!(result, Ok(()), "{store} {kind}"),
                Some(line) => {
                    let errors = result.expect_err(line);
                    assert!(
                        errors.iter().any(|e| e.starts_with(line)),
                        "{store} {kind}: {errors:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn absent_options_take_the_same_defaults_as_written_ones() {
        let parse =
            |yaml: &str| -> OutboxStoreConfig { serde_saphyr::from_str(yaml).expect("parses") };
        let absent = parse("type: sqlite\n");
        let empty = parse("type: sqlite\noptions: {}\n");
        assert_eq!(absent, empty);
        let OutboxStoreConfig::Sqlite(o) = absent else {
            panic!("sqlite");
        };
        assert_eq!(o.busy_timeout, default_busy_timeout());
        assert_eq!(o.synchronous, SqliteSynchronous::Full);
        // Options before the type are read the same way.
        assert_eq!(
            parse("options:\n  path: /x.db\ntype: sqlite\n"),
            parse("type: sqlite\noptions:\n  path: /x.db\n")
        );
    }

    #[test]
    fn an_unknown_option_is_still_refused_where_it_is_written() {
        let doc = "bridge:\n  id: b\nstores:\n  outbox:\n    type: memory\n    options:\n      acknowledge_volatil: true\n";
        let Err(CheckError::Load(e)) = check_bytes(doc.as_bytes(), &|_: &str| None) else {
            panic!("an unknown field is a load error");
        };
        let shown = e.to_string();
        assert!(
            shown.contains("unknown field `acknowledge_volatil`"),
            "{shown}"
        );
        assert!(shown.contains("line 7"), "{shown}");
    }
}
