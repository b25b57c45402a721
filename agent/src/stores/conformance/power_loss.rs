//! Power-loss test of the SQLite outbox: no acknowledged append is lost when
//! every write that was not synced is dropped.
//!
//! A child process (this test binary, re-run on one test with environment
//! variables, as in `sigkill`) runs the outbox under an `LD_PRELOAD` shim
//! that the test builds with the machine's C compiler. The shim wraps `fsync`
//! and `fdatasync`: when one is called on the outbox's database or WAL file it
//! copies the file — what that sync makes durable — to a numbered snapshot,
//! lets the sync run, and prints `barrier N FILE`. The child appends fan-outs
//! of three records from several tasks and prints `acked …` once an append
//! returned, while a drain loop claims, releases and completes (printing
//! `completing …` before each completion, whose commit is not synced) and a
//! second connection checkpoints and truncates the WAL now and then. Every
//! line is one `write` to one pipe, so the parent reads them in the order
//! they happened.
//!
//! The model of a power cut: each file keeps what it held at its last
//! completed sync, and everything written since is lost. The *image* after
//! barrier N — each file as of its latest snapshot up to N — is what a cut
//! right after that barrier leaves. For every image the parent rebuilds the
//! files in a fresh directory (without `-shm`, so SQLite recovers the WAL as
//! after a crash) and checks that:
//!
//! - the store opens and `PRAGMA integrity_check` passes;
//! - every record acknowledged before the barrier after the image is there,
//!   with its id, binding and envelope, unless its completion had been
//!   issued before the image's own barrier (a completion may or may not have
//!   reached the disk);
//! - every record's envelope is there and no envelope is left without a
//!   record (the message row goes with its last record);
//! - a new lease drains the image to empty.
//!
//! Not modelled: directory entries (the files are created at open, before
//! any acknowledgement) and pages torn within a sync.
//!
//! The check can fail: with `synchronous=NORMAL` a commit is acknowledged
//! before any sync, and [`the_check_finds_appends_acknowledged_before_their_sync`]
//! shows that the same check then finds acknowledged appends missing.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::{envelope, t};
use crate::stores::sqlite::{SqliteOptions, SqliteOutboxStore, Synchronous};
use crate::stores::{NewMessage, NewRecord, OutboxStore, Release};

const CHILD_DB: &str = "FERRY_POWER_LOSS_CHILD_DB";
const CHILD_SYNC: &str = "FERRY_POWER_LOSS_SYNC";
const PARTITION: &str = "bridge/route";
const DB: &str = "outbox.db";
const WRITERS: usize = 4;
const APPENDS: usize = 25;

/// The `LD_PRELOAD` shim (see the module notes).
const SHIM: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned long barriers;

/* The name of the file behind fd when it is the watched database or its WAL. */
static int watched(int fd, char *name, size_t size) {
    const char *db = getenv("FERRY_POWER_LOSS_DB");
    char link[64], path[4096];
    if (!db) return 0;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n < 0) return 0;
    path[n] = 0;
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    size_t len = strlen(db);
    if (strncmp(base, db, len) != 0) return 0;
    if (base[len] != 0 && strcmp(base + len, "-wal") != 0) return 0;
    snprintf(name, size, "%s", base);
    return 1;
}

/* Copies what fd holds to $FERRY_POWER_LOSS_SNAPSHOTS/N-NAME. */
static int copy(int fd, const char *name, unsigned long n) {
    char path[4096], buf[65536];
    snprintf(path, sizeof path, "%s/%lu-%s", getenv("FERRY_POWER_LOSS_SNAPSHOTS"), n, name);
    int out = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (out < 0) return -1;
    off_t at = 0;
    ssize_t got;
    while ((got = pread(fd, buf, sizeof buf, at)) > 0) {
        if (write(out, buf, got) != got) { close(out); return -1; }
        at += got;
    }
    close(out);
    return got < 0 ? -1 : 0;
}

