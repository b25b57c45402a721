//! Agents and their per-bridge status in PostgreSQL.

use std::time::SystemTime;

use tokio_postgres::{GenericClient, Transaction};

use super::{TxResult, exec, query_all, query_opt};
use crate::state::agents::agent_not_found;
use crate::state::rows;
use crate::state::sql;
use crate::state::types::{AgentBridgeEvent, AgentHello, AgentRecord};

pub(super) async fn upsert(tx: &Transaction<'_>, hello: &AgentHello) -> TxResult<()> {
    exec(tx, sql::AGENT_UPSERT, &sql::agent_upsert_args(hello)?).await?;
    Ok(())
}

pub(super) async fn seen(tx: &Transaction<'_>, agent_id: &str, at: SystemTime) -> TxResult<()> {
    match exec(tx, sql::AGENT_SEEN, &[agent_id.into(), sql::time_arg(at)?]).await? {
        0 => Err(agent_not_found(agent_id).into()),
        _ => Ok(()),
    }
}

pub(super) async fn disconnected(
    tx: &Transaction<'_>,
    agent_id: &str,
    at: SystemTime,
) -> TxResult<()> {
    match exec(
        tx,
        sql::AGENT_DISCONNECTED,
        &[agent_id.into(), sql::time_arg(at)?],
    )
    .await?
    {
        0 => Err(agent_not_found(agent_id).into()),
        _ => Ok(()),
    }
}

pub(super) async fn record(
    tx: &Transaction<'_>,
    agent_id: &str,
    bridge_id: &str,
    event: &AgentBridgeEvent,
    at: SystemTime,
) -> TxResult<()> {
    let (statement, args) = sql::agent_bridge_event(agent_id, bridge_id, event, at)?;
    let exists = query_opt(tx, sql::AGENT_EXISTS, &[agent_id.into()], |_| Ok(())).await?;
    if exists.is_none() {
        return Err(agent_not_found(agent_id).into());
    }
    exec(tx, statement, &args).await?;
    Ok(())
}

pub(super) async fn get(
    client: &(impl GenericClient + Sync),
    agent_id: &str,
) -> TxResult<AgentRecord> {
    let agent = query_opt(client, &sql::agent_get(), &[agent_id.into()], |r| {
        rows::agent(r)
    })
    .await?
    .ok_or_else(|| agent_not_found(agent_id))?;
    let bridges = query_all(client, &sql::agent_bridges_of(), &[agent_id.into()], |r| {
        rows::agent_bridge(r)
    })
    .await?;
    Ok(AgentRecord {
        bridges: bridges.into_iter().map(|(_, status)| status).collect(),
        ..agent
    })
}

pub(super) async fn list(client: &(impl GenericClient + Sync)) -> TxResult<Vec<AgentRecord>> {
    let agents = query_all(client, &sql::agent_list(), &[], rows::agent).await?;
    let bridges = query_all(client, &sql::agent_bridges_all(), &[], |r| {
        rows::agent_bridge(r)
    })
    .await?;
    Ok(rows::attach_bridges(agents, bridges))
}
