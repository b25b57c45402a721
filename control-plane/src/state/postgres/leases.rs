//! Leases in PostgreSQL: the rules are in `state::leases`; this locks the
//! key's row (creating it first if needed, so there is always a row to lock
//! and replicas decide one after the other), decides and writes.

use std::time::{Duration, SystemTime};

use tokio_postgres::{GenericClient, Transaction};

use super::{TxResult, exec, query_all, query_opt};
use crate::state::leases::{
    AcquireDecision, PAGE_KIND, decide_acquire, decide_release, decide_renew,
};
use crate::state::paging::{Page, PageRequest, paginate};
use crate::state::rows;
use crate::state::sql::{self, SqlArg};
use crate::state::types::{Lease, LeaseAcquisition};

/// A never-granted row (version 0), committed only together with a grant.
const ENSURE_ROW: &str = "INSERT INTO leases (lease_key, holder, version, acquired_at, \
     expires_at) VALUES (?1, NULL, 0, 0, 0) ON CONFLICT (lease_key) DO NOTHING";

pub(super) async fn acquire(
    tx: &Transaction<'_>,
    key: &str,
    holder: &str,
    ttl: Duration,
    now: SystemTime,
) -> TxResult<LeaseAcquisition> {
    exec(tx, ENSURE_ROW, &[key.into()]).await?;
    let decision = decide_acquire(lock(tx, key).await?, key, holder, ttl, now)?;
    if let AcquireDecision::Grant(lease) = &decision {
        exec(tx, sql::LEASE_UPSERT, &sql::lease_upsert_args(lease)?).await?;
    }
    Ok(decision.into_acquisition())
}

pub(super) async fn renew(
    tx: &Transaction<'_>,
    key: &str,
    holder: &str,
    version: u64,
    ttl: Duration,
    now: SystemTime,
) -> TxResult<Lease> {
    let lease = decide_renew(lock(tx, key).await?, key, holder, version, ttl, now)?;
    exec(tx, sql::LEASE_UPSERT, &sql::lease_upsert_args(&lease)?).await?;
    Ok(lease)
}

pub(super) async fn release(
    tx: &Transaction<'_>,
    key: &str,
    holder: &str,
    version: u64,
) -> TxResult<()> {
    if let Some(lease) = decide_release(lock(tx, key).await?, key, holder, version)? {
        exec(tx, sql::LEASE_UPSERT, &sql::lease_upsert_args(&lease)?).await?;
    }
    Ok(())
}

pub(super) async fn list(
    client: &(impl GenericClient + Sync),
    prefix: &str,
    page: &PageRequest,
) -> TxResult<Page<Lease>> {
    let after = page.cursor(PAGE_KIND)?.map(|c| c.text).unwrap_or_default();
    let args = [
        prefix.into(),
        SqlArg::Text(after),
        page.fetch_limit().into(),
    ];
    let rows = query_all(client, &sql::lease_list(), &args, rows::lease).await?;
    Ok(paginate(page, PAGE_KIND, rows, |l| (l.key.clone(), 0)))
}

async fn lock(tx: &Transaction<'_>, key: &str) -> TxResult<Option<Lease>> {
    let statement = format!("{} FOR UPDATE", sql::lease_get());
    query_opt(tx, &statement, &[key.into()], rows::lease).await
}