static int barrier(int fd, const char *symbol) {
    int (*real)(int) = (int (*)(int))dlsym(RTLD_NEXT, symbol);
    char name[256];
    if (!watched(fd, name, sizeof name)) return real(fd);
    pthread_mutex_lock(&lock);
    unsigned long n = barriers;
    if (copy(fd, name, n) != 0) abort();
    int rc = real(fd);
    if (rc == 0) {
        char line[512];
        int len = snprintf(line, sizeof line, "barrier %lu %s\n", n, name);
        if (write(1, line, len) != len) abort();
        barriers++;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

int fsync(int fd) { return barrier(fd, "fsync"); }
int fdatasync(int fd) { return barrier(fd, "fdatasync"); }
"#;

/// The child: does nothing unless started by the parent.
#[test]
fn power_loss_child() {
    let Ok(path) = std::env::var(CHILD_DB) else {
        return;
    };
    let synchronous = match std::env::var(CHILD_SYNC).as_deref() {
        Ok("normal") => Synchronous::Normal,
        _ => Synchronous::Full,
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let options = SqliteOptions {
            synchronous,
            ..SqliteOptions::new(&path)
        };
        let store = Arc::new(SqliteOutboxStore::open(options).await.expect("open"));
        let appending = Arc::new(AtomicBool::new(true));
        let checkpointer = checkpoint_until_done(PathBuf::from(&path), Arc::clone(&appending));
        let drainer = tokio::spawn(drain_until_done(Arc::clone(&store), Arc::clone(&appending)));
        let mut writers = Vec::new();
        for w in 0..WRITERS {
            let store = Arc::clone(&store);
            writers.push(tokio::spawn(async move {
                for i in 0..APPENDS {
                    let name = format!("{w}-{i}");
                    let records: Vec<NewRecord> = (0..3)
                        .map(|b| NewRecord::new(format!("b{b}"), "out"))
                        .collect();
                    let ids: Vec<(String, String)> = records
                        .iter()
                        .map(|r| (r.id.clone(), r.binding.to_string()))
                        .collect();
                    let message = NewMessage::new(envelope(&name), t(0), records);
                    let seqs = store.append(PARTITION, message).await.expect("append");
                    for (seq, (id, binding)) in seqs.iter().zip(ids) {
                        println!("acked {seq} {id} {binding} {name}");
                    }
                }
            }));
        }
        for w in writers {
            w.await.expect("writer");
        }
        appending.store(false, Ordering::Relaxed);
        drainer.await.expect("drainer");
        checkpointer.join().expect("checkpointer");
    });
}

/// Claims, fails every fifth record once, and completes the rest, while
/// appends go on.
async fn drain_until_done(store: Arc<SqliteOutboxStore>, appending: Arc<AtomicBool>) {
    let mut round = 0u64;
    while appending.load(Ordering::Relaxed) {
        round += 1;
        let claimed = store
            .claim(PARTITION, "o", 1, 16, t(round))
            .await
            .expect("claim");
        let (failed, done): (Vec<u64>, Vec<u64>) = claimed
            .iter()
            .map(|r| r.seq)
            .partition(|seq| seq.is_multiple_of(5) && round.is_multiple_of(2));
        let failure = Release::Failed {
            error: "e".into(),
            attempted_at: t(round),
        };
        store
            .release(PARTITION, 1, &failed, failure)
            .await
            .expect("release");
        if !done.is_empty() {
            let seqs: Vec<String> = done.iter().map(u64::to_string).collect();
            println!("completing {}", seqs.join(" "));
            store.complete(PARTITION, 1, &done).await.expect("complete");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Another connection checkpoints and truncates the WAL every few
/// milliseconds, so that images cover the database file's syncs and WAL
/// restarts too.
fn checkpoint_until_done(path: PathBuf, appending: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let conn = rusqlite::Connection::open(path).expect("checkpoint connection");
        while appending.load(Ordering::Relaxed) {
            // Busy (a writer is committing) is fine: it tries again.
            let _ = conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()));
            std::thread::sleep(Duration::from_millis(7));
        }
    })
}

