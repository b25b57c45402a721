//! Leases in SQLite: the rules are in `state::leases`; this reads and writes
//! the key's row inside the caller's `BEGIN IMMEDIATE` transaction.

use std::time::{Duration, SystemTime};

use rusqlite::{Connection, Transaction};

use super::{exec, query_all, query_opt};
use crate::state::error::StateResult;
use crate::state::leases::{
    AcquireDecision, PAGE_KIND, decide_acquire, decide_release, decide_renew,
};
use crate::state::paging::{Page, PageRequest, paginate};
use crate::state::rows;
use crate::state::sql::{self, SqlArg};
use crate::state::types::{Lease, LeaseAcquisition};

pub(super) fn acquire(
    tx: &Transaction<'_>,
    key: &str,
    holder: &str,
    ttl: Duration,
    now: SystemTime,
) -> StateResult<LeaseAcquisition> {
    let decision = decide_acquire(read(tx, key)?, key, holder, ttl, now)?;
    if let AcquireDecision::Grant(lease) = &decision {
        exec(tx, sql::LEASE_UPSERT, &sql::lease_upsert_args(lease)?)?;
    }
    Ok(decision.into_acquisition())
}

pub(super) fn renew(
    tx: &Transaction<'_>,
    key: &str,
    holder: &str,
    version: u64,
    ttl: Duration,
    now: SystemTime,
) -> StateResult<Lease> {
    let lease = decide_renew(read(tx, key)?, key, holder, version, ttl, now)?;
    exec(tx, sql::LEASE_UPSERT, &sql::lease_upsert_args(&lease)?)?;
    Ok(lease)
}

pub(super) fn release(
    tx: &Transaction<'_>,
    key: &str,
    holder: &str,
    version: u64,
) -> StateResult<()> {
    if let Some(lease) = decide_release(read(tx, key)?, key, holder, version)? {
        exec(tx, sql::LEASE_UPSERT, &sql::lease_upsert_args(&lease)?)?;
    }
    Ok(())
}

pub(super) fn list(
    conn: &Connection,
    prefix: &str,
    page: &PageRequest,
) -> StateResult<Page<Lease>> {
    let after = page.cursor(PAGE_KIND)?.map(|c| c.text).unwrap_or_default();
    let args = [
        prefix.into(),
        SqlArg::Text(after),
        page.fetch_limit().into(),
    ];
    let rows = query_all(conn, &sql::lease_list(), &args, |r| rows::lease(r))?;
    Ok(paginate(page, PAGE_KIND, rows, |l| (l.key.clone(), 0)))
}

fn read(conn: &Connection, key: &str) -> StateResult<Option<Lease>> {
    query_opt(conn, &sql::lease_get(), &[key.into()], |r| rows::lease(r))
}
