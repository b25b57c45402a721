//! The SQL both backends run, written once with SQLite's numbered
//! placeholders (`?1`); the PostgreSQL backend rewrites them to `$1`. Both
//! schemas use the same tables and columns (`*/schema_v*.sql`), and every
//! statement here is valid in both dialects. Reads that a write transaction
//! must lock get `FOR UPDATE` appended on PostgreSQL only (SQLite's
//! `BEGIN IMMEDIATE` already holds the database's write lock).

use super::codec::{labels_to_db, require_id, strings_to_db, time_to_db, u64_to_db};
use super::error::StateResult;
use super::types::{AgentBridgeEvent, AgentHello, Lease, MetricsRecord, StoredConfig};

/// A value bound to a placeholder, the same for both drivers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SqlArg {
    Text(String),
    OptText(Option<String>),
    Int(i64),
    OptInt(Option<i64>),
    Bytes(Vec<u8>),
}

impl From<&str> for SqlArg {
    fn from(text: &str) -> Self {
        Self::Text(text.to_owned())
    }
}

impl From<i64> for SqlArg {
    fn from(value: i64) -> Self {
        Self::Int(value)
    }
}

// --- configurations ---------------------------------------------------------

/// Columns read by `rows::config`.
const CONFIG_COLUMNS: &str = "v.bridge_id, v.version, v.yaml, v.selector, v.change_note, \
     v.created_at, v.digest, v.applied_by, v.client_address";

pub(crate) const CONFIG_CURRENT_VERSION: &str = "SELECT version FROM configs WHERE bridge_id = ?1";

pub(crate) fn config_current() -> String {
    format!(
        "SELECT {CONFIG_COLUMNS} FROM configs c JOIN config_versions v \
         ON v.bridge_id = c.bridge_id AND v.version = c.version WHERE c.bridge_id = ?1"
    )
}

pub(crate) fn config_at_version() -> String {
    format!(
        "SELECT {CONFIG_COLUMNS} FROM config_versions v WHERE v.bridge_id = ?1 AND v.version = ?2"
    )
}

/// `?1`: the last bridge id of the previous page (`""` first), `?2`: limit.
pub(crate) fn config_list() -> String {
    format!(
        "SELECT {CONFIG_COLUMNS} FROM configs c JOIN config_versions v \
         ON v.bridge_id = c.bridge_id AND v.version = c.version \
         WHERE c.bridge_id > ?1 ORDER BY c.bridge_id LIMIT ?2"
    )
}

/// `?2`: versions below this, `?3`: limit. Read by `rows::config_version`.
pub(crate) const CONFIG_VERSIONS: &str = "SELECT version, created_at, change_note, digest, \
     applied_by, client_address FROM config_versions WHERE bridge_id = ?1 AND version < ?2 ORDER BY version DESC LIMIT ?3";

pub(crate) const CONFIG_INSERT_VERSION: &str = "INSERT INTO config_versions \
     (bridge_id, version, yaml, selector, change_note, digest, created_at, applied_by, \
     client_address) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)";

pub(crate) const CONFIG_SET_CURRENT: &str = "INSERT INTO configs (bridge_id, version) \
     VALUES (?1, ?2) ON CONFLICT (bridge_id) DO UPDATE SET version = excluded.version";

pub(crate) const CONFIG_DELETE_VERSIONS: &str = "DELETE FROM config_versions WHERE bridge_id = ?1";

pub(crate) const CONFIG_DELETE: &str = "DELETE FROM configs WHERE bridge_id = ?1";

// --- agents -----------------------------------------------------------------

/// Columns read by `rows::agent`.
const AGENT_SELECT: &str = "SELECT agent_id, labels, build_version, capabilities, connected, \
     connected_at, last_seen, disconnected_at FROM agents";

pub(crate) fn agent_get() -> String {
    format!("{AGENT_SELECT} WHERE agent_id = ?1")
}

pub(crate) fn agent_list() -> String {
    format!("{AGENT_SELECT} ORDER BY agent_id")
}

pub(crate) const AGENT_UPSERT: &str = "INSERT INTO agents (agent_id, labels, build_version, \
     capabilities, connected, connected_at, last_seen, disconnected_at) \
     VALUES (?1, ?2, ?3, ?4, TRUE, ?5, ?5, NULL) \
     ON CONFLICT (agent_id) DO UPDATE SET labels = excluded.labels, \
     build_version = excluded.build_version, capabilities = excluded.capabilities, \
     connected = excluded.connected, connected_at = excluded.connected_at, \
     last_seen = excluded.last_seen, disconnected_at = NULL";

pub(crate) const AGENT_SEEN: &str = "UPDATE agents SET last_seen = ?2 WHERE agent_id = ?1";

