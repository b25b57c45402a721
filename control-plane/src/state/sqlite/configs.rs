//! Configurations and their history in SQLite (statements in `state::sql`,
//! decisions in `state::configs`).

use std::time::SystemTime;

use rusqlite::{Connection, Transaction};

use super::{exec, query_all, query_opt};
use crate::state::codec::{u64_from_db, u64_to_db};
use crate::state::configs::{
    ApplyDecision, check_expected, config_not_found, decide_apply, versions_before, versions_page,
};
use crate::state::error::StateResult;
use crate::state::paging::{Page, PageRequest, paginate};
use crate::state::rows::{self, Row};
use crate::state::sql::{self, SqlArg};
use crate::state::types::{AppliedConfig, ApplyConfig, ConfigVersion, StoredConfig};

pub(super) fn apply(
    tx: &Transaction<'_>,
    apply: &ApplyConfig,
    now: SystemTime,
) -> StateResult<AppliedConfig> {
    let current = query_opt(
        tx,
        &sql::config_current(),
        &[apply.bridge_id.as_str().into()],
        |r| rows::config(r),
    )?;
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
            )?;
            let current = [
                config.bridge_id.as_str().into(),
                u64_to_db(config.version)?.into(),
            ];
            exec(tx, sql::CONFIG_SET_CURRENT, &current)?;
            Ok(AppliedConfig {
                config,
                changed: true,
            })
        }
    }
}

pub(super) fn get(
    conn: &Connection,
    bridge_id: &str,
    version: Option<u64>,
) -> StateResult<StoredConfig> {
    let found = match version {
        None => query_opt(conn, &sql::config_current(), &[bridge_id.into()], |r| {
            rows::config(r)
        })?,
        Some(v) => {
            let args = [bridge_id.into(), u64_to_db(v)?.into()];
            query_opt(conn, &sql::config_at_version(), &args, |r| rows::config(r))?
        }
    };
    found.ok_or_else(|| config_not_found(bridge_id, version))
}

pub(super) fn list(conn: &Connection, page: &PageRequest) -> StateResult<Page<StoredConfig>> {
    let after = page.cursor("configs")?.map(|c| c.text).unwrap_or_default();
    let args = [SqlArg::Text(after), page.fetch_limit().into()];
    let rows = query_all(conn, &sql::config_list(), &args, |r| rows::config(r))?;
    Ok(paginate(page, "configs", rows, |c| {
        (c.bridge_id.clone(), 0)
    }))
}

pub(super) fn versions(
    conn: &Connection,
    bridge_id: &str,
    page: &PageRequest,
) -> StateResult<Page<ConfigVersion>> {
    if current_version(conn, bridge_id)?.is_none() {
        return Err(config_not_found(bridge_id, None));
    }
    let args = [
        bridge_id.into(),
        versions_before(page)?.into(),
        page.fetch_limit().into(),
    ];
    let rows = query_all(conn, sql::CONFIG_VERSIONS, &args, |r| {
        rows::config_version(r)
    })?;
    Ok(versions_page(page, rows))
}

pub(super) fn delete(
    tx: &Transaction<'_>,
    bridge_id: &str,
    expected_version: Option<u64>,
) -> StateResult<()> {
    let current = current_version(tx, bridge_id)?;
    check_expected(expected_version, current.unwrap_or(0))?;
    if current.is_none() {
        return Err(config_not_found(bridge_id, None));
    }
    exec(tx, sql::CONFIG_DELETE_VERSIONS, &[bridge_id.into()])?;
    exec(tx, sql::CONFIG_DELETE, &[bridge_id.into()])?;
    Ok(())
}

fn current_version(conn: &Connection, bridge_id: &str) -> StateResult<Option<u64>> {
    query_opt(
        conn,
        sql::CONFIG_CURRENT_VERSION,
        &[bridge_id.into()],
        |row| u64_from_db(row.int(0)?),
    )
}
