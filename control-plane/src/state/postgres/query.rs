//! Running the shared statements (`state::sql`) with tokio-postgres:
//! placeholder spelling, argument binding, row access for `state::rows`, and
//! the query helpers (over a client or a transaction).

use tokio_postgres::GenericClient;
use tokio_postgres::types::ToSql;

use super::TxResult;
use crate::state::error::{StateError, StateResult};
use crate::state::rows;
use crate::state::sql::SqlArg;

/// A statement written with `?N` placeholders (see `state::sql`) in
/// PostgreSQL's `$N` spelling.
pub(crate) fn pg(sql: &str) -> String {
    sql.replace('?', "$")
}

fn params(args: &[SqlArg]) -> Vec<&(dyn ToSql + Sync)> {
    args.iter()
        .map(|arg| -> &(dyn ToSql + Sync) {
            match arg {
                SqlArg::Text(text) => text,
                SqlArg::OptText(text) => text,
                SqlArg::Int(value) => value,
                SqlArg::OptInt(value) => value,
                SqlArg::Bytes(bytes) => bytes,
            }
        })
        .collect()
}

/// Runs a statement (`?N` placeholders); returns the number of rows changed.
pub(crate) async fn exec(
    client: &(impl GenericClient + Sync),
    sql: &str,
    args: &[SqlArg],
) -> TxResult<u64> {
    Ok(client.execute(&pg(sql), &params(args)).await?)
}

/// Runs a query (`?N` placeholders) and reads every row with `read`.
pub(crate) async fn query_all<T>(
    client: &(impl GenericClient + Sync),
    sql: &str,
    args: &[SqlArg],
    read: impl Fn(&tokio_postgres::Row) -> StateResult<T>,
) -> TxResult<Vec<T>> {
    let rows = client.query(&pg(sql), &params(args)).await?;
    Ok(rows.iter().map(read).collect::<StateResult<Vec<T>>>()?)
}

/// Runs a query (`?N` placeholders) and reads its first row, if any.
pub(crate) async fn query_opt<T>(
    client: &(impl GenericClient + Sync),
    sql: &str,
    args: &[SqlArg],
    read: impl Fn(&tokio_postgres::Row) -> StateResult<T>,
) -> TxResult<Option<T>> {
    let rows = client.query(&pg(sql), &params(args)).await?;
    Ok(rows.first().map(read).transpose()?)
}

fn column<'a, T: tokio_postgres::types::FromSql<'a>>(
    row: &'a tokio_postgres::Row,
    index: usize,
) -> StateResult<T> {
    row.try_get(index)
        .map_err(|e| StateError::corrupt(format!("column {index}: {e}")))
}

impl rows::Row for tokio_postgres::Row {
    fn text(&self, index: usize) -> StateResult<String> {
        column(self, index)
    }
    fn opt_text(&self, index: usize) -> StateResult<Option<String>> {
        column(self, index)
    }
    fn int(&self, index: usize) -> StateResult<i64> {
        column(self, index)
    }
    fn opt_int(&self, index: usize) -> StateResult<Option<i64>> {
        column(self, index)
    }
    fn boolean(&self, index: usize) -> StateResult<bool> {
        column(self, index)
    }
    fn bytes(&self, index: usize) -> StateResult<Vec<u8>> {
        column(self, index)
    }
}