pub(crate) const AGENT_DISCONNECTED: &str = "UPDATE agents SET connected = FALSE, \
     disconnected_at = ?2 WHERE agent_id = ?1";

pub(crate) const AGENT_EXISTS: &str = "SELECT 1 FROM agents WHERE agent_id = ?1";

/// Columns read by `rows::agent_bridge`; `?1`: the agent.
const AGENT_BRIDGE_SELECT: &str = "SELECT agent_id, bridge_id, pushed_version, pushed_nonce, \
     pushed_at, acked_version, acked_at, nack_version, nack_error, nack_details, nack_at \
     FROM agent_bridges";

pub(crate) fn agent_bridges_of() -> String {
    format!("{AGENT_BRIDGE_SELECT} WHERE agent_id = ?1 ORDER BY bridge_id")
}

pub(crate) fn agent_bridges_all() -> String {
    format!("{AGENT_BRIDGE_SELECT} ORDER BY agent_id, bridge_id")
}

/// `?3` version, `?4` nonce, `?5` time.
pub(crate) const AGENT_BRIDGE_PUSHED: &str = "INSERT INTO agent_bridges \
     (agent_id, bridge_id, pushed_version, pushed_nonce, pushed_at) VALUES (?1, ?2, ?3, ?4, ?5) \
     ON CONFLICT (agent_id, bridge_id) DO UPDATE SET pushed_version = excluded.pushed_version, \
     pushed_nonce = excluded.pushed_nonce, pushed_at = excluded.pushed_at";

/// `?3` version, `?4` time.
pub(crate) const AGENT_BRIDGE_ACKED: &str = "INSERT INTO agent_bridges \
     (agent_id, bridge_id, acked_version, acked_at) VALUES (?1, ?2, ?3, ?4) \
     ON CONFLICT (agent_id, bridge_id) DO UPDATE SET acked_version = excluded.acked_version, \
     acked_at = excluded.acked_at";

/// `?3` version, `?4` error, `?5` details (JSON), `?6` time.
pub(crate) const AGENT_BRIDGE_NACKED: &str = "INSERT INTO agent_bridges \
     (agent_id, bridge_id, nack_version, nack_error, nack_details, nack_at) \
     VALUES (?1, ?2, ?3, ?4, ?5, ?6) \
     ON CONFLICT (agent_id, bridge_id) DO UPDATE SET nack_version = excluded.nack_version, \
     nack_error = excluded.nack_error, nack_details = excluded.nack_details, \
     nack_at = excluded.nack_at";

pub(crate) const AGENT_BRIDGE_WITHDRAWN: &str =
    "DELETE FROM agent_bridges WHERE agent_id = ?1 AND bridge_id = ?2";

// --- leases -----------------------------------------------------------------

/// Columns read by `rows::lease`.
const LEASE_SELECT: &str = "SELECT lease_key, holder, version, acquired_at, expires_at FROM leases";

pub(crate) fn lease_get() -> String {
    format!("{LEASE_SELECT} WHERE lease_key = ?1")
}

/// `?1` prefix, `?2` last key of the previous page (`""` first), `?3` limit.
pub(crate) fn lease_list() -> String {
    format!(
        "{LEASE_SELECT} WHERE substr(lease_key, 1, length(?1)) = ?1 AND lease_key > ?2 \
         ORDER BY lease_key LIMIT ?3"
    )
}

pub(crate) const LEASE_UPSERT: &str = "INSERT INTO leases \
     (lease_key, holder, version, acquired_at, expires_at) VALUES (?1, ?2, ?3, ?4, ?5) \
     ON CONFLICT (lease_key) DO UPDATE SET holder = excluded.holder, \
     version = excluded.version, acquired_at = excluded.acquired_at, \
     expires_at = excluded.expires_at";

// --- dead letters -----------------------------------------------------------

/// Columns read by `rows::dlq_entry`.
pub(crate) const DLQ_SELECT: &str = "SELECT id, bridge_id, route_id, binding_id, reason, \
     last_error, attempts, first_attempt_at, last_attempt_at, dead_lettered_at, agent_id, \
     address, envelope FROM dlq_entries";

pub(crate) const DLQ_INSERT: &str = "INSERT INTO dlq_entries (id, bridge_id, route_id, \
     binding_id, reason, last_error, attempts, first_attempt_at, last_attempt_at, \
     dead_lettered_at, agent_id, address, envelope) \
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13) \
     ON CONFLICT (id) DO NOTHING";

pub(crate) const DLQ_DELETE: &str = "DELETE FROM dlq_entries WHERE id = ?1";

/// Followed by a `dlq::where_clause`. Read by `rows::dlq_stat`.
pub(crate) const DLQ_STATS_SELECT: &str = "SELECT bridge_id, route_id, binding_id, reason, \
     COUNT(*), MIN(dead_lettered_at) FROM dlq_entries";

