//! The PostgreSQL dialect: one connection through `ferry_shared::postgres::connect` (TLS with
//! `sslmode=require`, as the postgres stores, trusting `ca_file` when set), optional `LISTEN`,
//! the statements of [`Dialect`] with `$n` parameters, `now()` and `make_interval`.
//!
//! At connect the table's columns are read from the catalog: a missing one is an error that
//! names the table and the column, and the id column's type is kept. Ids are read as text and
//! bound back as a `text[]` cast to that type, so integer, `uuid` and text ids all work and the
//! comparisons still use the id's index. The aggregate id is compared as text, so any column
//! type can be the ordering key.

use std::str::FromStr;
use std::time::Duration;

use ferry_shared::config::OnSent;
use ferry_shared::postgres::{Notifications, describe};
use tokio_postgres::Client;

use super::TableSettings;
use super::relay::{DbError, Dialect, Row};

/// The user when the session names none (tokio-postgres needs one).
const DEFAULT_USER: &str = "postgres";
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Sent rows deleted per purge statement.
const PURGE_SLICE: i64 = 10_000;

pub(crate) struct Postgres {
    client: Client,
    notifications: Option<Notifications>,
    claim_ttl: f64,
    sql: Statements,
}

/// The statements, written once per connection from the validated table and column names
/// and the id column's type (from the catalog).
struct Statements {
    heads: String,
    lock: String,
    lease: String,
    mark: String,
    delete: String,
    retry: String,
    release: String,
    /// `None` without a `sent_at` column (the validator refuses `retention` then).
    purge: Option<String>,
}

/// The table's `(column, type)` list; empty if there is no such table.
const COLUMNS: &str = "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod) \
     FROM pg_attribute a WHERE a.attrelid = to_regclass($1)::oid AND a.attnum > 0 \
     AND NOT a.attisdropped";

impl Statements {
    fn new(s: &TableSettings, id_type: &str) -> Self {
        let t = &s.table;
        let c = &s.columns;
        let (id, retry_at) = (&c.id, &c.retry_at);
        let unsent = c.unsent();
        let due = format!("({retry_at} IS NULL OR {retry_at} <= now())");
        let claimable = format!("{unsent} AND {due}");
        // The ids of a statement: text bound back to the id's own type.
        let these = format!("{id} = ANY($1::text[]::{id_type}[])");
        let order = c.order(str::to_owned);
        let heads = match &c.aggregate_id {
            // Non-locking: the first unsent row of each aggregate in claim order (each row
            // without an aggregate id is its own group), if due. One pass over the unsent
            // rows whatever the indexes; a correlated "no earlier unsent row" test becomes
            // quadratic without an index on the aggregate id.
            Some(agg) => {
                let group = format!(
                    "CASE WHEN {agg} IS NULL OR {agg}::text = '' THEN 'n:' || {id}::text \
                     ELSE 'a:' || {agg}::text END"
                );
                // In id order, `min(id)` per group (a hash aggregate, twice as fast as the
                // window's sort over 100 000 unsent rows); PostgreSQL has no `min(uuid)`, and
                // `(created_at, id)` is no single value: a window then.
                if c.created_at.is_none() && id_type != "uuid" {
                    format!(
                        "SELECT o.{id}::text FROM {t} o JOIN (\
                         SELECT min({id}) AS head FROM {t} WHERE {unsent} GROUP BY {group}) h \
                         ON o.{id} = h.head WHERE o.{retry_at} IS NULL OR o.{retry_at} <= now() \
                         ORDER BY o.{id} LIMIT $1"
                    )
                } else {
                    let created = c
                        .created_at
                        .as_ref()
                        .map(|k| format!(", {k}"))
                        .unwrap_or_default();
                    format!(
                        "SELECT h.{id}::text FROM (SELECT {id}, {retry_at}{created}, \
                         row_number() OVER (PARTITION BY {group} ORDER BY {order}) AS ferry_n \
                         FROM {t} WHERE {unsent}) h \
                         WHERE h.ferry_n = 1 AND (h.{retry_at} IS NULL OR h.{retry_at} <= now()) \
                         ORDER BY {} LIMIT $1",
                        c.order(|k| format!("h.{k}"))
                    )
                }
            }
            None => {
                format!("SELECT {id}::text FROM {t} WHERE {claimable} ORDER BY {order} LIMIT $1")
            }
        };
        let text = |column: &Option<String>| {
            column
                .as_ref()
                .map_or_else(|| "NULL::text".to_owned(), |k| format!("{k}::text"))
        };
        Self {
            heads,
            lock: format!(
                "SELECT {id}::text, {}, {}, {}, {}::text, COALESCE({}, 0)::bigint, {} FROM {t} \
                 WHERE {these} AND {claimable} ORDER BY {order} FOR UPDATE SKIP LOCKED",
                text(&c.aggregate_type),
                text(&c.aggregate_id),
                text(&c.event),
                c.payload,
                c.retry_count,
                text(&c.headers)
            ),
            lease: format!(
                "UPDATE {t} SET {retry_at} = now() + make_interval(secs => $2) \
                 WHERE {these} AND {unsent}"
            ),
            mark: format!(
                "UPDATE {t} SET {}, {retry_at} = NULL WHERE {these}",
                c.mark_sent("now()")
            ),
            delete: format!("DELETE FROM {t} WHERE {these}"),
            retry: format!(
                "UPDATE {t} SET {} = $2::integer, {retry_at} = now() + make_interval(secs => $3) \
                 WHERE {id} = $1::text::{id_type} AND {unsent}",
                c.retry_count
            ),
            release: format!("UPDATE {t} SET {retry_at} = NULL WHERE {these} AND {unsent}"),
            purge: c.sent_at().map(|sent| {
                format!(
                    "DELETE FROM {t} WHERE {id} IN (SELECT {id} FROM {t} \
                     WHERE {sent} < now() - make_interval(secs => $1) LIMIT {PURGE_SLICE})"
                )
            }),
        }
    }
}

