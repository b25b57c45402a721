//! The PostgreSQL DLQ: the filterable columns beside the encoded entry.
//! A put is `INSERT … ON CONFLICT (id) DO NOTHING`: idempotent by id, also
//! when two agents write the same entry at once. Text columns compare in
//! byte order (`COLLATE "C"`), as every backend orders and pages.

use tokio_postgres::types::ToSql;

use super::{Db, PostgresOptions, pg_error, schema, to_u64};
use crate::stores::dlq::token_after;
use crate::stores::{
    BoxFuture, DlqEntry, DlqFilter, DlqPage, DlqReason, DlqStat, DlqStats, DlqStore, PageRequest,
    StoreError, StoreResult, from_unix_nanos, unix_nanos,
};

/// The filter, `$1`..`$6`, each `NULL` when unset.
const FILTER: &str = "($1::text IS NULL OR bridge_id = $1) \
    AND ($2::text IS NULL OR route_id = $2) \
    AND ($3::text IS NULL OR binding_id = $3) \
    AND ($4::int4 IS NULL OR reason = $4) \
    AND ($5::int8 IS NULL OR dead_lettered_at_ns >= $5) \
    AND ($6::int8 IS NULL OR dead_lettered_at_ns < $6)";

/// Dead letters in a PostgreSQL database.
pub struct PostgresDlqStore {
    db: Db,
    options: PostgresOptions,
}

impl PostgresDlqStore {
    /// Connects and creates or migrates the table.
    pub async fn open(options: PostgresOptions) -> StoreResult<Self> {
        let db = Db::open(&options, "dlq", schema::DLQ).await?;
        Ok(PostgresDlqStore { db, options })
    }

    /// The options it was opened with.
    pub fn options(&self) -> &PostgresOptions {
        &self.options
    }
}

/// A statement parameter.
type Param<'a> = &'a (dyn ToSql + Sync);

/// The filter's values, in [`FILTER`]'s order.
struct FilterArgs {
    bridge_id: Option<String>,
    route_id: Option<String>,
    binding_id: Option<String>,
    reason: Option<i32>,
    since: Option<i64>,
    until: Option<i64>,
}

impl FilterArgs {
    fn new(filter: &DlqFilter) -> StoreResult<Self> {
        Ok(FilterArgs {
            bridge_id: filter.bridge_id.clone(),
            route_id: filter.route_id.clone(),
            binding_id: filter.binding_id.clone(),
            reason: filter.reason.map(DlqReason::code),
            since: filter.since.map(unix_nanos).transpose()?,
            until: filter.until.map(unix_nanos).transpose()?,
        })
    }

    fn params(&self) -> Vec<Param<'_>> {
        vec![
            &self.bridge_id as Param<'_>,
            &self.route_id,
            &self.binding_id,
            &self.reason,
            &self.since,
            &self.until,
        ]
    }
}

