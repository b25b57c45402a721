//! Dead letters in SQLite (filters built by `state::dlq`).

use rusqlite::{Connection, Transaction};

use super::{exec, query_all, query_opt};
use crate::state::dlq::{PAGE_KIND, dlq_not_found, insert_args, sort_key, where_clause};
use crate::state::error::StateResult;
use crate::state::paging::{Page, PageRequest, paginate};
use crate::state::rows;
use crate::state::sql::{self, SqlArg};
use crate::state::types::{DlqEntry, DlqFilter, DlqStat};

fn placeholder(n: usize) -> String {
    format!("?{n}")
}

pub(super) fn put(tx: &Transaction<'_>, entry: &DlqEntry) -> StateResult<bool> {
    Ok(exec(tx, sql::DLQ_INSERT, &insert_args(entry)?)? == 1)
}

pub(super) fn list(
    conn: &Connection,
    filter: &DlqFilter,
    page: &PageRequest,
) -> StateResult<Page<DlqEntry>> {
    let cursor = page.cursor(PAGE_KIND)?;
    let mut clause = where_clause(filter, cursor.as_ref(), placeholder)?;
    clause.args.push(SqlArg::Int(page.fetch_limit()));
    let statement = format!(
        "{} {} ORDER BY dead_lettered_at, id LIMIT ?{}",
        sql::DLQ_SELECT,
        clause.sql,
        clause.args.len()
    );
    let rows = query_all(conn, &statement, &clause.args, |r| rows::dlq_entry(r))?;
    Ok(paginate(page, PAGE_KIND, rows, sort_key))
}

pub(super) fn get(conn: &Connection, id: &str) -> StateResult<DlqEntry> {
    let statement = format!("{} WHERE id = ?1", sql::DLQ_SELECT);
    query_opt(conn, &statement, &[id.into()], |r| rows::dlq_entry(r))?
        .ok_or_else(|| dlq_not_found(id))
}

pub(super) fn delete(tx: &Transaction<'_>, id: &str) -> StateResult<()> {
    match exec(tx, sql::DLQ_DELETE, &[id.into()])? {
        0 => Err(dlq_not_found(id)),
        _ => Ok(()),
    }
}

pub(super) fn purge(tx: &Transaction<'_>, filter: &DlqFilter) -> StateResult<u64> {
    let clause = where_clause(filter, None, placeholder)?;
    let statement = format!("DELETE FROM dlq_entries {}", clause.sql);
    Ok(exec(tx, &statement, &clause.args)? as u64)
}

pub(super) fn stats(conn: &Connection, filter: &DlqFilter) -> StateResult<Vec<DlqStat>> {
    let clause = where_clause(filter, None, placeholder)?;
    let statement = format!(
        "{} {} {}",
        sql::DLQ_STATS_SELECT,
        clause.sql,
        sql::DLQ_STATS_GROUP
    );
    query_all(conn, &statement, &clause.args, |r| rows::dlq_stat(r))
}
