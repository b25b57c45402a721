//! Agents and their per-bridge status in SQLite.

use std::time::SystemTime;

use rusqlite::{Connection, Transaction};

use super::{exec, query_all, query_opt};
use crate::state::agents::agent_not_found;
use crate::state::error::StateResult;
use crate::state::rows;
use crate::state::sql;
use crate::state::types::{AgentBridgeEvent, AgentHello, AgentRecord};

pub(super) fn upsert(tx: &Transaction<'_>, hello: &AgentHello) -> StateResult<()> {
    exec(tx, sql::AGENT_UPSERT, &sql::agent_upsert_args(hello)?)?;
    Ok(())
}

pub(super) fn seen(tx: &Transaction<'_>, agent_id: &str, at: SystemTime) -> StateResult<()> {
    match exec(tx, sql::AGENT_SEEN, &[agent_id.into(), sql::time_arg(at)?])? {
        0 => Err(agent_not_found(agent_id)),
        _ => Ok(()),
    }
}

pub(super) fn disconnected(
    tx: &Transaction<'_>,
    agent_id: &str,
    at: SystemTime,
) -> StateResult<()> {
    match exec(
        tx,
        sql::AGENT_DISCONNECTED,
        &[agent_id.into(), sql::time_arg(at)?],
    )? {
        0 => Err(agent_not_found(agent_id)),
        _ => Ok(()),
    }
}

pub(super) fn record(
    tx: &Transaction<'_>,
    agent_id: &str,
    bridge_id: &str,
    event: &AgentBridgeEvent,
    at: SystemTime,
) -> StateResult<()> {
    let (statement, args) = sql::agent_bridge_event(agent_id, bridge_id, event, at)?;
    if query_opt(tx, sql::AGENT_EXISTS, &[agent_id.into()], |_| Ok(()))?.is_none() {
        return Err(agent_not_found(agent_id));
    }
    exec(tx, statement, &args)?;
    Ok(())
}

pub(super) fn get(conn: &Connection, agent_id: &str) -> StateResult<AgentRecord> {
    let agent = query_opt(conn, &sql::agent_get(), &[agent_id.into()], |r| {
        rows::agent(r)
    })?
    .ok_or_else(|| agent_not_found(agent_id))?;
    let bridges = query_all(conn, &sql::agent_bridges_of(), &[agent_id.into()], |r| {
        rows::agent_bridge(r)
    })?;
    Ok(AgentRecord {
        bridges: bridges.into_iter().map(|(_, status)| status).collect(),
        ..agent
    })
}

pub(super) fn list(conn: &Connection) -> StateResult<Vec<AgentRecord>> {
    let agents = query_all(conn, &sql::agent_list(), &[], |r| rows::agent(r))?;
    let bridges = query_all(conn, &sql::agent_bridges_all(), &[], |r| {
        rows::agent_bridge(r)
    })?;
    Ok(rows::attach_bridges(agents, bridges))
}