/// What the child reported, in order.
#[derive(Default)]
struct Run {
    /// Per barrier, the snapshot holding each file's durable contents.
    images: Vec<BTreeMap<String, PathBuf>>,
    /// Acknowledged records: seq → (id, binding, message name, barriers
    /// seen before the acknowledgement).
    acked: BTreeMap<u64, (String, String, String, usize)>,
    /// Per seq, the barriers seen before its completion was issued.
    completing: BTreeMap<u64, usize>,
}

fn build_shim(dir: &Path) -> PathBuf {
    let source = dir.join("shim.c");
    let shim = dir.join("shim.so");
    std::fs::write(&source, SHIM).expect("write shim source");
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&shim)
        .arg(&source)
        .arg("-ldl")
        .status()
        .expect("run cc (a C compiler is needed to build the fsync shim)");
    assert!(status.success(), "cc failed to build the fsync shim");
    shim
}

/// Runs the child under the shim and collects what it printed.
fn run_child(dir: &Path, sync: &str) -> Run {
    let shim = build_shim(dir);
    let snapshots = dir.join("snapshots");
    std::fs::create_dir(&snapshots).expect("snapshot directory");
    let data = dir.join("data");
    std::fs::create_dir(&data).expect("data directory");
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "stores::conformance::power_loss::power_loss_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_DB, data.join(DB))
        .env(CHILD_SYNC, sync)
        .env("FERRY_POWER_LOSS_DB", DB)
        .env("FERRY_POWER_LOSS_SNAPSHOTS", &snapshots)
        .env("LD_PRELOAD", &shim)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn child");
    let stdout = child.stdout.take().expect("child stdout");
    let mut run = Run::default();
    let mut durable: BTreeMap<String, PathBuf> = BTreeMap::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("read child output");
        // The test harness's "test … ... " has no newline before the
        // child's first line.
        let from = ["barrier ", "acked ", "completing "]
            .iter()
            .filter_map(|keyword| line.find(keyword))
            .min();
        let Some(from) = from else { continue };
        let words: Vec<&str> = line[from..].split(' ').collect();
        match words.as_slice() {
            ["barrier", n, file] => {
                durable.insert((*file).to_owned(), snapshots.join(format!("{n}-{file}")));
                run.images.push(durable.clone());
            }
            ["acked", seq, id, binding, name] => {
                let seq = seq.parse().expect("seq");
                let entry = (
                    (*id).to_owned(),
                    (*binding).to_owned(),
                    (*name).to_owned(),
                    run.images.len(),
                );
                run.acked.insert(seq, entry);
            }
            ["completing", seqs @ ..] => {
                for seq in seqs {
                    run.completing
                        .entry(seq.parse().expect("seq"))
                        .or_insert(run.images.len());
                }
            }
            _ => {}
        }
    }
    let status = child.wait().expect("reap child");
    assert!(status.success(), "the child failed: {status}");
    assert_eq!(
        run.acked.len(),
        WRITERS * APPENDS * 3,
        "every append was acknowledged"
    );
    run
}

