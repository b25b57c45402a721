//! Configurations and their history in PostgreSQL (statements in
//! `state::sql`, decisions in `state::configs`). A write locks the bridge's
//! `configs` row first, so replicas decide one after the other.

use std::time::SystemTime;

use tokio_postgres::{GenericClient, Transaction};

use super::{TxResult, exec, pg, query_all, query_opt};
use crate::state::codec::{u64_from_db, u64_to_db};
use crate::state::configs::{
    ApplyDecision, check_expected, config_not_found, decide_apply, versions_before, versions_page,
};
use crate::state::paging::{Page, PageRequest, paginate};
use crate::state::rows::{self, Row};
use crate::state::sql::{self, SqlArg};
use crate::state::types::{AppliedConfig, ApplyConfig, ConfigVersion, StoredConfig};

pub(super) async fn apply(
    tx: &Transaction<'_>,
    apply: &ApplyConfig,
    now: SystemTime,
) -> TxResult<AppliedConfig> {
    lock_current_version(tx, &apply.bridge_id).await?;
    let current = query_opt(
        tx,
        &sql::config_current(),
        &[apply.bridge_id.as_str().into()],
        rows::config,
    )
    .await?;
    match decide_apply(current, apply, now)? {
        ApplyDecision::Unchanged(config) => Ok(AppliedConfig {
            config,
            changed: false,
        }),
        ApplyDecision::Store(config) => {
            exec(
                tx,
                sql::CONFIG_INSERT_VERSION,
                &sql::config_insert_args(&config)?,
            )
            .await?;
            let current = [
                config.bridge_id.as_str().into(),
                u64_to_db(config.version)?.into(),
            ];
            exec(tx, sql::CONFIG_SET_CURRENT, &current).await?;
            Ok(AppliedConfig {
                config,
                changed: true,
            })
        }
    }
}

pub(super) async fn get(
    client: &(impl GenericClient + Sync),
    bridge_id: &str,
    version: Option<u64>,
) -> TxResult<StoredConfig> {
    let found = match version {
        None => {
            query_opt(client, &sql::config_current(), &[bridge_id.into()], |r| {
                rows::config(r)
            })
            .await?
        }
        Some(v) => {
            let args = [bridge_id.into(), u64_to_db(v)?.into()];
            query_opt(client, &sql::config_at_version(), &args, |r| {
                rows::config(r)
            })
            .await?
        }
    };
    Ok(found.ok_or_else(|| config_not_found(bridge_id, version))?)
}

pub(super) async fn list(
    client: &(impl GenericClient + Sync),
    page: &PageRequest,
) -> TxResult<Page<StoredConfig>> {
    let after = page.cursor("configs")?.map(|c| c.text).unwrap_or_default();
    let args = [SqlArg::Text(after), page.fetch_limit().into()];
    let rows = query_all(client, &sql::config_list(), &args, rows::config).await?;
    Ok(paginate(page, "configs", rows, |c| {
        (c.bridge_id.clone(), 0)
    }))
}

pub(super) async fn versions(
    client: &(impl GenericClient + Sync),
    bridge_id: &str,
    page: &PageRequest,
) -> TxResult<Page<ConfigVersion>> {
    let exists = query_opt(
        client,
        sql::CONFIG_CURRENT_VERSION,
        &[bridge_id.into()],
        |_| Ok(()),
    )
    .await?
    .is_some();
    if !exists {
        return Err(config_not_found(bridge_id, None).into());
    }
    let args = [
        bridge_id.into(),
        versions_before(page)?.into(),
        page.fetch_limit().into(),
    ];
    let rows = query_all(client, sql::CONFIG_VERSIONS, &args, |r| {
        rows::config_version(r)
    })
    .await?;
    Ok(versions_page(page, rows))
}

pub(super) async fn delete(
    tx: &Transaction<'_>,
    bridge_id: &str,
    expected_version: Option<u64>,
) -> TxResult<()> {
    let current = lock_current_version(tx, bridge_id).await?;
    check_expected(expected_version, current.unwrap_or(0))?;
    if current.is_none() {
        return Err(config_not_found(bridge_id, None).into());
    }
    exec(tx, sql::CONFIG_DELETE_VERSIONS, &[bridge_id.into()]).await?;
    exec(tx, sql::CONFIG_DELETE, &[bridge_id.into()]).await?;
    Ok(())
}

/// Reads the current version with the row locked until the transaction
/// ends. When there is no row, two creators race; the loser's insert hits
/// the primary key and its transaction is retried.
async fn lock_current_version(tx: &Transaction<'_>, bridge_id: &str) -> TxResult<Option<u64>> {
    let statement = format!("{} FOR UPDATE", pg(sql::CONFIG_CURRENT_VERSION));
    query_opt(tx, &statement, &[bridge_id.into()], |row| {
        u64_from_db(row.int(0)?)
    })
    .await
}
