//! The SQLite lease store: a key's row is never deleted, so its version only
//! grows, across releases and restarts.

use std::time::{Duration, SystemTime};

use rusqlite::{Connection, OptionalExtension, Row, params};

use super::{Db, SqliteOptions, schema, sql_error, to_i64, to_u64};
use crate::stores::lease::{self, Grant, LeaseState};
use crate::stores::{
    Acquired, BoxFuture, Lease, LeaseStore, StoreResult, from_unix_nanos, unix_nanos,
};

/// Leases in a SQLite database.
pub struct SqliteLeaseStore {
    db: Db,
    options: SqliteOptions,
}

impl SqliteLeaseStore {
    /// Opens the lease store at `options.path`, creating it if needed.
    pub async fn open(options: SqliteOptions) -> StoreResult<Self> {
        let db = Db::open(options.clone(), "lease", schema::lease).await?;
        Ok(SqliteLeaseStore { db, options })
    }

    /// The options it was opened with.
    pub fn options(&self) -> &SqliteOptions {
        &self.options
    }

    /// Finishes the writes already sent and closes the database.
    pub async fn close(self) {
        self.db.close().await;
    }
}

type RawLease = (String, i64, Option<String>, Option<i64>, Option<i64>);

fn raw(r: &Row<'_>) -> rusqlite::Result<RawLease> {
    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
}

fn decode((key, version, holder, acquired, expires): RawLease) -> StoreResult<LeaseState> {
    let grant = match (holder, acquired, expires) {
        (Some(holder), Some(acquired), Some(expires)) => Some(Grant {
            holder,
            acquired_at: from_unix_nanos(acquired)?,
            expires_at: from_unix_nanos(expires)?,
        }),
        _ => None,
    };
    Ok(LeaseState {
        key,
        version: to_u64(version)?,
        grant,
    })
}

fn load(conn: &Connection, key: &str) -> StoreResult<Option<LeaseState>> {
    conn.prepare_cached(
        "SELECT key, version, holder, acquired_at_ns, expires_at_ns FROM leases WHERE key=?1",
    )
    .map_err(sql_error)?
    .query_row([key], raw)
    .optional()
    .map_err(sql_error)?
    .map(decode)
    .transpose()
}

fn store(conn: &Connection, s: &LeaseState) -> StoreResult<()> {
    let (holder, acquired, expires) = match &s.grant {
        Some(g) => (
            Some(g.holder.as_str()),
            Some(unix_nanos(g.acquired_at)?),
            Some(unix_nanos(g.expires_at)?),
        ),
        None => (None, None, None),
    };
    conn.prepare_cached(
        "INSERT INTO leases (key, version, holder, acquired_at_ns, expires_at_ns) \
         VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (key) DO UPDATE SET version=?2, \
         holder=?3, acquired_at_ns=?4, expires_at_ns=?5",
    )
    .map_err(sql_error)?
    .execute(params![
        s.key,
        to_i64(s.version)?,
        holder,
        acquired,
        expires
    ])
    .map_err(sql_error)?;
    Ok(())
}

impl SqliteLeaseStore {
    /// Runs a shared grant rule on `key`'s stored state and stores the
    /// result, in one writer job.
    async fn apply<T, R>(&self, key: &str, rule: R) -> StoreResult<T>
    where
        T: Send + 'static,
        R: FnOnce(Option<LeaseState>) -> StoreResult<(LeaseState, T)> + Send + 'static,
    {
        let key = key.to_owned();
        self.db
            .write(move |conn| {
                let (state, out) = rule(load(conn, &key)?)?;
                store(conn, &state)?;
                Ok(out)
            })
            .await
    }
}

impl LeaseStore for SqliteLeaseStore {
    fn acquire<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        ttl: Duration,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Acquired>> {
        let (k, h) = (key.to_owned(), holder.to_owned());
        Box::pin(self.apply(key, move |s| lease::acquire(s, &k, &h, ttl, now)))
    }

    fn renew<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
        ttl: Duration,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Lease>> {
        let (k, h) = (key.to_owned(), holder.to_owned());
        Box::pin(self.apply(key, move |s| lease::renew(s, &k, &h, version, ttl, now)))
    }

    fn release<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
    ) -> BoxFuture<'a, StoreResult<()>> {
        let (k, h) = (key.to_owned(), holder.to_owned());
        Box::pin(self.apply(key, move |s| {
            lease::release(s, &k, &h, version).map(|s| (s, ()))
        }))
    }

    fn list(&self) -> BoxFuture<'_, StoreResult<Vec<LeaseState>>> {
        Box::pin(self.db.read(|conn| {
            let mut stmt = conn
                .prepare_cached(
                    "SELECT key, version, holder, acquired_at_ns, expires_at_ns FROM leases \
                     ORDER BY key",
                )
                .map_err(sql_error)?;
            let rows = stmt.query_map([], raw).map_err(sql_error)?;
            rows.map(|r| decode(r.map_err(sql_error)?)).collect()
        }))
    }
}
