//! The MySQL / MariaDB dialect (MySQL 8, MariaDB 10.6+: both have `SKIP LOCKED`), on one
//! `mysql_async` connection (rustls with ring; TLS with `?require_ssl=true`, ADR 0015).
//!
//! Statements go as text: the only values in them are row ids, counts and durations, all
//! integers written by Rust, and the validated table and column names, so there is nothing
//! to escape and no prepared statement per id-list length to cache. The heads are read in
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
}

fn db(e: mysql_async::Error) -> DbError {
    DbError(format!("mysql: {e}"))
}

/// `1,2,3`: ids written as integers.
fn id_list(ids: &[i64]) -> String {
    let mut list = String::with_capacity(ids.len() * 8);
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            list.push(',');
        }
        let _ = write!(list, "{id}");
    }
    list
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
        let (sent, retry_at) = (&self.c.sent_at, &self.c.retry_at);
        format!("{sent} IS NULL AND ({retry_at} IS NULL OR {retry_at} <= NOW(6))")
    }
}

impl Dialect for Mysql {
    async fn connect(s: &TableSettings) -> Result<Self, DbError> {
        let opts = Opts::from_url(&s.url).map_err(|e| DbError(format!("mysql url: {e}")))?;
        let opts = OptsBuilder::from_opts(opts)
            .user(Some(s.username.as_deref().unwrap_or(DEFAULT_USER)))
            .pass(s.password.as_ref().map(|p| p.expose().to_owned()));
        let conn = Conn::new(opts).await.map_err(db)?;
        Ok(Self {
            conn,
            claim_ttl_us: s.claim_ttl.as_micros(),
            table: s.table.clone(),
            c: s.columns.clone(),
        })
    }

    async fn claim(&mut self, limit: u32) -> Result<Vec<Row>, DbError> {
        let (t, c) = (&self.table, &self.c);
        let (id, agg, sent) = (&c.id, &c.aggregate_id, &c.sent_at);
        let claimable = self.claimable();
        // The first unsent row of each aggregate (each row without one is its own group), if
        // due: one pass over the unsent rows (see the PostgreSQL dialect).
        let heads = format!(
            "SELECT o.{id} FROM {t} o JOIN (\
             SELECT min({id}) AS head FROM {t} WHERE {sent} IS NULL \
             GROUP BY CASE WHEN {agg} IS NULL OR {agg} = '' THEN CONCAT('n:', {id}) \
             ELSE CONCAT('a:', {agg}) END) h ON o.{id} = h.head \
             WHERE o.{ra} IS NULL OR o.{ra} <= NOW(6) \
             ORDER BY o.{id} LIMIT {limit}",
            ra = c.retry_at
        );
        let found: Vec<mysql_async::Row> = self.conn.query(heads).await.map_err(db)?;
        let mut heads = Vec::with_capacity(found.len());
        for r in &found {
            heads.extend(value::<i64>(r, 0)?);
        }
        if heads.is_empty() {
            return Ok(Vec::new());
        }
        let lock = format!(
            "SELECT {id}, {}, {agg}, {}, {}, COALESCE({}, 0) FROM {t} \
             WHERE {id} IN ({}) AND {claimable} ORDER BY {id} FOR UPDATE SKIP LOCKED",
            c.aggregate_type,
            c.event,
            c.payload,
            c.retry_count,
            id_list(&heads)
        );
        let mut options = TxOpts::default();
        options.with_isolation_level(IsolationLevel::ReadCommitted);
        let mut txn = self.conn.start_transaction(options).await.map_err(db)?;
        let locked: Vec<mysql_async::Row> = txn.query(lock).await.map_err(db)?;
        let mut rows = Vec::with_capacity(locked.len());
        for r in &locked {
            let Some(row_id) = value::<i64>(r, 0)? else {
                continue;
            };
            let retry_count = value::<i64>(r, 5)?.unwrap_or_default();
            rows.push(Row {
                id: row_id,
                aggregate_type: value(r, 1)?,
                aggregate_id: value(r, 2)?,
                event: value(r, 3)?,
                payload: value::<Vec<u8>>(r, 4)?.unwrap_or_default(),
                retry_count: u32::try_from(retry_count.max(0)).unwrap_or(u32::MAX),
            });
        }
        if !rows.is_empty() {
            let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
            txn.query_drop(format!(
                "UPDATE {t} SET {ra} = NOW(6) + INTERVAL {us} MICROSECOND \
                 WHERE {id} IN ({}) AND {sent} IS NULL",
                id_list(&ids),
                ra = c.retry_at,
                us = self.claim_ttl_us,
            ))
            .await
            .map_err(db)?;
        }
        txn.commit().await.map_err(db)?;
        Ok(rows)
    }

    async fn settle_sent(&mut self, ids: &[i64], on_sent: OnSent) -> Result<(), DbError> {
        let (t, c) = (&self.table, &self.c);
        let statement = match on_sent {
            OnSent::Mark => format!(
                "UPDATE {t} SET {} = NOW(6), {} = NULL WHERE {} IN ({})",
                c.sent_at,
                c.retry_at,
                c.id,
                id_list(ids)
            ),
            OnSent::Delete => format!("DELETE FROM {t} WHERE {} IN ({})", c.id, id_list(ids)),
        };
        self.conn.query_drop(statement).await.map_err(db)
    }

    async fn retry_later(
        &mut self,
        id: i64,
        retry_count: u32,
        delay: Duration,
    ) -> Result<(), DbError> {
        let (t, c) = (&self.table, &self.c);
        let statement = format!(
            "UPDATE {t} SET {} = {retry_count}, {} = NOW(6) + INTERVAL {} MICROSECOND \
             WHERE {} = {id} AND {} IS NULL",
            c.retry_count,
            c.retry_at,
            delay.as_micros(),
            c.id,
            c.sent_at
        );
        self.conn.query_drop(statement).await.map_err(db)
    }

    async fn release(&mut self, ids: &[i64]) -> Result<(), DbError> {
        let (t, c) = (&self.table, &self.c);
        let statement = format!(
            "UPDATE {t} SET {} = NULL WHERE {} IN ({}) AND {} IS NULL",
            c.retry_at,
            c.id,
            id_list(ids),
            c.sent_at
        );
        self.conn.query_drop(statement).await.map_err(db)
    }

    async fn extend(&mut self, ids: &[i64]) -> Result<(), DbError> {
        let (t, c) = (&self.table, &self.c);
        let statement = format!(
            "UPDATE {t} SET {} = NOW(6) + INTERVAL {} MICROSECOND WHERE {} IN ({}) AND {} IS NULL",
            c.retry_at,
            self.claim_ttl_us,
            c.id,
            id_list(ids),
            c.sent_at
        );
        self.conn.query_drop(statement).await.map_err(db)
    }

    async fn purge(&mut self, retention: Duration) -> Result<u64, DbError> {
        let statement = format!(
            "DELETE FROM {} WHERE {} < NOW(6) - INTERVAL {} MICROSECOND LIMIT {PURGE_SLICE}",
            self.table,
            self.c.sent_at,
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
    fn id_lists_are_plain_integers() {
        assert_eq!(id_list(&[1, -2, 30]), "1,-2,30");
        assert_eq!(id_list(&[]), "");
    }
}
