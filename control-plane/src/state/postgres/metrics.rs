//! The latest metrics snapshot per agent in PostgreSQL.

use tokio_postgres::{GenericClient, Transaction};

use super::{TxResult, exec, query_all, query_opt};
use crate::state::error::StateError;
use crate::state::rows;
use crate::state::sql;
use crate::state::types::MetricsRecord;

pub(super) async fn put(tx: &Transaction<'_>, record: &MetricsRecord) -> TxResult<()> {
    exec(tx, sql::METRICS_UPSERT, &sql::metrics_upsert_args(record)?).await?;
    Ok(())
}

pub(super) async fn get(
    client: &(impl GenericClient + Sync),
    agent_id: &str,
) -> TxResult<MetricsRecord> {
    let found = query_opt(client, sql::METRICS_GET, &[agent_id.into()], |r| {
        rows::metrics(r)
    })
    .await?;
    Ok(found.ok_or_else(|| StateError::not_found(format!("metrics of agent {agent_id:?}")))?)
}

pub(super) async fn list(client: &(impl GenericClient + Sync)) -> TxResult<Vec<MetricsRecord>> {
    query_all(client, sql::METRICS_LIST, &[], rows::metrics).await
}
