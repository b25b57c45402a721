//! SIGKILL test for the SQLite outbox: a child process (this test binary,
//! re-run on one test with an environment variable) appends from several
//! tasks and prints each acknowledged seq; the parent kills it with SIGKILL
//! mid-stream, reopens the database and finds every acknowledged record.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;

use super::{envelope, sqlite_options, t};
use crate::stores::sqlite::{SqliteOptions, SqliteOutboxStore};
use crate::stores::{NewMessage, NewRecord, OutboxStore};

const CHILD_DB: &str = "FERRY_SIGKILL_CHILD_DB";
const PARTITION: &str = "bridge/route";
/// Acknowledgements the parent waits for before killing the child.
const KILL_AFTER: usize = 300;

/// The child: does nothing unless started by the parent.
#[test]
fn sigkill_child() {
    let Ok(path) = std::env::var(CHILD_DB) else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let store = Arc::new(
            SqliteOutboxStore::open(SqliteOptions::new(path))
                .await
                .expect("open"),
        );
        let mut tasks = Vec::new();
        for w in 0..4 {
            let store = Arc::clone(&store);
            tasks.push(tokio::spawn(async move {
                for i in 0.. {
                    // A fan-out of three records, as a route writes them.
                    let records: Vec<NewRecord> = (0..3)
                        .map(|b| NewRecord::new(format!("b{b}"), "a"))
                        .collect();
                    let ids: Vec<String> = records.iter().map(|r| r.id.clone()).collect();
                    let message = NewMessage::new(envelope(&format!("{w}-{i}")), t(0), records);
                    let seqs = store.append(PARTITION, message).await.expect("append");
                    for (seq, id) in seqs.iter().zip(ids) {
                        println!("acked {seq} {id}");
                    }
                }
            }));
        }
        for task in tasks {
            let _ = task.await;
        }
    });
}

#[tokio::test]
async fn acknowledged_appends_survive_sigkill() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let options = sqlite_options(&dir, "outbox.db");
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "stores::conformance::sigkill::sigkill_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_DB, &options.path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn child");
    let stdout = child.stdout.take().expect("child stdout");
    let mut lines = BufReader::new(stdout).lines();
    let mut acked = Vec::new();
    while acked.len() < KILL_AFTER {
        let Some(line) = lines.next() else { break };
        let line = line.expect("read");
        if let Some(rest) = line.strip_prefix("acked ") {
            acked.push(rest.to_owned());
        }
    }
    child.kill().expect("SIGKILL");
    // Lines already written before the kill were acknowledged too.
    for line in lines.map_while(Result::ok) {
        if let Some(rest) = line.strip_prefix("acked ") {
            acked.push(rest.to_owned());
        }
    }
    child.wait().expect("reap child");
    assert!(
        acked.len() >= KILL_AFTER,
        "child stopped early after {} acks",
        acked.len()
    );

    let store = SqliteOutboxStore::open(options).await.expect("reopen");
    let stored: Vec<String> = store
        .dump(PARTITION)
        .await
        .expect("dump")
        .into_iter()
        .map(|r| format!("{} {}", r.seq, r.id))
        .collect();
    println!(
        "{} acknowledged, {} stored after SIGKILL",
        acked.len(),
        stored.len()
    );
    let missing: Vec<&String> = acked.iter().filter(|a| !stored.contains(a)).collect();
    assert!(missing.is_empty(), "acknowledged but lost: {missing:?}");
    // Whatever else is there was committed but not yet printed: seqs are
    // still gap-free, so no transaction was applied in part.
    let mut seqs: Vec<u64> = stored
        .iter()
        .filter_map(|s| s.split(' ').next()?.parse().ok())
        .collect();
    seqs.sort_unstable();
    assert!(
        seqs.iter().zip(1..).all(|(s, i)| *s == i),
        "gap in {seqs:?}"
    );
    assert_eq!(seqs.len() % 3, 0, "a fan-out batch was stored in part");
}
