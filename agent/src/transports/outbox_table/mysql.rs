//! The MySQL / MariaDB dialect (MySQL 8, MariaDB 10.6+: both have `SKIP LOCKED`), on one
//! `mysql_async` connection (rustls with ring; TLS with `?require_ssl=true`, trusting
//! `ca_file` when set, ADR 0015).
//!
//! Statements go as text: the only values in them are row ids, counts and durations written
//! by Rust, the validated table and column names and status values, so there is no prepared
//! statement per id-list length to cache. Ids are read as text; at connect the catalog says
//! whether the id column is an integer (ids written as integers) or not (ids written as
//! `_utf8mb4 X'…'` hex literals: nothing to escape, and compared in the column's collation,
//! so its index is used). A missing column is an error at connect that names the table and
//! the column. The heads are read in
//! autocommit (a fresh snapshot each time); the claim transaction runs at `READ COMMITTED`,
//! so its locking read takes row locks only, no gap locks that would block the application's
//! inserts (as `REPEATABLE READ`, the default, may). Rows are read as
//! [`mysql_async::Row`] and converted value by value: a value of an unexpected type is an
//! error, never a panic.

use std::fmt::Write as _;
use std::time::Duration;

use ferry_shared::config::OnSent;
use mysql_async::prelude::{FromValue, Queryable};
use mysql_async::{Conn, IsolationLevel, Opts, OptsBuilder, TxOpts};

use super::TableSettings;
use super::relay::{DbError, Dialect, Row};

/// The user when the session names none.
const DEFAULT_USER: &str = "root";
/// Sent rows deleted per purge statement.
const PURGE_SLICE: u32 = 10_000;

pub(crate) struct Mysql {
    conn: Conn,
    claim_ttl_us: u128,
    table: String,
    c: super::Columns,
    /// The id column is an integer type.
    integer_ids: bool,
}

/// MySQL's integer column types (`information_schema.COLUMNS.DATA_TYPE`).
const INTEGER_TYPES: &[&str] = &["tinyint", "smallint", "mediumint", "int", "bigint"];

fn db(e: mysql_async::Error) -> DbError {
    DbError(format!("mysql: {e}"))
}

/// `1,2,3` for integer ids, `_utf8mb4 X'…',…` otherwise; an integer id that does not parse
/// (it was read from an integer column, so never) is an error, not SQL.
fn id_list<S: AsRef<str>>(ids: &[S], integer: bool) -> Result<String, DbError> {
    let mut list = String::with_capacity(ids.len() * 16);
    for (i, id) in ids.iter().enumerate() {
        let id = id.as_ref();
        if i > 0 {
            list.push(',');
        }
        if integer {
            let n: i64 = id
                .parse()
                .map_err(|_| DbError(format!("mysql: id {id:?} is not an integer")))?;
            let _ = write!(list, "{n}");
        } else {
            list.push_str("_utf8mb4 X'");
            for b in id.bytes() {
                let _ = write!(list, "{b:02x}");
            }
            list.push('\'');
        }
    }
    Ok(list)
}

/// Column `i` of `row`, converted; a null is `None`.
fn value<T: FromValue>(row: &mysql_async::Row, i: usize) -> Result<Option<T>, DbError> {
    match row.get_opt::<Option<T>, usize>(i) {
        Some(Ok(v)) => Ok(v),
        Some(Err(e)) => Err(DbError(format!("mysql: column {i}: {e}"))),
        None => Err(DbError(format!("mysql: no column {i}"))),
    }
}

impl Mysql {
    fn claimable(&self) -> String {
        let retry_at = &self.c.retry_at;
        format!(
            "{} AND ({retry_at} IS NULL OR {retry_at} <= NOW(6))",
            self.c.unsent()
        )
    }

    fn ids<S: AsRef<str>>(&self, ids: &[S]) -> Result<String, DbError> {
        id_list(ids, self.integer_ids)
    }
}

/// The table's `(column, data type)` list; empty if there is no such table.
async fn columns_of(conn: &mut Conn, table: &str) -> Result<Vec<(String, String)>, DbError> {
    // Validated identifiers: nothing to escape.
    let (schema, name) = match table.split_once('.') {
        Some((schema, name)) => (format!("'{schema}'"), name),
        None => ("DATABASE()".to_owned(), table),
    };
    let found: Vec<mysql_async::Row> = conn
        .query(format!(
            "SELECT COLUMN_NAME, DATA_TYPE FROM information_schema.COLUMNS \
             WHERE TABLE_SCHEMA = {schema} AND TABLE_NAME = '{name}'"
        ))
        .await
        .map_err(db)?;
    found
        .iter()
        .map(|r| {
            Ok((
                value::<String>(r, 0)?.unwrap_or_default(),
                value::<String>(r, 1)?.unwrap_or_default(),
            ))
        })
        .collect()
}