fn db(e: tokio_postgres::Error) -> DbError {
    DbError(describe(&e))
}

impl Postgres {
    async fn ids(&self, statement: &str, ids: &[String]) -> Result<(), DbError> {
        self.client.execute(statement, &[&ids]).await.map_err(db)?;
        Ok(())
    }
}

impl Dialect for Postgres {
    async fn connect(s: &TableSettings) -> Result<Self, DbError> {
        let mut config = tokio_postgres::Config::from_str(&s.url)
            .map_err(|e| DbError(format!("postgres url: {e}")))?;
        config
            .user(s.username.as_deref().unwrap_or(DEFAULT_USER))
            .application_name("ferry-agent")
            .connect_timeout(CONNECT_TIMEOUT);
        if let Some(password) = &s.password {
            config.password(password.expose());
        }
        let (client, notifications) =
            ferry_shared::postgres::connect(&config, s.ca_file.as_deref())
                .await
                .map_err(|e| DbError(e.to_string()))?;
        let notifications = match &s.notify_channel {
            Some(channel) => {
                // A validated identifier.
                client
                    .batch_execute(&format!("LISTEN {channel}"))
                    .await
                    .map_err(db)?;
                Some(notifications)
            }
            None => None,
        };
        let found: Vec<(String, String)> = client
            .query(COLUMNS, &[&s.table])
            .await
            .map_err(db)?
            .iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .collect::<Result<_, tokio_postgres::Error>>()
            .map_err(db)?;
        let id_type = s.columns.check(&s.table, &found)?;
        Ok(Self {
            client,
            notifications,
            claim_ttl: s.claim_ttl.as_secs_f64(),
            sql: Statements::new(s, &id_type),
        })
    }

    async fn claim(&mut self, limit: u32) -> Result<Vec<Row>, DbError> {
        let heads: Vec<String> = self
            .client
            .query(&self.sql.heads, &[&i64::from(limit)])
            .await
            .map_err(db)?
            .iter()
            .map(|r| r.try_get(0))
            .collect::<Result<_, _>>()
            .map_err(db)?;
        if heads.is_empty() {
            return Ok(Vec::new());
        }
        let txn = self.client.transaction().await.map_err(db)?;
        let locked = txn.query(&self.sql.lock, &[&heads]).await.map_err(db)?;
        let mut rows = Vec::with_capacity(locked.len());
        for r in &locked {
            let retry_count: i64 = r.try_get(5).map_err(db)?;
            let payload: Option<String> = r.try_get(4).map_err(db)?;
            rows.push(Row {
                id: r.try_get(0).map_err(db)?,
                aggregate_type: r.try_get(1).map_err(db)?,
                aggregate_id: r.try_get(2).map_err(db)?,
                event: r.try_get(3).map_err(db)?,
                payload: payload.unwrap_or_default().into_bytes(),
                headers: r.try_get(6).map_err(db)?,
                retry_count: u32::try_from(retry_count.max(0)).unwrap_or(u32::MAX),
            });
        }
        if !rows.is_empty() {
            let ids: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
            txn.execute(&self.sql.lease, &[&ids, &self.claim_ttl])
                .await
                .map_err(db)?;
        }
        txn.commit().await.map_err(db)?;
        Ok(rows)
    }

    async fn settle_sent(&mut self, ids: &[String], on_sent: OnSent) -> Result<(), DbError> {
        match on_sent {
            OnSent::Mark => self.ids(&self.sql.mark, ids).await,
            OnSent::Delete => self.ids(&self.sql.delete, ids).await,
        }
    }

    async fn retry_later(
        &mut self,
        id: &str,
        retry_count: u32,
        delay: Duration,
    ) -> Result<(), DbError> {
        let count = i32::try_from(retry_count).unwrap_or(i32::MAX);
        self.client
            .execute(&self.sql.retry, &[&id, &count, &delay.as_secs_f64()])
            .await
            .map_err(db)?;
        Ok(())
    }

    async fn release(&mut self, ids: &[String]) -> Result<(), DbError> {
        self.ids(&self.sql.release, ids).await
    }

    async fn extend(&mut self, ids: &[String]) -> Result<(), DbError> {
        self.client
            .execute(&self.sql.lease, &[&ids, &self.claim_ttl])
            .await
            .map_err(db)?;
        Ok(())
    }

    async fn purge(&mut self, retention: Duration) -> Result<u64, DbError> {
        let Some(purge) = &self.sql.purge else {
            return Ok(0);
        };
        self.client
            .execute(purge, &[&retention.as_secs_f64()])
            .await
            .map_err(db)
    }

    async fn woken(&mut self) {
        match &mut self.notifications {
            Some(n) => {
                if n.recv().await.is_none() {
                    // The connection ended; the next statement reports it.
                    std::future::pending::<()>().await;
                }
                // One claim serves every notification already queued.
                while n.try_recv().is_ok() {}
            }
            None => std::future::pending().await,
        }
    }
}
