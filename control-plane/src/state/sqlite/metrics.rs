//! The latest metrics snapshot per agent in SQLite.

use rusqlite::{Connection, Transaction};

use super::{exec, query_all, query_opt};
use crate::state::error::{StateError, StateResult};
use crate::state::rows;
use crate::state::sql;
use crate::state::types::MetricsRecord;

pub(super) fn put(tx: &Transaction<'_>, record: &MetricsRecord) -> StateResult<()> {
    exec(tx, sql::METRICS_UPSERT, &sql::metrics_upsert_args(record)?)?;
    Ok(())
}

pub(super) fn get(conn: &Connection, agent_id: &str) -> StateResult<MetricsRecord> {
    query_opt(conn, sql::METRICS_GET, &[agent_id.into()], |r| {
        rows::metrics(r)
    })?
    .ok_or_else(|| StateError::not_found(format!("metrics of agent {agent_id:?}")))
}

pub(super) fn list(conn: &Connection) -> StateResult<Vec<MetricsRecord>> {
    query_all(conn, sql::METRICS_LIST, &[], |r| rows::metrics(r))
}