impl DlqStore for PostgresDlqStore {
    fn put(&self, entry: DlqEntry) -> BoxFuture<'_, StoreResult<bool>> {
        Box::pin(async move {
            entry.validate()?;
            let at = unix_nanos(entry.dead_lettered_at)?;
            let client = self.db.client().await?;
            let n = client
                .execute(
                    "INSERT INTO ferry_dlq_entries (id, bridge_id, route_id, binding_id, reason, \
                     dead_lettered_at_ns, entry) VALUES ($1, $2, $3, $4, $5, $6, $7) \
                     ON CONFLICT (id) DO NOTHING",
                    &[
                        &entry.id,
                        &entry.bridge_id,
                        &entry.route_id,
                        &entry.binding_id,
                        &entry.reason.code(),
                        &at,
                        &entry.encode(),
                    ],
                )
                .await
                .map_err(pg_error)?;
            Ok(n == 1)
        })
    }

    fn list<'a>(
        &'a self,
        filter: &'a DlqFilter,
        page: PageRequest,
    ) -> BoxFuture<'a, StoreResult<DlqPage>> {
        Box::pin(async move {
            let size = page.effective_size();
            let args = FilterArgs::new(filter)?;
            let (after_at, after_id) = page.after()?.unzip();
            let limit = i64::try_from(size + 1).unwrap_or(i64::MAX);
            let mut params = args.params();
            params.push(&after_at);
            params.push(&after_id);
            params.push(&limit);
            let client = self.db.client().await?;
            let stmt = client
                .prepare_cached(&format!(
                    "SELECT entry FROM ferry_dlq_entries WHERE {FILTER} \
                     AND ($7::int8 IS NULL OR (dead_lettered_at_ns, id) > ($7, $8::text)) \
                     ORDER BY dead_lettered_at_ns, id LIMIT $9"
                ))
                .await
                .map_err(pg_error)?;
            let rows = client.query(&stmt, &params).await.map_err(pg_error)?;
            let more = rows.len() > size;
            let mut entries = Vec::with_capacity(size.min(rows.len()));
            for row in rows.iter().take(size) {
                let bytes: Vec<u8> = row.try_get(0).map_err(pg_error)?;
                entries.push(DlqEntry::decode(&bytes)?);
            }
            let next_page_token = match (more, entries.last()) {
                (true, Some(last)) => Some(token_after(last)?),
                _ => None,
            };
            Ok(DlqPage {
                entries,
                next_page_token,
            })
        })
    }

    fn get<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<DlqEntry>> {
        Box::pin(async move {
            let client = self.db.client().await?;
            let row = client
                .query_opt("SELECT entry FROM ferry_dlq_entries WHERE id = $1", &[&id])
                .await
                .map_err(pg_error)?;
            match row {
                Some(row) => DlqEntry::decode(&row.try_get::<_, Vec<u8>>(0).map_err(pg_error)?),
                None => Err(StoreError::NotFound(format!("dlq entry {id}"))),
            }
        })
    }

    fn delete<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(async move {
            let client = self.db.client().await?;
            let n = client
                .execute("DELETE FROM ferry_dlq_entries WHERE id = $1", &[&id])
                .await
                .map_err(pg_error)?;
            if n == 0 {
                return Err(StoreError::NotFound(format!("dlq entry {id}")));
            }
            Ok(())
        })
    }

    fn purge<'a>(&'a self, filter: &'a DlqFilter) -> BoxFuture<'a, StoreResult<u64>> {
        Box::pin(async move {
            let args = FilterArgs::new(filter)?;
            let client = self.db.client().await?;
            client
                .execute(
                    &format!("DELETE FROM ferry_dlq_entries WHERE {FILTER}"),
                    &args.params(),
                )
                .await
                .map_err(pg_error)
        })
    }

    fn stats<'a>(&'a self, filter: &'a DlqFilter) -> BoxFuture<'a, StoreResult<DlqStats>> {
        Box::pin(async move {
            let args = FilterArgs::new(filter)?;
            let client = self.db.client().await?;
            let rows = client
                .query(
                    &format!(
                        "SELECT bridge_id, route_id, binding_id, reason, COUNT(*), \
                         MIN(dead_lettered_at_ns) FROM ferry_dlq_entries WHERE {FILTER} \
                         GROUP BY bridge_id, route_id, binding_id, reason \
                         ORDER BY bridge_id, route_id, binding_id, reason"
                    ),
                    &args.params(),
                )
                .await
                .map_err(pg_error)?;
            let mut out = DlqStats::default();
            for row in rows {
                let reason: i32 = row.try_get(3).map_err(pg_error)?;
                let count = to_u64(row.try_get(4).map_err(pg_error)?)?;
                out.total += count;
                out.rows.push(DlqStat {
                    bridge_id: row.try_get(0).map_err(pg_error)?,
                    route_id: row.try_get(1).map_err(pg_error)?,
                    binding_id: row.try_get(2).map_err(pg_error)?,
                    reason: DlqReason::from_code(reason).ok_or_else(|| {
                        StoreError::Corrupt(format!("unknown dlq reason {reason}"))
                    })?,
                    count,
                    oldest: from_unix_nanos(row.try_get(5).map_err(pg_error)?)?,
                });
            }
            Ok(out)
        })
    }
}
