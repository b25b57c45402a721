//! Reading rows into domain types, written once for both backends: each
//! backend implements [`Row`] for its driver's row type, and the column
//! order is the one the statements in `sql.rs` select.

use std::collections::BTreeMap;

use super::codec::{
    labels_from_db, opt_time_from_db, strings_from_db, time_from_db, u32_from_db, u64_from_db,
};
use super::error::{StateError, StateResult};
use super::types::{
    AgentBridgeStatus, AgentRecord, AppliedBy, ConfigAckRecord, ConfigNackRecord, ConfigPushRecord,
    ConfigVersion, DlqEntry, DlqReason, DlqStat, Lease, MetricsRecord, StoredConfig,
};

/// Typed access to one result row, by column index.
pub(crate) trait Row {
    fn text(&self, index: usize) -> StateResult<String>;
    fn opt_text(&self, index: usize) -> StateResult<Option<String>>;
    fn int(&self, index: usize) -> StateResult<i64>;
    fn opt_int(&self, index: usize) -> StateResult<Option<i64>>;
    fn boolean(&self, index: usize) -> StateResult<bool>;
    fn bytes(&self, index: usize) -> StateResult<Vec<u8>>;
}

pub(crate) fn config(row: &impl Row) -> StateResult<StoredConfig> {
    Ok(StoredConfig {
        bridge_id: row.text(0)?,
        version: u64_from_db(row.int(1)?)?,
        yaml: row.text(2)?,
        selector: labels_from_db(&row.text(3)?)?,
        change_note: row.text(4)?,
        created_at: time_from_db(row.int(5)?)?,
        digest: row.text(6)?,
        applied_by: AppliedBy {
            principal: row.text(7)?,
            client_address: row.text(8)?,
        },
    })
}

pub(crate) fn config_version(row: &impl Row) -> StateResult<ConfigVersion> {
    Ok(ConfigVersion {
        version: u64_from_db(row.int(0)?)?,
        created_at: time_from_db(row.int(1)?)?,
        change_note: row.text(2)?,
        digest: row.text(3)?,
        applied_by: AppliedBy {
            principal: row.text(4)?,
            client_address: row.text(5)?,
        },
    })
}

/// An agent without its bridges.
pub(crate) fn agent(row: &impl Row) -> StateResult<AgentRecord> {
    Ok(AgentRecord {
        agent_id: row.text(0)?,
        labels: labels_from_db(&row.text(1)?)?,
        build_version: row.text(2)?,
        capabilities: strings_from_db(&row.text(3)?)?,
        connected: row.boolean(4)?,
        connected_at: time_from_db(row.int(5)?)?,
        last_seen: time_from_db(row.int(6)?)?,
        disconnected_at: opt_time_from_db(row.opt_int(7)?)?,
        bridges: Vec::new(),
    })
}

/// One bridge status, with the agent id it belongs to.
pub(crate) fn agent_bridge(row: &impl Row) -> StateResult<(String, AgentBridgeStatus)> {
    let pushed = match (row.opt_int(2)?, row.opt_text(3)?, row.opt_int(4)?) {
        (Some(version), Some(nonce), Some(at)) => Some(ConfigPushRecord {
            version: u64_from_db(version)?,
            nonce,
            at: time_from_db(at)?,
        }),
        _ => None,
    };
    let acked = match (row.opt_int(5)?, row.opt_int(6)?) {
        (Some(version), Some(at)) => Some(ConfigAckRecord {
            version: u64_from_db(version)?,
            at: time_from_db(at)?,
        }),
        _ => None,
    };
    let last_nack = match (
        row.opt_int(7)?,
        row.opt_text(8)?,
        row.opt_text(9)?,
        row.opt_int(10)?,
    ) {
        (Some(version), Some(error), Some(details), Some(at)) => Some(ConfigNackRecord {
            version: u64_from_db(version)?,
            error,
            details: strings_from_db(&details)?,
            at: time_from_db(at)?,
        }),
        _ => None,
    };
    let status = AgentBridgeStatus {
        bridge_id: row.text(1)?,
        pushed,
        acked,
        last_nack,
    };
    Ok((row.text(0)?, status))
}

/// Attaches bridge statuses (as read by [`agent_bridge`]) to their agents.
pub(crate) fn attach_bridges(
    agents: Vec<AgentRecord>,
    bridges: Vec<(String, AgentBridgeStatus)>,
) -> Vec<AgentRecord> {
    let mut by_agent: BTreeMap<String, Vec<AgentBridgeStatus>> = BTreeMap::new();
    for (agent_id, status) in bridges {
        by_agent.entry(agent_id).or_default().push(status);
    }
    agents
        .into_iter()
        .map(|mut agent| {
            agent.bridges = by_agent.remove(&agent.agent_id).unwrap_or_default();
            agent
        })
        .collect()
}

pub(crate) fn lease(row: &impl Row) -> StateResult<Lease> {
    Ok(Lease {
        key: row.text(0)?,
        holder: row.opt_text(1)?,
        version: u64_from_db(row.int(2)?)?,
        acquired_at: time_from_db(row.int(3)?)?,
        expires_at: time_from_db(row.int(4)?)?,
    })
}

fn reason(text: &str) -> StateResult<DlqReason> {
    DlqReason::parse(text).ok_or_else(|| StateError::corrupt(format!("dlq reason {text:?}")))
}

pub(crate) fn dlq_entry(row: &impl Row) -> StateResult<DlqEntry> {
    Ok(DlqEntry {
        id: row.text(0)?,
        bridge_id: row.text(1)?,
        route_id: row.text(2)?,
        binding_id: row.text(3)?,
        reason: reason(&row.text(4)?)?,
        last_error: row.text(5)?,
        attempts: u32_from_db(row.int(6)?)?,
        first_attempt_at: opt_time_from_db(row.opt_int(7)?)?,
        last_attempt_at: opt_time_from_db(row.opt_int(8)?)?,
        dead_lettered_at: time_from_db(row.int(9)?)?,
        agent_id: row.text(10)?,
        address: row.text(11)?,
        envelope: row.bytes(12)?,
    })
}

pub(crate) fn dlq_stat(row: &impl Row) -> StateResult<DlqStat> {
    Ok(DlqStat {
        bridge_id: row.text(0)?,
        route_id: row.text(1)?,
        binding_id: row.text(2)?,
        reason: reason(&row.text(3)?)?,
        count: u64_from_db(row.int(4)?)?,
        oldest: time_from_db(row.int(5)?)?,
    })
}

pub(crate) fn metrics(row: &impl Row) -> StateResult<MetricsRecord> {
    Ok(MetricsRecord {
        agent_id: row.text(0)?,
        captured_at: time_from_db(row.int(1)?)?,
        snapshot: row.bytes(2)?,
    })
}
