//! Running the shared statements (`state::sql`) with rusqlite: argument
//! binding, row access for `state::rows`, and the query helpers.

use rusqlite::Connection;
use rusqlite::types::{ToSqlOutput, Value, ValueRef};

use super::db_err;
use crate::state::error::StateResult;
use crate::state::rows;
use crate::state::sql::SqlArg;

/// Runs a statement; returns the number of rows changed.
pub(crate) fn exec(conn: &Connection, sql: &str, args: &[SqlArg]) -> StateResult<usize> {
    let mut stmt = conn.prepare_cached(sql).map_err(db_err)?;
    stmt.execute(rusqlite::params_from_iter(args))
        .map_err(db_err)
}

/// Runs a query and reads every row with `read`.
pub(crate) fn query_all<T>(
    conn: &Connection,
    sql: &str,
    args: &[SqlArg],
    read: impl Fn(&rusqlite::Row<'_>) -> StateResult<T>,
) -> StateResult<Vec<T>> {
    let mut stmt = conn.prepare_cached(sql).map_err(db_err)?;
    let mut rows = stmt
        .query(rusqlite::params_from_iter(args))
        .map_err(db_err)?;
    let mut out = Vec::new();
    while let Some(row) = rows.next().map_err(db_err)? {
        out.push(read(row)?);
    }
    Ok(out)
}

/// Runs a query and reads its first row, if any, with `read`.
pub(crate) fn query_opt<T>(
    conn: &Connection,
    sql: &str,
    args: &[SqlArg],
    read: impl Fn(&rusqlite::Row<'_>) -> StateResult<T>,
) -> StateResult<Option<T>> {
    let mut stmt = conn.prepare_cached(sql).map_err(db_err)?;
    let mut rows = stmt
        .query(rusqlite::params_from_iter(args))
        .map_err(db_err)?;
    rows.next().map_err(db_err)?.map(read).transpose()
}

impl rusqlite::ToSql for SqlArg {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(match self {
            Self::Text(text) => ToSqlOutput::Borrowed(ValueRef::Text(text.as_bytes())),
            Self::OptText(Some(text)) => ToSqlOutput::Borrowed(ValueRef::Text(text.as_bytes())),
            Self::OptText(None) | Self::OptInt(None) => ToSqlOutput::Owned(Value::Null),
            Self::Int(value) | Self::OptInt(Some(value)) => {
                ToSqlOutput::Owned(Value::Integer(*value))
            }
            Self::Bytes(bytes) => ToSqlOutput::Borrowed(ValueRef::Blob(bytes)),
        })
    }
}

impl rows::Row for rusqlite::Row<'_> {
    fn text(&self, index: usize) -> StateResult<String> {
        self.get(index).map_err(db_err)
    }
    fn opt_text(&self, index: usize) -> StateResult<Option<String>> {
        self.get(index).map_err(db_err)
    }
    fn int(&self, index: usize) -> StateResult<i64> {
        self.get(index).map_err(db_err)
    }
    fn opt_int(&self, index: usize) -> StateResult<Option<i64>> {
        self.get(index).map_err(db_err)
    }
    fn boolean(&self, index: usize) -> StateResult<bool> {
        self.get(index).map_err(db_err)
    }
    fn bytes(&self, index: usize) -> StateResult<Vec<u8>> {
        self.get(index).map_err(db_err)
    }
}
