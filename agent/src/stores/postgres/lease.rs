//! The PostgreSQL lease store: a key's row is never deleted, so its version
//! only grows, across releases, restarts and agents.
//!
//! Every call is one transaction that makes sure the key's row exists
//! (`INSERT … ON CONFLICT DO NOTHING` at version 0, which waits for a
//! concurrent insert of the same key to commit), locks it `FOR UPDATE`,
//! decides with the shared rules ([`ferry_shared::lease`]) and writes the
//! result. Two agents acquiring one key therefore decide one after the
//! other, the second seeing the first's grant: at most one unexpired holder,
//! and every grant at `last version + 1`. A row at version 0 was never
//! granted (a refused call rolls back the row it created).

use std::time::{Duration, SystemTime};

use super::{Db, PostgresOptions, TxError, in_transaction, schema, to_i64, to_u64};
use crate::stores::lease::{self, Grant, LeaseState};
use crate::stores::{
    Acquired, BoxFuture, Lease, LeaseStore, StoreResult, from_unix_nanos, unix_nanos,
};

/// Leases in a PostgreSQL database.
pub struct PostgresLeaseStore {
    db: Db,
    options: PostgresOptions,
}

impl PostgresLeaseStore {
    /// Connects and creates or migrates the table.
    pub async fn open(options: PostgresOptions) -> StoreResult<Self> {
        let db = Db::open(&options, "lease", schema::LEASE).await?;
        Ok(PostgresLeaseStore { db, options })
    }

    /// The options it was opened with.
    pub fn options(&self) -> &PostgresOptions {
        &self.options
    }
}

const COLUMNS: &str = "key, version, holder, acquired_at_ns, expires_at_ns";

fn decode(row: &tokio_postgres::Row) -> Result<Option<LeaseState>, TxError> {
    let version: i64 = row.try_get(1)?;
    if version == 0 {
        return Ok(None);
    }
    let holder: Option<String> = row.try_get(2)?;
    let acquired: Option<i64> = row.try_get(3)?;
    let expires: Option<i64> = row.try_get(4)?;
    let grant = match (holder, acquired, expires) {
        (Some(holder), Some(acquired), Some(expires)) => Some(Grant {
            holder,
            acquired_at: from_unix_nanos(acquired)?,
            expires_at: from_unix_nanos(expires)?,
        }),
        _ => None,
    };
    Ok(Some(LeaseState {
        key: row.try_get(0)?,
        version: to_u64(version)?,
        grant,
    }))
}

impl PostgresLeaseStore {
    /// Runs a shared grant rule on `key`'s locked row and stores the result,
    /// in one transaction.
    async fn apply<T, R>(&self, key: &str, rule: R) -> StoreResult<T>
    where
        T: Send,
        R: Fn(Option<LeaseState>) -> StoreResult<(LeaseState, T)> + Send + Sync,
    {
        in_transaction!(self.db, |tx| async {
            let create = tx
                .prepare_cached(
                    "INSERT INTO ferry_leases (key, version) VALUES ($1, 0) \
                     ON CONFLICT (key) DO NOTHING",
                )
                .await?;
            tx.execute(&create, &[&key]).await?;
            let lock = tx
                .prepare_cached(&format!(
                    "SELECT {COLUMNS} FROM ferry_leases WHERE key = $1 FOR UPDATE"
                ))
                .await?;
            let row = tx.query_one(&lock, &[&key]).await?;
            let (state, out) = rule(decode(&row)?)?;
            let (holder, acquired, expires) = match &state.grant {
                Some(g) => (
                    Some(g.holder.as_str()),
                    Some(unix_nanos(g.acquired_at)?),
                    Some(unix_nanos(g.expires_at)?),
                ),
                None => (None, None, None),
            };
            let store = tx
                .prepare_cached(
                    "UPDATE ferry_leases SET version = $2, holder = $3, acquired_at_ns = $4, \
                     expires_at_ns = $5 WHERE key = $1",
                )
                .await?;
            let version = to_i64(state.version)?;
            tx.execute(&store, &[&key, &version, &holder, &acquired, &expires])
                .await?;
            Ok::<_, TxError>(out)
        })
    }
}

impl LeaseStore for PostgresLeaseStore {
    fn acquire<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        ttl: Duration,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Acquired>> {
        Box::pin(self.apply(key, move |s| lease::acquire(s, key, holder, ttl, now)))
    }

    fn renew<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
        ttl: Duration,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Lease>> {
        Box::pin(self.apply(key, move |s| {
            lease::renew(s, key, holder, version, ttl, now)
        }))
    }

    fn release<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
    ) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(self.apply(key, move |s| {
            lease::release(s, key, holder, version).map(|state| (state, ()))
        }))
    }

    fn list(&self) -> BoxFuture<'_, StoreResult<Vec<LeaseState>>> {
        Box::pin(async move {
            let client = self.db.client().await?;
            let rows = client
                .query(
                    &format!("SELECT {COLUMNS} FROM ferry_leases WHERE version > 0 ORDER BY key"),
                    &[],
                )
                .await
                .map_err(super::pg_error)?;
            let mut out = Vec::with_capacity(rows.len());
            for row in &rows {
                match decode(row) {
                    Ok(Some(state)) => out.push(state),
                    Ok(None) => {}
                    Err(TxError::Db(e)) => return Err(super::pg_error(e)),
                    Err(TxError::Store(e)) => return Err(e),
                }
            }
            Ok(out)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stores::conformance::{postgres_database, t};

    /// A holder paused inside a renewal (its row locked, the transaction
    /// open) does not stop another agent taking the lapsed lease for long:
    /// the server ends the paused session (`super`'s invariant 5), and the
    /// new grant is the next version.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_holder_paused_inside_a_renewal_does_not_block_the_takeover() {
        let (options, _database) = postgres_database().await;
        let first = PostgresLeaseStore::open(options.clone())
            .await
            .expect("open");
        let second = PostgresLeaseStore::open(options).await.expect("open");
        let ttl = Duration::from_secs(3);
        let Ok(Acquired::Granted(lease)) = first.acquire("k", "a", ttl, t(0)).await else {
            panic!("the first acquire was not granted");
        };
        let mut paused = first.db.client().await.expect("client");
        let paused = paused.transaction().await.expect("begin");
        paused
            .query_one(
                &format!("SELECT {COLUMNS} FROM ferry_leases WHERE key = $1 FOR UPDATE"),
                &[&"k"],
            )
            .await
            .expect("lock");

        let takeover = tokio::time::timeout(
            Duration::from_secs(30),
            second.acquire("k", "b", ttl, t(10)),
        )
        .await
        .expect("the acquire waited on the paused holder's lock for 30 s");
        let Ok(Acquired::Granted(taken)) = takeover else {
            panic!("the lapsed lease was not granted: {takeover:?}");
        };
        assert_eq!(
            (taken.holder.as_str(), taken.version),
            ("b", lease.version + 1)
        );
        let late = paused.execute("DELETE FROM ferry_leases", &[]).await;
        assert!(late.is_err(), "the paused session was not ended: {late:?}");
    }
}
