//! Giving free pages back to the file system, so that a store shrinks back
//! after a backlog drains (15 MB stayed on disk after 5 000 records before).
//!
//! - Every database uses `auto_vacuum = INCREMENTAL`. SQLite accepts the
//!   mode only before the file's first page is written: a new database gets
//!   it when it is connected, before WAL is switched on; an existing one (created by an older build) is converted once
//!   with `VACUUM` when it is opened. The conversion needs free disk space of
//!   about the file's size; when it fails the store still opens (a warning
//!   says the file will not shrink) and [`shrink_when_idle`] leaves it
//!   alone.
//! - The writer thread calls [`shrink_when_idle`] when its queue is empty.
//!   It costs two header reads unless at least half the file, and at least
//!   [`MIN_FREE_BYTES`], is free pages; then it returns them in steps of
//!   [`STEP_PAGES`] while nothing waits, and truncates the `-wal` file with
//!   `wal_checkpoint(TRUNCATE)` without waiting for readers (it is tried
//!   again after the next shrink). The half-the-file rule keeps it off the
//!   hot path: while records are appended and deleted at the same pace the
//!   free pages are reused, not returned.
//!
//! No step adds an fsync to a caller's write: the steps run between groups,
//! in their own transactions, at the connection's current sync level.

use std::path::Path;
use std::time::Duration;

use rusqlite::Connection;

use super::sql_error;
use crate::stores::StoreResult;

/// Free space worth returning.
pub(super) const MIN_FREE_BYTES: i64 = 1024 * 1024;
/// Pages returned per step, so that a job arriving meanwhile waits little.
pub(super) const STEP_PAGES: i64 = 1024;
/// `PRAGMA auto_vacuum` value of `INCREMENTAL`.
const INCREMENTAL: i64 = 2;

fn pragma_i64(conn: &Connection, name: &str) -> StoreResult<i64> {
    conn.query_row(&format!("PRAGMA {name}"), [], |r| r.get(0))
        .map_err(sql_error)
}

/// Runs a statement that may return rows to its end.
fn run_to_end(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    let mut stmt = conn.prepare(sql)?;
    let mut rows = stmt.query([])?;
    while rows.next()?.is_some() {}
    Ok(())
}

/// Puts the database on incremental auto-vacuum (see the module notes).
pub(super) fn enable_incremental(conn: &Connection, path: &Path) -> StoreResult<()> {
    if pragma_i64(conn, "auto_vacuum")? == INCREMENTAL {
        return Ok(());
    }
    conn.execute_batch("PRAGMA auto_vacuum=INCREMENTAL")
        .map_err(sql_error)?;
    if pragma_i64(conn, "auto_vacuum")? == INCREMENTAL {
        return Ok(());
    }
    // Tables exist already: only a VACUUM rewrites the file in the new mode.
    match conn.execute_batch("VACUUM") {
        Ok(()) => tracing::info!(
            path = %path.display(),
            "sqlite database converted to incremental auto-vacuum"
        ),
        Err(error) => tracing::warn!(
            path = %path.display(),
            %error,
            "cannot convert the sqlite database to incremental auto-vacuum; it will not shrink after a backlog"
        ),
    }
    Ok(())
}

/// Returns free pages to the file system when they are worth it, while
/// `idle()` holds; true when it returned any.
pub(super) fn shrink_when_idle(conn: &Connection, idle: impl Fn() -> bool) -> StoreResult<bool> {
    let free = pragma_i64(conn, "freelist_count")?;
    let pages = pragma_i64(conn, "page_count")?;
    if free == 0 || free.saturating_mul(2) < pages {
        return Ok(false);
    }
    let page_size = pragma_i64(conn, "page_size")?;
    if free.saturating_mul(page_size) < MIN_FREE_BYTES {
        return Ok(false);
    }
    // A file whose conversion failed (see `enable_incremental`) keeps its
    // free pages: `incremental_vacuum` does nothing there.
    if pragma_i64(conn, "auto_vacuum")? != INCREMENTAL {
        return Ok(false);
    }
    let mut left = free;
    loop {
        run_to_end(conn, &format!("PRAGMA incremental_vacuum({STEP_PAGES})")).map_err(sql_error)?;
        let now = pragma_i64(conn, "freelist_count")?;
        // A step that returned nothing would return nothing again: stop
        // rather than spin while the writer is idle.
        let returned = now < left;
        left = now;
        if now == 0 || !returned || !idle() {
            break;
        }
    }
    truncate_wal(conn)?;
    Ok(left < free)
}

/// `wal_checkpoint(TRUNCATE)` without waiting on a reader: the busy timeout
/// is zero meanwhile. A checkpoint a reader is in the way of does nothing.
fn truncate_wal(conn: &Connection) -> StoreResult<()> {
    let busy_ms = pragma_i64(conn, "busy_timeout")?;
    conn.busy_timeout(Duration::ZERO).map_err(sql_error)?;
    let checkpoint = run_to_end(conn, "PRAGMA wal_checkpoint(TRUNCATE)");
    conn.busy_timeout(Duration::from_millis(u64::try_from(busy_ms).unwrap_or(0)))
        .map_err(sql_error)?;
    checkpoint.map_err(sql_error)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file in auto-vacuum `mode` whose 10 MB of rows were deleted: about
    /// 2 500 free pages, more than two steps' worth, and all of the file
    /// but its tables' roots.
    fn file_with_free_pages(mode: &str) -> (tempfile::TempDir, Connection) {
        let dir = tempfile::tempdir().expect("temporary directory");
        let conn = Connection::open(dir.path().join("v.db")).expect("open");
        conn.execute_batch(&format!(
            "PRAGMA auto_vacuum={mode}; PRAGMA journal_mode=WAL; CREATE TABLE t (x BLOB); \
             WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2500) \
             INSERT INTO t SELECT zeroblob(4000) FROM n; DELETE FROM t;"
        ))
        .expect("a file with free pages");
        assert!(pragma_i64(&conn, "freelist_count").expect("freelist") > 2 * STEP_PAGES);
        (dir, conn)
    }

    #[test]
    fn an_incremental_file_gives_its_free_pages_back() {
        let (dir, conn) = file_with_free_pages("INCREMENTAL");
        assert_eq!(shrink_when_idle(&conn, || true), Ok(true));
        assert_eq!(pragma_i64(&conn, "freelist_count"), Ok(0));
        drop(conn);
        drop(dir);
    }

    /// A file whose conversion to incremental auto-vacuum failed keeps its
    /// free pages, and the idle writer must not step forever trying to
    /// return them (it did: `incremental_vacuum` does nothing there, and
    /// the writer spun while idle and never closed).
    #[test]
    fn a_file_without_incremental_auto_vacuum_is_left_as_it_is() {
        let (dir, conn) = file_with_free_pages("NONE");
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let shrunk = shrink_when_idle(&conn, || true);
            drop(conn);
            drop(dir);
            let _ = done.send(shrunk);
        });
        let shrunk = finished
            .recv_timeout(Duration::from_secs(10))
            .expect("shrink_when_idle returned");
        assert_eq!(shrunk, Ok(false));
    }
}
