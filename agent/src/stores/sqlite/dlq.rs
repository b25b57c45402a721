//! The SQLite DLQ: filterable columns beside the encoded entry.

use rusqlite::types::Value;
use rusqlite::{Connection, params, params_from_iter};

use super::{Db, SqliteOptions, schema, sql_error, to_u64};
use crate::stores::dlq::token_after;
use crate::stores::{
    BoxFuture, DlqEntry, DlqFilter, DlqPage, DlqReason, DlqStat, DlqStats, DlqStore, PageRequest,
    StoreError, StoreResult, from_unix_nanos, unix_nanos,
};

/// Dead letters in a SQLite database.
pub struct SqliteDlqStore {
    db: Db,
    options: SqliteOptions,
}

impl SqliteDlqStore {
    /// Opens the DLQ at `options.path`, creating it if needed.
    pub async fn open(options: SqliteOptions) -> StoreResult<Self> {
        let db = Db::open(options.clone(), "dlq", schema::dlq).await?;
        Ok(SqliteDlqStore { db, options })
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

/// A WHERE clause and its parameters for `filter`, plus an optional paging
/// position.
fn where_clause(
    filter: &DlqFilter,
    after: Option<(i64, String)>,
) -> StoreResult<(String, Vec<Value>)> {
    let mut terms = vec!["1=1".to_owned()];
    let mut args: Vec<Value> = Vec::new();
    let mut term = |sql: &str, v: Value| {
        args.push(v);
        terms.push(format!("{sql} ?{}", args.len()));
    };
    for (col, want) in [
        ("bridge_id =", &filter.bridge_id),
        ("route_id =", &filter.route_id),
        ("binding_id =", &filter.binding_id),
    ] {
        if let Some(v) = want {
            term(col, Value::Text(v.clone()));
        }
    }
    if let Some(r) = filter.reason {
        term("reason =", Value::Integer(r.code().into()));
    }
    if let Some(t) = filter.since {
        term("dead_lettered_at_ns >=", Value::Integer(unix_nanos(t)?));
    }
    if let Some(t) = filter.until {
        term("dead_lettered_at_ns <", Value::Integer(unix_nanos(t)?));
    }
    if let Some((t, id)) = after {
        args.push(Value::Integer(t));
        args.push(Value::Text(id));
        let n = args.len();
        terms.push(format!("(dead_lettered_at_ns, id) > (?{}, ?{n})", n - 1));
    }
    Ok((terms.join(" AND "), args))
}

fn put(conn: &Connection, entry: &DlqEntry) -> StoreResult<bool> {
    let n = conn
        .prepare_cached(
            "INSERT INTO dlq_entries (id, bridge_id, route_id, binding_id, reason, \
             dead_lettered_at_ns, entry) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) \
             ON CONFLICT (id) DO NOTHING",
        )
        .map_err(sql_error)?
        .execute(params![
            entry.id,
            entry.bridge_id,
            entry.route_id,
            entry.binding_id,
            entry.reason.code(),
            unix_nanos(entry.dead_lettered_at)?,
            entry.encode(),
        ])
        .map_err(sql_error)?;
    Ok(n == 1)
}

fn list(conn: &Connection, filter: &DlqFilter, page: &PageRequest) -> StoreResult<DlqPage> {
    let size = page.effective_size();
    let (clause, mut args) = where_clause(filter, page.after()?)?;
    args.push(Value::Integer(i64::try_from(size + 1).unwrap_or(i64::MAX)));
    let sql = format!(
        "SELECT entry FROM dlq_entries WHERE {clause} \
         ORDER BY dead_lettered_at_ns, id LIMIT ?{}",
        args.len()
    );
    let mut stmt = conn.prepare_cached(&sql).map_err(sql_error)?;
    let blobs = stmt
        .query_map(params_from_iter(args), |r| r.get::<_, Vec<u8>>(0))
        .map_err(sql_error)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(sql_error)?;
    let more = blobs.len() > size;
    let entries = blobs
        .iter()
        .take(size)
        .map(|b| DlqEntry::decode(b))
        .collect::<StoreResult<Vec<_>>>()?;
    let next_page_token = match (more, entries.last()) {
        (true, Some(last)) => Some(token_after(last)?),
        _ => None,
    };
    Ok(DlqPage {
        entries,
        next_page_token,
    })
}

fn get(conn: &Connection, id: &str) -> StoreResult<DlqEntry> {
    use rusqlite::OptionalExtension;
    let blob: Option<Vec<u8>> = conn
        .prepare_cached("SELECT entry FROM dlq_entries WHERE id=?1")
        .map_err(sql_error)?
        .query_row([id], |r| r.get(0))
        .optional()
        .map_err(sql_error)?;
    match blob {
        Some(b) => DlqEntry::decode(&b),
        None => Err(StoreError::NotFound(format!("dlq entry {id}"))),
    }
}

fn stats(conn: &Connection, filter: &DlqFilter) -> StoreResult<DlqStats> {
    let (clause, args) = where_clause(filter, None)?;
    let sql = format!(
        "SELECT bridge_id, route_id, binding_id, reason, COUNT(*), MIN(dead_lettered_at_ns) \
         FROM dlq_entries WHERE {clause} \
         GROUP BY bridge_id, route_id, binding_id, reason \
         ORDER BY bridge_id, route_id, binding_id, reason"
    );
    let mut stmt = conn.prepare_cached(&sql).map_err(sql_error)?;
    let rows = stmt
        .query_map(params_from_iter(args), |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, i32>(3)?,
                r.get::<_, i64>(4)?,
                r.get::<_, i64>(5)?,
            ))
        })
        .map_err(sql_error)?;
    let mut out = DlqStats::default();
    for row in rows {
        let (bridge_id, route_id, binding_id, reason, count, oldest) = row.map_err(sql_error)?;
        let count = to_u64(count)?;
        out.total += count;
        out.rows.push(DlqStat {
            bridge_id,
            route_id,
            binding_id,
            reason: DlqReason::from_code(reason)
                .ok_or_else(|| StoreError::Corrupt(format!("unknown dlq reason {reason}")))?,
            count,
            oldest: from_unix_nanos(oldest)?,
        });
    }
    Ok(out)
}

