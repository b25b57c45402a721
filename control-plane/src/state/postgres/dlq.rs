//! Dead letters in PostgreSQL (filters built by `state::dlq`).

use tokio_postgres::{GenericClient, Transaction};

use super::{TxResult, exec, query_all, query_opt};
use crate::state::dlq::{PAGE_KIND, dlq_not_found, insert_args, sort_key, where_clause};
use crate::state::paging::{Page, PageRequest, paginate};
use crate::state::rows;
use crate::state::sql::{self, SqlArg};
use crate::state::types::{DlqEntry, DlqFilter, DlqStat};

/// `?N`, rewritten to `$N` by the query helpers.
fn placeholder(n: usize) -> String {
    format!("?{n}")
}

pub(super) async fn put(tx: &Transaction<'_>, entry: &DlqEntry) -> TxResult<bool> {
    Ok(exec(tx, sql::DLQ_INSERT, &insert_args(entry)?).await? == 1)
}

pub(super) async fn list(
    client: &(impl GenericClient + Sync),
    filter: &DlqFilter,
    page: &PageRequest,
) -> TxResult<Page<DlqEntry>> {
    let cursor = page.cursor(PAGE_KIND)?;
    let mut clause = where_clause(filter, cursor.as_ref(), placeholder)?;
    clause.args.push(SqlArg::Int(page.fetch_limit()));
    let statement = format!(
        "{} {} ORDER BY dead_lettered_at, id LIMIT ?{}",
        sql::DLQ_SELECT,
        clause.sql,
        clause.args.len()
    );
    let rows = query_all(client, &statement, &clause.args, rows::dlq_entry).await?;
    Ok(paginate(page, PAGE_KIND, rows, sort_key))
}

pub(super) async fn get(client: &(impl GenericClient + Sync), id: &str) -> TxResult<DlqEntry> {
    let statement = format!("{} WHERE id = ?1", sql::DLQ_SELECT);
    let found = query_opt(client, &statement, &[id.into()], rows::dlq_entry).await?;
    Ok(found.ok_or_else(|| dlq_not_found(id))?)
}

pub(super) async fn delete(tx: &Transaction<'_>, id: &str) -> TxResult<()> {
    match exec(tx, sql::DLQ_DELETE, &[id.into()]).await? {
        0 => Err(dlq_not_found(id).into()),
        _ => Ok(()),
    }
}

pub(super) async fn purge(tx: &Transaction<'_>, filter: &DlqFilter) -> TxResult<u64> {
    let clause = where_clause(filter, None, placeholder)?;
    let statement = format!("DELETE FROM dlq_entries {}", clause.sql);
    exec(tx, &statement, &clause.args).await
}

pub(super) async fn stats(
    client: &(impl GenericClient + Sync),
    filter: &DlqFilter,
) -> TxResult<Vec<DlqStat>> {
    let clause = where_clause(filter, None, placeholder)?;
    let statement = format!(
        "{} {} {}",
        sql::DLQ_STATS_SELECT,
        clause.sql,
        sql::DLQ_STATS_GROUP
    );
    query_all(client, &statement, &clause.args, rows::dlq_stat).await
}