impl Dialect for Mysql {
    async fn connect(s: &TableSettings) -> Result<Self, DbError> {
        let opts = Opts::from_url(&s.url).map_err(|e| DbError(format!("mysql url: {e}")))?;
        // `?require_ssl=true` made the TLS options; a `ca_file` is then the only root trusted
        // (the validator refuses it without TLS).
        let ssl = match (opts.ssl_opts(), &s.ca_file) {
            (Some(ssl), Some(ca_file)) => Some(
                ssl.clone()
                    .with_root_certs(vec![ca_file.clone().into()])
                    .with_disable_built_in_roots(true),
            ),
            (ssl, _) => ssl.cloned(),
        };
        let opts = OptsBuilder::from_opts(opts)
            .user(Some(s.username.as_deref().unwrap_or(DEFAULT_USER)))
            .pass(s.password.as_ref().map(|p| p.expose().to_owned()))
            .ssl_opts(ssl);
        let mut conn = Conn::new(opts).await.map_err(db)?;
        let found = columns_of(&mut conn, &s.table).await?;
        let id_type = s.columns.check(&s.table, &found)?;
        Ok(Self {
            conn,
            claim_ttl_us: s.claim_ttl.as_micros(),
            table: s.table.clone(),
            c: s.columns.clone(),
            integer_ids: INTEGER_TYPES.contains(&id_type.to_ascii_lowercase().as_str()),
        })
    }

    async fn claim(&mut self, limit: u32) -> Result<Vec<Row>, DbError> {
        let (t, c) = (&self.table, &self.c);
        let (id, ra) = (&c.id, &c.retry_at);
        let claimable = self.claimable();
        let order = c.order(str::to_owned);
        let heads = match &c.aggregate_id {
            // The first unsent row of each aggregate in claim order (each row without an
            // aggregate id is its own group), if due: one pass over the unsent rows, with
            // `min(id)` in id order and a window in `(created_at, id)` order (see the
            // PostgreSQL dialect).
            Some(agg) => {
                let unsent = c.unsent();
                let group = format!(
                    "CASE WHEN {agg} IS NULL OR {agg} = '' THEN CONCAT('n:', {id}) \
                     ELSE CONCAT('a:', {agg}) END"
                );
                match &c.created_at {
                    None => format!(
                        "SELECT CAST(o.{id} AS CHAR) FROM {t} o JOIN (\
                         SELECT min({id}) AS head FROM {t} WHERE {unsent} GROUP BY {group}) h \
                         ON o.{id} = h.head WHERE o.{ra} IS NULL OR o.{ra} <= NOW(6) \
                         ORDER BY o.{id} LIMIT {limit}"
                    ),
                    Some(created_at) => format!(
                        "SELECT CAST(h.{id} AS CHAR) FROM (SELECT {id}, {ra}, {created_at}, \
                         ROW_NUMBER() OVER (PARTITION BY {group} ORDER BY {order}) AS ferry_n \
                         FROM {t} WHERE {unsent}) h \
                         WHERE h.ferry_n = 1 AND (h.{ra} IS NULL OR h.{ra} <= NOW(6)) \
                         ORDER BY {} LIMIT {limit}",
                        c.order(|k| format!("h.{k}")),
                    ),
                }
            }
            None => format!(
                "SELECT CAST({id} AS CHAR) FROM {t} WHERE {claimable} ORDER BY {order} LIMIT {limit}"
            ),
        };
        let found: Vec<mysql_async::Row> = self.conn.query(heads).await.map_err(db)?;
        let mut heads = Vec::with_capacity(found.len());
        for r in &found {
            heads.extend(value::<String>(r, 0)?);
        }
        if heads.is_empty() {
            return Ok(Vec::new());
        }
        let or_null = |column: &Option<String>| column.clone().unwrap_or_else(|| "NULL".into());
        let lock = format!(
            "SELECT CAST({id} AS CHAR), {}, {}, {}, {}, COALESCE({}, 0), {} FROM {t} \
             WHERE {id} IN ({}) AND {claimable} ORDER BY {order} FOR UPDATE SKIP LOCKED",
            or_null(&c.aggregate_type),
            or_null(&c.aggregate_id),
            or_null(&c.event),
            c.payload,
            c.retry_count,
            or_null(&c.headers),
            self.ids(&heads)?
        );
        let mut options = TxOpts::default();
        options.with_isolation_level(IsolationLevel::ReadCommitted);
        let mut txn = self.conn.start_transaction(options).await.map_err(db)?;
        let locked: Vec<mysql_async::Row> = txn.query(lock).await.map_err(db)?;
        let mut rows = Vec::with_capacity(locked.len());
        for r in &locked {
            let Some(row_id) = value::<String>(r, 0)? else {
                continue;
            };
            let retry_count = value::<i64>(r, 5)?.unwrap_or_default();
            rows.push(Row {
                id: row_id,
                aggregate_type: value(r, 1)?,
                aggregate_id: value(r, 2)?,
                event: value(r, 3)?,
                payload: value::<Vec<u8>>(r, 4)?.unwrap_or_default(),
                headers: value(r, 6)?,
                retry_count: u32::try_from(retry_count.max(0)).unwrap_or(u32::MAX),
            });
        }
        if !rows.is_empty() {
            let ids: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
            txn.query_drop(format!(
                "UPDATE {t} SET {ra} = NOW(6) + INTERVAL {us} MICROSECOND \
                 WHERE {id} IN ({}) AND {}",
                id_list(&ids, self.integer_ids)?,
                c.unsent(),
                us = self.claim_ttl_us,
            ))
            .await
            .map_err(db)?;
        }
        txn.commit().await.map_err(db)?;
        Ok(rows)
    }