/// Checks one image (see the module notes); returns the acknowledged seqs
/// it lacks.
async fn check_image(run: &Run, k: usize, dir: &Path) -> Vec<u64> {
    let image = dir.join(format!("image-{k}"));
    std::fs::create_dir(&image).expect("image directory");
    for (file, snapshot) in &run.images[k] {
        std::fs::copy(snapshot, image.join(file)).expect("copy snapshot");
    }
    let options = SqliteOptions::new(image.join(DB));
    let store = SqliteOutboxStore::open(options.clone())
        .await
        .unwrap_or_else(|e| panic!("image {k} does not open: {e}"));
    let stored = store
        .dump(PARTITION)
        .await
        .unwrap_or_else(|e| panic!("image {k}: {e}"));
    let mut lost = Vec::new();
    for (seq, (id, binding, name, seen)) in &run.acked {
        // Acknowledged after barrier `seen - 1`: this image must have it.
        if *seen > k + 1 {
            continue;
        }
        match stored.iter().find(|r| r.seq == *seq) {
            Some(r) => {
                assert_eq!(
                    (&r.id, &r.binding.to_string(), r.envelope.payload.as_ref()),
                    (id, binding, name.as_bytes()),
                    "image {k}: record {seq} is not as appended"
                );
            }
            None if run.completing.get(seq).is_some_and(|c| *c <= k) => {}
            None => lost.push(*seq),
        }
    }
    let messages: BTreeSet<&str> = stored.iter().map(|r| r.envelope.id.as_str()).collect();
    assert_eq!(
        store.envelopes(PARTITION).await,
        Ok(messages.len()),
        "image {k}: an envelope without a record"
    );
    // A new lease takes everything and drains the image to empty.
    let hwm = store.stats(PARTITION).await.expect("stats").high_water_mark;
    let all = store
        .claim(PARTITION, "check", hwm + 1, usize::MAX, t(1_000_000))
        .await
        .expect("claim");
    assert_eq!(
        all.len(),
        stored.len(),
        "image {k}: a record cannot be claimed"
    );
    let seqs: Vec<u64> = all.iter().map(|r| r.seq).collect();
    store
        .complete(PARTITION, hwm + 1, &seqs)
        .await
        .expect("complete");
    assert_eq!(
        store.envelopes(PARTITION).await,
        Ok(0),
        "image {k}: drained"
    );
    store.close().await;
    let conn = rusqlite::Connection::open(image.join(DB)).expect("open image");
    let integrity: String = conn
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .expect("integrity_check");
    assert_eq!(integrity, "ok", "image {k}");
    drop(conn);
    std::fs::remove_dir_all(&image).expect("remove image");
    lost
}

/// Every image of a run; the acknowledged seqs each image lacks.
async fn lost_per_image(run: &Run, dir: &Path) -> Vec<(usize, Vec<u64>)> {
    // Acknowledged before any barrier: no image holds it.
    let before_any: Vec<u64> = run
        .acked
        .iter()
        .filter(|(_, (.., seen))| *seen == 0)
        .map(|(seq, _)| *seq)
        .collect();
    let mut lost = Vec::new();
    if !before_any.is_empty() {
        lost.push((0, before_any));
    }
    for k in 0..run.images.len() {
        let missing = check_image(run, k, dir).await;
        if !missing.is_empty() {
            lost.push((k, missing));
        }
    }
    lost
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_appends_survive_power_loss() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let run = run_child(dir.path(), "full");
    let db_syncs = run
        .images
        .windows(2)
        .filter(|w| w[0].get(DB) != w[1].get(DB))
        .count();
    println!(
        "{} acknowledged records, {} barriers ({db_syncs} of the database file)",
        run.acked.len(),
        run.images.len()
    );
    assert!(!run.images.is_empty(), "the shim saw no sync");
    let lost = lost_per_image(&run, dir.path()).await;
    let first: Vec<_> = lost.iter().take(3).collect();
    assert!(
        lost.is_empty(),
        "acknowledged but lost in {} images; the first (image, seqs): {first:?}",
        lost.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_check_finds_appends_acknowledged_before_their_sync() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let run = run_child(dir.path(), "normal");
    let lost = lost_per_image(&run, dir.path()).await;
    println!(
        "synchronous=NORMAL: {} acknowledged records, {} barriers, {} images lack some",
        run.acked.len(),
        run.images.len(),
        lost.len()
    );
    assert!(
        !lost.is_empty(),
        "commits acknowledged without a sync were found in every image"
    );
}