pub(crate) const DLQ_STATS_GROUP: &str = "GROUP BY bridge_id, route_id, binding_id, reason \
     ORDER BY bridge_id, route_id, binding_id, reason";

// --- metrics ----------------------------------------------------------------

pub(crate) const METRICS_UPSERT: &str = "INSERT INTO metrics_snapshots \
     (agent_id, captured_at, snapshot) VALUES (?1, ?2, ?3) \
     ON CONFLICT (agent_id) DO UPDATE SET captured_at = excluded.captured_at, \
     snapshot = excluded.snapshot \
     WHERE excluded.captured_at >= metrics_snapshots.captured_at";

/// Columns read by `rows::metrics`.
pub(crate) const METRICS_GET: &str =
    "SELECT agent_id, captured_at, snapshot FROM metrics_snapshots WHERE agent_id = ?1";

pub(crate) const METRICS_LIST: &str =
    "SELECT agent_id, captured_at, snapshot FROM metrics_snapshots ORDER BY agent_id";

// --- arguments ----------------------------------------------------------------

/// The arguments of [`CONFIG_INSERT_VERSION`].
pub(crate) fn config_insert_args(config: &StoredConfig) -> StateResult<Vec<SqlArg>> {
    Ok(vec![
        config.bridge_id.as_str().into(),
        u64_to_db(config.version)?.into(),
        config.yaml.as_str().into(),
        SqlArg::Text(labels_to_db(&config.selector)?),
        config.change_note.as_str().into(),
        config.digest.as_str().into(),
        time_to_db(config.created_at)?.into(),
        config.applied_by.principal.as_str().into(),
        config.applied_by.client_address.as_str().into(),
    ])
}

/// The arguments of [`AGENT_UPSERT`].
pub(crate) fn agent_upsert_args(hello: &AgentHello) -> StateResult<Vec<SqlArg>> {
    require_id("agent id", &hello.agent_id)?;
    Ok(vec![
        hello.agent_id.as_str().into(),
        SqlArg::Text(labels_to_db(&hello.labels)?),
        hello.build_version.as_str().into(),
        SqlArg::Text(strings_to_db(&hello.capabilities)?),
        time_to_db(hello.connected_at)?.into(),
    ])
}

/// The statement and arguments recording `event`.
pub(crate) fn agent_bridge_event(
    agent_id: &str,
    bridge_id: &str,
    event: &AgentBridgeEvent,
    at: std::time::SystemTime,
) -> StateResult<(&'static str, Vec<SqlArg>)> {
    require_id("agent id", agent_id)?;
    require_id("bridge id", bridge_id)?;
    let mut args = vec![SqlArg::from(agent_id), SqlArg::from(bridge_id)];
    let at = time_to_db(at)?;
    let sql = match event {
        AgentBridgeEvent::Pushed { version, nonce } => {
            args.extend([
                u64_to_db(*version)?.into(),
                nonce.as_str().into(),
                at.into(),
            ]);
            AGENT_BRIDGE_PUSHED
        }
        AgentBridgeEvent::Acked { version } => {
            args.extend([u64_to_db(*version)?.into(), at.into()]);
            AGENT_BRIDGE_ACKED
        }
        AgentBridgeEvent::Nacked {
            version,
            error,
            details,
        } => {
            args.extend([
                u64_to_db(*version)?.into(),
                error.as_str().into(),
                SqlArg::Text(strings_to_db(details)?),
                at.into(),
            ]);
            AGENT_BRIDGE_NACKED
        }
        AgentBridgeEvent::Withdrawn => AGENT_BRIDGE_WITHDRAWN,
    };
    Ok((sql, args))
}

/// The arguments of [`LEASE_UPSERT`].
pub(crate) fn lease_upsert_args(lease: &Lease) -> StateResult<Vec<SqlArg>> {
    Ok(vec![
        lease.key.as_str().into(),
        SqlArg::OptText(lease.holder.clone()),
        u64_to_db(lease.version)?.into(),
        time_to_db(lease.acquired_at)?.into(),
        time_to_db(lease.expires_at)?.into(),
    ])
}

/// The arguments of [`METRICS_UPSERT`].
pub(crate) fn metrics_upsert_args(record: &MetricsRecord) -> StateResult<Vec<SqlArg>> {
    require_id("agent id", &record.agent_id)?;
    Ok(vec![
        record.agent_id.as_str().into(),
        time_to_db(record.captured_at)?.into(),
        SqlArg::Bytes(record.snapshot.clone()),
    ])
}

/// A time argument (for `AGENT_SEEN` and `AGENT_DISCONNECTED`).
pub(crate) fn time_arg(at: std::time::SystemTime) -> StateResult<SqlArg> {
    Ok(SqlArg::Int(time_to_db(at)?))
}