    async fn settle_sent(&mut self, ids: &[String], on_sent: OnSent) -> Result<(), DbError> {
        let (t, c) = (&self.table, &self.c);
        let statement = match on_sent {
            OnSent::Mark => format!(
                "UPDATE {t} SET {}, {} = NULL WHERE {} IN ({})",
                c.mark_sent("NOW(6)"),
                c.retry_at,
                c.id,
                self.ids(ids)?
            ),
            OnSent::Delete => format!("DELETE FROM {t} WHERE {} IN ({})", c.id, self.ids(ids)?),
        };
        self.conn.query_drop(statement).await.map_err(db)
    }

    async fn retry_later(
        &mut self,
        id: &str,
        retry_count: u32,
        delay: Duration,
    ) -> Result<(), DbError> {
        let (t, c) = (&self.table, &self.c);
        let statement = format!(
            "UPDATE {t} SET {} = {retry_count}, {} = NOW(6) + INTERVAL {} MICROSECOND \
             WHERE {} = {} AND {}",
            c.retry_count,
            c.retry_at,
            delay.as_micros(),
            c.id,
            self.ids(&[id])?,
            c.unsent()
        );
        self.conn.query_drop(statement).await.map_err(db)
    }

    async fn release(&mut self, ids: &[String]) -> Result<(), DbError> {
        let (t, c) = (&self.table, &self.c);
        let statement = format!(
            "UPDATE {t} SET {} = NULL WHERE {} IN ({}) AND {}",
            c.retry_at,
            c.id,
            self.ids(ids)?,
            c.unsent()
        );
        self.conn.query_drop(statement).await.map_err(db)
    }

    async fn extend(&mut self, ids: &[String]) -> Result<(), DbError> {
        let (t, c) = (&self.table, &self.c);
        let statement = format!(
            "UPDATE {t} SET {} = NOW(6) + INTERVAL {} MICROSECOND WHERE {} IN ({}) AND {}",
            c.retry_at,
            self.claim_ttl_us,
            c.id,
            self.ids(ids)?,
            c.unsent()
        );
        self.conn.query_drop(statement).await.map_err(db)
    }

    async fn purge(&mut self, retention: Duration) -> Result<u64, DbError> {
        // The validator refuses `retention` without a sent_at column.
        let Some(sent_at) = self.c.sent_at() else {
            return Ok(0);
        };
        let statement = format!(
            "DELETE FROM {} WHERE {sent_at} < NOW(6) - INTERVAL {} MICROSECOND LIMIT {PURGE_SLICE}",
            self.table,
            retention.as_micros()
        );
        self.conn.query_drop(statement).await.map_err(db)?;
        Ok(self.conn.affected_rows())
    }

    async fn woken(&mut self) {
        // MySQL has no notifications: polling only.
        std::future::pending().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_lists_are_integers_or_hex_strings() {
        assert_eq!(
            id_list(&["1", "-2", "30"], true).expect("integers"),
            "1,-2,30"
        );
        assert!(id_list(&["1 OR 1=1"], true).is_err());
        assert_eq!(
            id_list(&["a'b", "é"], false).expect("text"),
            "_utf8mb4 X'612762',_utf8mb4 X'c3a9'"
        );
        assert_eq!(id_list::<&str>(&[], false).expect("empty"), "");
    }
}