impl DlqStore for SqliteDlqStore {
    fn put(&self, entry: DlqEntry) -> BoxFuture<'_, StoreResult<bool>> {
        Box::pin(async move {
            entry.validate()?;
            self.db.write(move |c| put(c, &entry)).await
        })
    }

    fn list<'a>(
        &'a self,
        filter: &'a DlqFilter,
        page: PageRequest,
    ) -> BoxFuture<'a, StoreResult<DlqPage>> {
        let filter = filter.clone();
        Box::pin(self.db.read(move |c| list(c, &filter, &page)))
    }

    fn get<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<DlqEntry>> {
        let id = id.to_owned();
        Box::pin(self.db.read(move |c| get(c, &id)))
    }

    fn delete<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<()>> {
        let id = id.to_owned();
        Box::pin(self.db.write(move |c| {
            let n = c
                .execute("DELETE FROM dlq_entries WHERE id=?1", [&id])
                .map_err(sql_error)?;
            if n == 0 {
                return Err(StoreError::NotFound(format!("dlq entry {id}")));
            }
            Ok(())
        }))
    }

    fn purge<'a>(&'a self, filter: &'a DlqFilter) -> BoxFuture<'a, StoreResult<u64>> {
        let filter = filter.clone();
        Box::pin(self.db.write(move |c| {
            let (clause, args) = where_clause(&filter, None)?;
            let n = c
                .execute(
                    &format!("DELETE FROM dlq_entries WHERE {clause}"),
                    params_from_iter(args),
                )
                .map_err(sql_error)?;
            Ok(n as u64)
        }))
    }

    fn stats<'a>(&'a self, filter: &'a DlqFilter) -> BoxFuture<'a, StoreResult<DlqStats>> {
        let filter = filter.clone();
        Box::pin(self.db.read(move |c| stats(c, &filter)))
    }
}
