//! Dead-letter filters as SQL conditions, shared by every backend. Each
//! backend renders the placeholders its driver wants (`?1` or `$1`).

use super::codec::{opt_time_to_db, require_id, time_to_db, u64_to_db};
use super::error::StateResult;
use super::paging::Cursor;
use super::sql::SqlArg;
use super::types::{DlqEntry, DlqFilter};

/// A `WHERE` clause (empty when nothing filters) and its arguments, with
/// placeholders numbered from 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WhereClause {
    pub(crate) sql: String,
    pub(crate) args: Vec<SqlArg>,
}

/// The conditions of `filter`, plus "after `cursor`" in listing order
/// (`dead_lettered_at`, then `id`). `placeholder(n)` spells argument `n`.
pub(crate) fn where_clause(
    filter: &DlqFilter,
    cursor: Option<&Cursor>,
    placeholder: impl Fn(usize) -> String,
) -> StateResult<WhereClause> {
    let mut conditions = Vec::new();
    let mut args = Vec::new();
    let mut push = |template: &str, values: Vec<SqlArg>| {
        let mut sql = template.to_owned();
        for value in values {
            args.push(value);
            sql = sql.replacen("{}", &placeholder(args.len()), 1);
        }
        conditions.push(sql);
    };
    let text_columns = [
        ("bridge_id = {}", &filter.bridge_id),
        ("route_id = {}", &filter.route_id),
        ("binding_id = {}", &filter.binding_id),
    ];
    for (template, value) in text_columns {
        if let Some(value) = value {
            push(template, vec![SqlArg::Text(value.clone())]);
        }
    }
    if let Some(reason) = filter.reason {
        push(
            "reason = {}",
            vec![SqlArg::Text(reason.as_str().to_owned())],
        );
    }
    if let Some(since) = filter.since {
        push(
            "dead_lettered_at >= {}",
            vec![SqlArg::Int(time_to_db(since)?)],
        );
    }
    if let Some(until) = filter.until {
        push(
            "dead_lettered_at < {}",
            vec![SqlArg::Int(time_to_db(until)?)],
        );
    }
    if let Some(cursor) = cursor {
        push(
            "(dead_lettered_at > {} OR (dead_lettered_at = {} AND id > {}))",
            vec![
                SqlArg::Int(cursor.number),
                SqlArg::Int(cursor.number),
                SqlArg::Text(cursor.text.clone()),
            ],
        );
    }
    let sql = if conditions.is_empty() {
        String::new()
    } else {
        format!("WHERE {}", conditions.join(" AND "))
    };
    Ok(WhereClause { sql, args })
}

/// The listing kind of DLQ page tokens.
pub(crate) const PAGE_KIND: &str = "dlq";

/// The sort key of an entry in listings.
pub(crate) fn sort_key(entry: &DlqEntry) -> (String, i64) {
    (
        entry.id.clone(),
        time_to_db(entry.dead_lettered_at).unwrap_or(i64::MAX),
    )
}

/// The arguments of `sql::DLQ_INSERT`.
pub(crate) fn insert_args(entry: &DlqEntry) -> StateResult<Vec<SqlArg>> {
    validate_entry(entry)?;
    Ok(vec![
        SqlArg::Text(entry.id.clone()),
        SqlArg::Text(entry.bridge_id.clone()),
        SqlArg::Text(entry.route_id.clone()),
        SqlArg::Text(entry.binding_id.clone()),
        SqlArg::Text(entry.reason.as_str().to_owned()),
        SqlArg::Text(entry.last_error.clone()),
        SqlArg::Int(u64_to_db(u64::from(entry.attempts))?),
        SqlArg::OptInt(opt_time_to_db(entry.first_attempt_at)?),
        SqlArg::OptInt(opt_time_to_db(entry.last_attempt_at)?),
        SqlArg::Int(time_to_db(entry.dead_lettered_at)?),
        SqlArg::Text(entry.agent_id.clone()),
        SqlArg::Text(entry.address.clone()),
        SqlArg::Bytes(entry.envelope.clone()),
    ])
}

/// The `NotFound` error for an entry.
pub(crate) fn dlq_not_found(id: &str) -> super::error::StateError {
    super::error::StateError::not_found(format!("dlq entry {id:?}"))
}

/// Refuses an entry missing a required field.
pub(crate) fn validate_entry(entry: &DlqEntry) -> StateResult<()> {
    require_id("dlq entry id", &entry.id)?;
    require_id("bridge id", &entry.bridge_id)?;
    require_id("route id", &entry.route_id)?;
    require_id("binding id", &entry.binding_id)?;
    time_to_db(entry.dead_lettered_at)?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::state::types::DlqReason;

    #[test]
    fn renders_numbered_placeholders() {
        let filter = DlqFilter {
            bridge_id: Some("b".into()),
            reason: Some(DlqReason::Expired),
            ..DlqFilter::default()
        };
        let clause = where_clause(&filter, None, |n| format!("${n}")).unwrap();
        assert_eq!(clause.sql, "WHERE bridge_id = $1 AND reason = $2");
        assert_eq!(clause.args.len(), 2);
        let empty = where_clause(&DlqFilter::default(), None, |n| format!("?{n}")).unwrap();
        assert_eq!(empty.sql, "");
    }
}
