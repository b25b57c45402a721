//! The writer thread and group commit.
//!
//! One thread owns the write connection. Callers send it jobs over a bounded
//! channel (a full channel makes them wait: back-pressure, not memory
//! growth). The thread takes every job waiting in the channel, up to
//! [`MAX_GROUP`], and runs them in one `BEGIN IMMEDIATE … COMMIT`. Each
//! caller is answered only after `COMMIT` returned, and a *synced* job of a
//! `synchronous=FULL` store only once the WAL was synced after that: its
//! `Ok` is durable.
//!
//! The connection itself always commits with `synchronous=NORMAL` (atomic,
//! visible, kept across a process crash, not fsynced): with `FULL` a
//! [`Syncer`] thread syncs the WAL and answers the synced jobs (its module
//! notes say why that is as durable as SQLite's own `FULL`), so the writer
//! goes on committing while a sync runs, and the jobs committed meanwhile
//! share the next sync. Some writes need not survive a power loss because
//! losing one only repeats work (a claim or a completion of the outbox: the
//! record is sent again, never lost). They are sent as *unsynced* jobs and
//! answered at their commit. This is safe to mix with synced commits
//! because the WAL is one append-only file: a sync makes every earlier frame
//! durable too, so a power loss can only take back a tail of commits not
//! yet synced, never one from before an acknowledged durable write.
//!
//! **After the store was found full, unsynced and synced jobs commit in
//! separate transactions** (the unsynced ones first) for
//! [`SPLIT_AFTER_FULL`]. When the store is full (disk, `max_size_bytes`)
//! SQLite rolls back the whole transaction, so a group mixing the drainer's
//! completions — which free room — with an append that does not fit would
//! take the completions back too, and room would never come back. On the
//! happy path everything waiting shares one transaction, as before (one
//! commit per group): no second commit per group where nothing needs it.
//!
//! **A store with a size limit keeps room for drain writes.** With
//! `max_size_bytes`, groups with a synced job (appends, DLQ puts) may grow
//! the file only to [`PageLimit::durable`], an eighth below the limit;
//! groups of unsynced jobs may use all of it. A claim or a failed release
//! grows the narrow record rows it marks (claim owner, error text), so
//! without that room a store filled by appends could not claim, release or
//! complete — and only completions give room back.
//!
//! Calls of one kind can share one job: a [`Batch`]. The first call sends
//! the job and every call made before the writer runs it joins it, so the
//! work those calls have in common (a job, a wake-up, the lookups it begins
//! with) is paid once; the outbox's appends use it.
//!
//! When the queue is empty after a group, the thread gives free pages back
//! to the file system if they are worth it ([`super::vacuum`]), between
//! groups, never inside one.
//!
//! A failing job must not leave half its writes in the group. Jobs write
//! only with `INSERT`, `UPDATE` and `DELETE`, and SQLite undoes a failed
//! statement's own changes, so a job that failed without completing any
//! statement (the connection's total change count did not move: fenced
//! out, invalid arguments, a lock timeout) changed nothing and the group
//! goes on. A job that failed after some of its statements completed takes
//! the whole group back with it: every job of the group is answered with an
//! error and none of it is applied. When SQLite itself rolled the
//! transaction back for lack of room, the other jobs are answered
//! [`StoreError::Full`] (certainly not applied) rather than `Unavailable`. (A savepoint per job would isolate it
//! exactly, but copying each touched page to the statement journal cost
//! more than a third of the writer's time under load, for a case that only
//! I/O errors and corrupt rows reach.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use rusqlite::Connection;
use tokio::sync::{mpsc, oneshot};

use super::sql_error;
use super::syncer::{Durability, Syncer, Waiting, refused_after_failed_sync};
use crate::stores::{StoreError, StoreResult};

/// Jobs waiting for the writer; senders wait when it is full.
const CHANNEL_CAPACITY: usize = 1024;
/// Most jobs committed in one transaction, so one group cannot hold the
/// write lock (and its callers) for long.
const MAX_GROUP: usize = 512;
/// How long after a group failed for lack of room the writer commits drain
/// writes apart from durable writes (see the module notes).
const SPLIT_AFTER_FULL: std::time::Duration = std::time::Duration::from_secs(10);

/// A unit of work run inside the group transaction; answered (as a
/// [`Waiting`] write) with the outcome of the work and of the commit, and of
/// the sync when it is synced.
trait Job: Waiting {
    /// Runs the work; returns its error when it failed.
    fn run(&mut self, conn: &Connection) -> Result<(), StoreError>;
    /// Whether its commit must be fsynced (see the module notes).
    fn synced(&self) -> bool;
}

struct TypedJob<T, F> {
    synced: bool,
    work: Option<F>,
    result: Option<StoreResult<T>>,
    reply: Reply<T>,
}

impl<T, F> Job for TypedJob<T, F>
where
    T: Send,
    F: FnOnce(&Connection) -> StoreResult<T> + Send,
{
    fn run(&mut self, conn: &Connection) -> Result<(), StoreError> {
        let result = match self.work.take() {
            Some(work) => work(conn),
            None => Err(StoreError::Unavailable("job run twice".into())),
        };
        let outcome = match &result {
            Ok(_) => Ok(()),
            Err(e) => Err(e.clone()),
        };
        self.result = Some(result);
        outcome
    }

    fn synced(&self) -> bool {
        self.synced
    }
}

impl<T: Send, F: Send> Waiting for TypedJob<T, F> {
    fn answer(self: Box<Self>, commit: &StoreResult<()>) {
        let outcome = match (self.result, commit) {
            // The job's own failure was rolled back: certainly not applied.
            (Some(Err(e)), _) => Err(e),
            (Some(Ok(v)), Ok(())) => Ok(v),
            (_, Err(e)) => Err(e.clone()),
            (None, Ok(())) => Err(StoreError::Unavailable("job was not run".into())),
        };
        // The caller may have given up waiting; its outcome is then unknown
        // to it, which `Unavailable` already told it to expect.
        let _ = self.reply.send(outcome);
    }
}

/// Calls of one kind that the writer runs as one job: a batch.
///
/// The first call that finds the batch empty sends its job; every call
/// queued before the writer runs that job joins it, and later calls start
/// the next one. A batch pays once what every call would otherwise pay
/// (a job, a wake-up of the writer, the lookups its work begins with). A
/// call that joins a job may commit ahead of jobs sent before it: calls
/// made concurrently have no order to keep. Only the first call of a batch
/// holds a place in the writer's channel, and a batch counts as one job of
/// its group, so a batch is as large as the calls made at once (for the
/// outbox's appends, the deliveries its routes have in flight).
/// `work` gets the calls in the order they were made and returns each
/// one's own result; its `Err` fails every call of the batch, and it takes
/// the writer's group back if the batch wrote part of its work before it
/// (as for any job, see the module notes).
pub(crate) struct Batch<I, T> {
    synced: bool,
    work: BatchWork<I, T>,
    waiting: Mutex<Vec<(I, Reply<T>)>>,
}

/// Where a call's result goes.
type Reply<T> = oneshot::Sender<StoreResult<T>>;

/// What a [`Batch`] does with its calls.
pub(crate) type BatchWork<I, T> =
    Box<dyn Fn(&Connection, Vec<I>) -> StoreResult<Vec<StoreResult<T>>> + Send + Sync>;

impl<I: Send + 'static, T: Send + 'static> Batch<I, T> {
    /// Calls run by `work`, committed as [`Writer::execute`]'s `synced`.
    pub(crate) fn new(synced: bool, work: BatchWork<I, T>) -> Arc<Self> {
        Arc::new(Batch {
            synced,
            work,
            waiting: Mutex::new(Vec::new()),
        })
    }
}

impl<I, T> Batch<I, T> {
    fn waiting(&self) -> MutexGuard<'_, Vec<(I, Reply<T>)>> {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The job of a [`Batch`]: takes the calls waiting when it runs.
struct BatchJob<I, T> {
    batch: Arc<Batch<I, T>>,
    /// The calls it took, with their own results once run.
    taken: Vec<(Reply<T>, Option<StoreResult<T>>)>,
    /// Whether it took its calls (then later calls belong to a later job).
    took: bool,
}

impl<I: Send + 'static, T: Send + 'static> BatchJob<I, T> {
    /// Every call taken fails with `error` (written or not, none of the
    /// batch stays: see [`Batch`]); returns it for the writer.
    fn fail(&mut self, error: StoreError) -> StoreError {
        for (_, slot) in &mut self.taken {
            *slot = Some(Err(error.clone()));
        }
        error
    }

    /// Takes the calls waiting; their inputs.
    fn take(&mut self) -> Vec<I> {
        // The next batch starts at this one's size: growing the vector
        // from empty moved its calls again at every doubling.
        let waiting = {
            let mut waiting = self.batch.waiting();
            let size = waiting.len();
            std::mem::replace(&mut *waiting, Vec::with_capacity(size))
        };
        self.took = true;
        let (items, replies): (Vec<I>, Vec<_>) = waiting.into_iter().unzip();
        self.taken = replies.into_iter().map(|reply| (reply, None)).collect();
        items
    }
}

impl<I: Send + 'static, T: Send + 'static> Job for BatchJob<I, T> {
    fn run(&mut self, conn: &Connection) -> Result<(), StoreError> {
        let items = self.take();
        let results = match (self.batch.work)(conn, items) {
            Ok(results) if results.len() == self.taken.len() => results,
            Ok(results) => {
                let error = StoreError::Unavailable(format!(
                    "a batch of {} calls returned {} results",
                    self.taken.len(),
                    results.len()
                ));
                return Err(self.fail(error));
            }
            Err(error) => return Err(self.fail(error)),
        };
        for ((_, slot), result) in self.taken.iter_mut().zip(results) {
            *slot = Some(result);
        }
        Ok(())
    }

    fn synced(&self) -> bool {
        self.batch.synced
    }
}

impl<I: Send + 'static, T: Send + 'static> Waiting for BatchJob<I, T> {
    fn answer(mut self: Box<Self>, commit: &StoreResult<()>) {
        if !self.took {
            // Refused before it ran: its calls are answered all the same.
            self.take();
        }
        for (reply, result) in std::mem::take(&mut self.taken) {
            let outcome = match (result, commit) {
                // Its own failure: it wrote nothing, or its batch took the
                // group back (see `fail`). Certainly not applied.
                (Some(Err(e)), _) => Err(e),
                (Some(Ok(v)), Ok(())) => Ok(v),
                (_, Err(e)) => Err(e.clone()),
                (None, Ok(())) => Err(StoreError::Unavailable("the batch was not run".into())),
            };
            let _ = reply.send(outcome);
        }
    }
}

impl<I, T> Drop for BatchJob<I, T> {
    fn drop(&mut self) {
        if !self.took {
            // Dropped unrun (the writer stopped): no later job will take
            // its calls, and dropping their senders answers them.
            self.batch.waiting().clear();
        }
    }
}

/// Handle to the writer thread.
pub(crate) struct Writer {
    jobs: mpsc::Sender<Box<dyn Job>>,
    thread: JoinHandle<()>,
    /// Transactions committed: with the jobs answered, how well groups form.
    commits: Arc<AtomicU64>,
    /// The groups' numbers and how far they are durable.
    durability: Arc<Durability>,
}

impl Writer {
    /// Starts the writer thread on `conn`; `full` when the store is
    /// configured `synchronous=FULL`: then the connection commits with
    /// `NORMAL` and a [`Syncer`] makes the synced jobs durable.
    pub(crate) fn start(
        conn: Connection,
        name: &str,
        full: bool,
        limit: Option<PageLimit>,
    ) -> StoreResult<Self> {
        let durability = Durability::new(full);
        let syncer = if full {
            let wal = wal_path(&conn)?;
            let syncer = Syncer::for_wal(&wal, name, Arc::clone(&durability))?;
            conn.execute_batch("PRAGMA synchronous=NORMAL")
                .map_err(sql_error)?;
            Some(syncer)
        } else {
            None
        };
        let (jobs, rx) = mpsc::channel(CHANNEL_CAPACITY);
        let commits = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&commits);
        let numbers = Arc::clone(&durability);
        let thread = std::thread::Builder::new()
            .name(format!("ferry-sqlite-{name}"))
            .spawn(move || {
                let sync = Syncing {
                    syncer,
                    durability: numbers,
                };
                run(conn, rx, sync, Levels::new(limit), &counter)
            })
            .map_err(|e| StoreError::Unavailable(format!("cannot start writer thread: {e}")))?;
        Ok(Writer {
            jobs,
            thread,
            commits,
            durability,
        })
    }

    /// The groups' numbers and how far they are durable, for work that must
    /// hold back what is not yet durable (see [`Durability`]).
    pub(crate) fn durability(&self) -> Arc<Durability> {
        Arc::clone(&self.durability)
    }

    /// Runs `work` in the next group transaction and returns its result once
    /// the transaction is committed (and the WAL synced since, if `synced`
    /// and the store is `synchronous=FULL`).
    pub(crate) async fn execute<T, F>(&self, synced: bool, work: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let job = Box::new(TypedJob {
            synced,
            work: Some(work),
            result: None,
            reply,
        });
        self.place().await?.send(job);
        answered(answer).await
    }

    /// A place in the writer's channel (callers wait while it is full).
    async fn place(&self) -> StoreResult<mpsc::Permit<'_, Box<dyn Job>>> {
        self.jobs
            .reserve()
            .await
            .map_err(|_| StoreError::Unavailable("sqlite writer has stopped".into()))
    }

    /// Runs `item` in `batch`'s next job (see [`Batch`]) and returns its
    /// result once that job's transaction is committed.
    pub(crate) async fn execute_batched<I, T>(
        &self,
        batch: &Arc<Batch<I, T>>,
        item: I,
    ) -> StoreResult<T>
    where
        I: Send + 'static,
        T: Send + 'static,
    {
        // A place in the channel before the call is queued: a caller
        // dropped while waiting for room leaves nothing queued, and the
        // first call sends its job without waiting in between, so a queued
        // call always has a job coming for it.
        let permit = self.place().await?;
        let (reply, answer) = oneshot::channel();
        let first = {
            let mut waiting = batch.waiting();
            waiting.push((item, reply));
            waiting.len() == 1
        };
        if first {
            permit.send(Box::new(BatchJob {
                batch: Arc::clone(batch),
                taken: Vec::new(),
                took: false,
            }));
        } else {
            // Its job is already on its way: the place goes back now, not
            // when the call is answered.
            drop(permit);
        }
        answered(answer).await
    }

    /// Transactions committed so far.
    pub(crate) fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// Stops the thread after the jobs already sent and waits for it, so the
    /// connection is closed when this returns.
    pub(crate) async fn close(self) {
        let Writer { jobs, thread, .. } = self;
        drop(jobs);
        // Joining blocks, so it runs on the blocking pool. A panicked writer
        // has nothing left to close.
        let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    }
}

/// The WAL file of `conn`'s database.
fn wal_path(conn: &Connection) -> StoreResult<std::path::PathBuf> {
    match conn.path() {
        Some(path) if !path.is_empty() => Ok(format!("{path}-wal").into()),
        _ => Err(StoreError::Unavailable(
            "a synchronous=FULL store needs a database file".into(),
        )),
    }
}

/// A call's answer; `Unavailable` when the writer stopped without one.
async fn answered<T>(answer: oneshot::Receiver<StoreResult<T>>) -> StoreResult<T> {
    answer
        .await
        .map_err(|_| StoreError::Unavailable("sqlite writer stopped before answering".into()))?
}

/// The size limit of a store in pages (`max_page_count`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PageLimit(pub(crate) u64);

impl PageLimit {
    /// What groups with a synced job may grow the file to: an eighth (at
    /// least four pages) below the limit, kept for drain writes.
    fn durable(self) -> u64 {
        let reserve = (self.0 / 8).max(4);
        self.0.saturating_sub(reserve).max(1)
    }
}

/// How the writer's groups become durable: numbered, and their synced jobs
/// handed to the syncer when there is one.
struct Syncing {
    syncer: Option<Syncer>,
    durability: Arc<Durability>,
}

/// The connection's page limit, switched between groups as their jobs need.
struct Levels {
    limit: Option<PageLimit>,
    /// The `max_page_count` in force.
    pages: Option<u64>,
}

impl Levels {
    /// The connection starts with `max_page_count` at the whole limit.
    fn new(limit: Option<PageLimit>) -> Self {
        Levels {
            limit,
            pages: limit.map(|l| l.0),
        }
    }
}

fn run(
    conn: Connection,
    mut rx: mpsc::Receiver<Box<dyn Job>>,
    sync: Syncing,
    mut levels: Levels,
    commits: &AtomicU64,
) {
    // When a group last failed for lack of room.
    let mut full_at: Option<std::time::Instant> = None;
    while let Some(first) = rx.blocking_recv() {
        let mut waiting = vec![first];
        while waiting.len() < MAX_GROUP {
            match rx.try_recv() {
                Ok(job) => waiting.push(job),
                Err(_) => break,
            }
        }
        // Waiting jobs were sent concurrently: committing one kind before
        // the other reorders nothing any caller could have relied on.
        let split = full_at.is_some_and(|at| at.elapsed() < SPLIT_AFTER_FULL);
        let groups = if split {
            let (synced, unsynced): (Vec<_>, Vec<_>) =
                waiting.into_iter().partition(|job| job.synced());
            vec![unsynced, synced]
        } else {
            vec![waiting]
        };
        for group in groups.into_iter().filter(|g| !g.is_empty()) {
            match commit_kind(&conn, group, &sync, &mut levels) {
                Ok(()) => {
                    commits.fetch_add(1, Ordering::Relaxed);
                }
                Err(StoreError::Full(_)) => full_at = Some(std::time::Instant::now()),
                Err(_) => {}
            }
        }
        if rx.is_empty() {
            // Idle: give free pages back (cheap unless worth it).
            if let Err(error) = super::vacuum::shrink_when_idle(&conn, || rx.is_empty()) {
                tracing::debug!(%error, "shrinking the sqlite file failed; tried again when idle");
            }
        }
    }
    // Every synced job handed over is answered before the connection closes.
    drop(sync);
}

/// Commits a group, first switching the connection's page limit (see the
/// module notes) when needed; the group's outcome.
fn commit_kind(
    conn: &Connection,
    group: Vec<Box<dyn Job>>,
    sync: &Syncing,
    levels: &mut Levels,
) -> StoreResult<()> {
    let synced = group.iter().any(|job| job.synced());
    if let Some(limit) = levels.limit {
        let pages = if synced { limit.durable() } else { limit.0 };
        if levels.pages != Some(pages) {
            // Returns the limit in force (never below the file's size).
            match conn.query_row(&format!("PRAGMA max_page_count={pages}"), [], |r| {
                r.get::<_, i64>(0)
            }) {
                Ok(_) => levels.pages = Some(pages),
                Err(e) => return refuse(group, &e),
            }
        }
    }
    commit_group(conn, group, sync)
}

/// Answers every job of a group that cannot run with `error`.
fn refuse(group: Vec<Box<dyn Job>>, error: &rusqlite::Error) -> StoreResult<()> {
    let error = StoreError::Unavailable(format!("sqlite: {error}"));
    for job in group {
        job.answer(&Err(error.clone()));
    }
    Err(error)
}

/// Runs and answers one group, numbered, its synced jobs through the syncer
/// when there is one; its outcome (`Ok` when it committed).
fn commit_group(
    conn: &Connection,
    mut group: Vec<Box<dyn Job>>,
    sync: &Syncing,
) -> StoreResult<()> {
    if sync.durability.has_failed() {
        // Never to be answered `Ok`: refused before anything of it is
        // written (invariant 2 of the syncer).
        let refused;
        (refused, group) = group.into_iter().partition(|job| job.synced());
        let error = refused_after_failed_sync();
        for job in refused {
            job.answer(&Err(error.clone()));
        }
        if group.is_empty() {
            return Err(error);
        }
    }
    let number = sync.durability.begin_group();
    let syncer = sync.syncer.as_ref();
    let outcome = run_group(conn, &mut group);
    if outcome.is_err() {
        // Nothing of the group may stay half-applied; a failed ROLLBACK
        // means SQLite already rolled back.
        let _ = conn.execute_batch("ROLLBACK");
    }
    let mut durable = Vec::new();
    for job in group {
        match syncer {
            // Committed: answered once the WAL is synced.
            Some(_) if outcome.is_ok() && job.synced() => durable.push(job as Box<dyn Waiting>),
            _ => job.answer(&outcome),
        }
    }
    if let Some(syncer) = syncer.filter(|_| !durable.is_empty()) {
        syncer.committed(number, durable);
    }
    outcome
}

fn run_group(conn: &Connection, group: &mut [Box<dyn Job>]) -> StoreResult<()> {
    control(conn, "BEGIN IMMEDIATE")?;
    for job in group.iter_mut() {
        let before = conn.total_changes();
        if let Err(error) = job.run(conn) {
            if conn.is_autocommit() {
                // SQLite rolled the whole transaction back itself (a full
                // disk, an I/O error): later jobs must not run outside it.
                return Err(match error {
                    StoreError::Full(e) => StoreError::Full(format!(
                        "rolled back with a write of the same transaction that did not fit: {e}"
                    )),
                    _ => StoreError::Unavailable(
                        "the transaction was rolled back by a failed write".into(),
                    ),
                });
            }
            if conn.total_changes() != before {
                return Err(StoreError::Unavailable(
                    "rolled back with a write of the same transaction that failed part-way".into(),
                ));
            }
        }
    }
    control(conn, "COMMIT").map_err(|e| {
        // A failed COMMIT may have reached the disk in part: unknown.
        StoreError::Unavailable(format!("commit failed: {e}"))
    })
}

/// Runs a transaction-control statement, prepared once per connection
/// rather than parsed for every group.
fn control(conn: &Connection, sql: &str) -> StoreResult<()> {
    conn.prepare_cached(sql)
        .and_then(|mut stmt| stmt.execute([]))
        .map(|_| ())
        .map_err(sql_error)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// How a store without a syncer commits.
    fn unsynced() -> Syncing {
        Syncing {
            syncer: None,
            durability: Durability::new(false),
        }
    }

    fn writer() -> (Writer, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("temporary directory");
        let conn = Connection::open(dir.path().join("w.db")).expect("open");
        conn.execute_batch("PRAGMA journal_mode=WAL; CREATE TABLE t (x INTEGER UNIQUE)")
            .expect("schema");
        (Writer::start(conn, "test", true, None).expect("start"), dir)
    }

    fn insert(x: i64) -> impl FnOnce(&Connection) -> StoreResult<i64> + Send + 'static {
        move |c| {
            c.execute("INSERT INTO t (x) VALUES (?1)", [x])
                .map_err(super::super::sql_error)?;
            Ok(x)
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_jobs_share_transactions_and_fail_alone() {
        let (w, _dir) = writer();
        let w = Arc::new(w);
        let mut calls = Vec::new();
        for i in 0..400 {
            let w = Arc::clone(&w);
            // Every tenth job collides with an earlier one and must fail
            // without taking its group down.
            let x = if i % 10 == 9 { i - 1 } else { i };
            // Half of them need no fsync: they share groups all the same.
            let synced = i % 2 == 0;
            calls.push(tokio::spawn(async move {
                (i, w.execute(synced, insert(x)).await)
            }));
        }
        let mut failed = 0;
        for call in calls {
            let (i, r) = call.await.expect("task");
            match r {
                Ok(x) => assert_eq!(x, if i % 10 == 9 { i - 1 } else { i }),
                Err(_) => failed += 1,
            }
        }
        // Exactly one of each colliding pair fails.
        assert_eq!(failed, 40);
        let count = w
            .execute(true, |c| {
                c.query_row("SELECT COUNT(*) FROM t", [], |r| r.get::<_, i64>(0))
                    .map_err(super::super::sql_error)
            })
            .await
            .expect("count");
        assert_eq!(count, 360);
        assert!(w.commits() < 400, "{} commits for 401 jobs", w.commits());
    }

    /// A batch that inserts each of its items into `t` and counts its runs
    /// in `runs`; item 5 is refused without a write, item 99 fails the
    /// batch after a write.
    fn inserting() -> Arc<Batch<i64, i64>> {
        Batch::new(
            true,
            Box::new(|c, items| {
                c.execute("INSERT INTO runs DEFAULT VALUES", [])
                    .map_err(super::super::sql_error)?;
                let mut results = Vec::new();
                for x in items {
                    match x {
                        5 => results.push(Err(StoreError::Conflict("five".into()))),
                        99 => return Err(StoreError::Conflict("ninety-nine".into())),
                        x => results.push(insert(x)(c)),
                    }
                }
                Ok(results)
            }),
        )
    }

    /// Sends a job that holds the writer until the returned sender is used
    /// (or dropped), and returns once the writer runs it: what is sent
    /// after it waits for the next group.
    async fn gate(w: &Writer) -> std::sync::mpsc::Sender<()> {
        let (release, hold) = std::sync::mpsc::channel::<()>();
        let (entered, running) = oneshot::channel::<()>();
        let (reply, _answer) = oneshot::channel::<StoreResult<()>>();
        let job = Box::new(TypedJob {
            synced: false,
            work: Some(move |_: &Connection| {
                let _ = entered.send(());
                let _ = hold.recv();
                Ok(())
            }),
            result: None,
            reply,
        });
        assert!(w.jobs.send(job).await.is_ok(), "writer runs");
        running.await.expect("the writer runs the gate");
        release
    }

    /// Waits until `n` calls wait in `batch`.
    async fn queued<I, T>(batch: &Batch<I, T>, n: usize) {
        settled(|| batch.waiting().len() >= n, "calls queued").await;
    }

    /// Waits until `done`, failing after five seconds.
    async fn settled(done: impl Fn() -> bool, what: &str) {
        let waited = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            while !done() {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
        })
        .await;
        assert!(waited.is_ok(), "{what}: still waiting after 5 s");
    }

    /// Sends a plain job of `work` from a task of its own; the task's
    /// handle, once the job is in the channel (beside `queued` others).
    async fn sent_beside<T: Send + 'static>(
        w: &Arc<Writer>,
        queued: usize,
        work: impl FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    ) -> tokio::task::JoinHandle<StoreResult<T>> {
        let handle = {
            let w = Arc::clone(w);
            tokio::spawn(async move { w.execute(true, work).await })
        };
        settled(|| w.jobs.capacity() < CHANNEL_CAPACITY - queued, "job sent").await;
        handle
    }

    /// Calls of `batch` made from tasks of their own, in order.
    fn called(
        w: &Arc<Writer>,
        batch: &Arc<Batch<i64, i64>>,
        items: impl IntoIterator<Item = i64>,
    ) -> Vec<tokio::task::JoinHandle<StoreResult<i64>>> {
        items
            .into_iter()
            .map(|x| {
                let (w, batch) = (Arc::clone(w), Arc::clone(batch));
                tokio::spawn(async move { w.execute_batched(&batch, x).await })
            })
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_made_while_the_writer_is_busy_share_one_job_and_get_their_own_results() {
        let (w, _dir) = writer();
        w.execute(true, |c| {
            c.execute_batch("CREATE TABLE runs (n INTEGER PRIMARY KEY)")
                .map_err(super::super::sql_error)
        })
        .await
        .expect("table");
        let w = Arc::new(w);
        let batch = inserting();
        let release = gate(&w).await;
        let calls = called(&w, &batch, 0..10);
        queued(&batch, 10).await;
        release.send(()).expect("writer waits at the gate");
        for (x, call) in (0..10).zip(calls) {
            let result = call.await.expect("task");
            if x == 5 {
                assert!(matches!(result, Err(StoreError::Conflict(_))), "{result:?}");
            } else {
                assert_eq!(result, Ok(x));
            }
        }
        let counts = w
            .execute(true, |c| {
                c.query_row(
                    "SELECT (SELECT COUNT(*) FROM t), (SELECT COUNT(*) FROM runs)",
                    [],
                    |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)),
                )
                .map_err(super::super::sql_error)
            })
            .await;
        assert_eq!(
            counts,
            Ok((9, 1)),
            "nine rows written by one run of the batch"
        );

        // A batch failing after a write takes its whole group back: every
        // call of it fails, and so does the job beside it.
        taken_back_together(&w, &batch, &[20, 99, 21], insert(22)).await;
        // A batch that succeeded is taken back with its group when a job
        // after it fails part-way: its calls must not be answered `Ok`.
        taken_back_together(&w, &batch, &[30, 31], |c: &Connection| {
            insert(32)(c)?;
            insert(30)(c)
        })
        .await;
    }

    /// Calls of `batch` with `items` and a job of `beside` after them, in one
    /// group that fails: every call and the job are answered with an error,
    /// and `t` keeps the rows it had.
    async fn taken_back_together(
        w: &Arc<Writer>,
        batch: &Arc<Batch<i64, i64>>,
        items: &[i64],
        beside: impl FnOnce(&Connection) -> StoreResult<i64> + Send + 'static,
    ) {
        let rows = w.execute(true, |c| Ok(count(c))).await;
        let release = gate(w).await;
        let calls = called(w, batch, items.to_vec());
        queued(batch, items.len()).await;
        let beside = sent_beside(w, 1, beside).await;
        release.send(()).expect("writer waits at the gate");
        for call in calls {
            assert!(call.await.expect("task").is_err());
        }
        assert!(beside.await.expect("task").is_err());
        let after = w.execute(true, |c| Ok(count(c))).await;
        assert_eq!(after, rows, "nothing of that group stayed");
    }

    /// A synced job of `work` and the receiver of its answer.
    fn job<T: Send + 'static>(
        work: impl FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    ) -> (Box<dyn Job>, oneshot::Receiver<StoreResult<T>>) {
        job_of(true, work)
    }

    /// An unsynced job (a drain write) of `work` and the receiver of its answer.
    fn drain_job<T: Send + 'static>(
        work: impl FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    ) -> (Box<dyn Job>, oneshot::Receiver<StoreResult<T>>) {
        job_of(false, work)
    }

    fn job_of<T: Send + 'static>(
        synced: bool,
        work: impl FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    ) -> (Box<dyn Job>, oneshot::Receiver<StoreResult<T>>) {
        let (reply, answer) = oneshot::channel();
        let job = Box::new(TypedJob {
            synced,
            work: Some(work),
            result: None,
            reply,
        });
        (job, answer)
    }

    /// A new database holding the table `t` the jobs write.
    fn table() -> (Connection, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("temporary directory");
        let conn = Connection::open(dir.path().join("w.db")).expect("open");
        conn.execute_batch("CREATE TABLE t (x INTEGER UNIQUE)")
            .expect("schema");
        (conn, dir)
    }

    fn count(conn: &Connection) -> i64 {
        conn.query_row("SELECT COUNT(*) FROM t", [], |r| r.get(0))
            .expect("count")
    }

    /// Invariant 2 of the syncer: once a sync failed, a durable write is
    /// answered as refused and nothing of it is written, while drain writes
    /// go on.
    #[test]
    fn after_a_failed_sync_durable_writes_are_refused_unrun() {
        let (conn, _dir) = table();
        let sync = unsynced();
        sync.durability.fail();
        let (durable, mut durable_answer) = job(insert(1));
        let (drain, mut drain_answer) = drain_job(insert(2));
        assert_eq!(commit_group(&conn, vec![durable, drain], &sync), Ok(()));
        match durable_answer.try_recv().expect("answered") {
            Err(StoreError::Unavailable(e)) => assert!(e.contains("earlier fsync"), "{e}"),
            other => panic!("the durable write answered {other:?}"),
        }
        assert_eq!(drain_answer.try_recv().expect("answered"), Ok(2));
        assert_eq!(count(&conn), 1, "only the drain write");
    }

    #[test]
    fn a_job_failing_part_way_takes_its_group_back() {
        let (conn, _dir) = table();
        let (before, mut before_answer) = job(insert(1));
        // Writes a row, then fails: its row must not be committed.
        let (partial, mut partial_answer) = job(|c: &Connection| {
            insert(2)(c)?;
            insert(1)(c)
        });
        let (after, mut after_answer) = job(insert(3));
        assert!(commit_group(&conn, vec![before, partial, after], &unsynced()).is_err());
        assert_eq!(count(&conn), 0, "nothing of the group is applied");
        for answer in [&mut before_answer, &mut partial_answer, &mut after_answer] {
            assert!(answer.try_recv().expect("answered").is_err());
        }
        assert!(conn.is_autocommit(), "the transaction is closed");

        // A job failing before any write costs the others nothing.
        let (first, mut first_answer) = job(insert(1));
        let (collide, mut collide_answer) = job(insert(1));
        let (last, mut last_answer) = job(insert(3));
        assert!(commit_group(&conn, vec![first, collide, last], &unsynced()).is_ok());
        assert_eq!(count(&conn), 2);
        assert_eq!(first_answer.try_recv().expect("answered").ok(), Some(1));
        assert!(collide_answer.try_recv().expect("answered").is_err());
        assert_eq!(last_answer.try_recv().expect("answered").ok(), Some(3));
    }

    /// Once an append was found not to fit, a completion (unsynced) waiting
    /// beside another such append (synced) commits on its own — in one
    /// transaction, SQLite's rollback of the append would take it back too,
    /// so room would never come back — and the append fails as `Full`.
    #[test]
    fn a_full_store_does_not_take_drain_writes_back_with_an_append() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let conn = Connection::open(dir.path().join("w.db")).expect("open");
        conn.execute_batch(
            "PRAGMA journal_mode=WAL; CREATE TABLE t (x INTEGER UNIQUE, pad BLOB);
             PRAGMA max_page_count=16;",
        )
        .expect("schema");
        conn.execute("INSERT INTO t (x, pad) VALUES (1, zeroblob(20000))", [])
            .expect("room for one");
        // Larger than the whole store: it can never fit.
        let too_big = |x: i64| {
            job(move |c: &Connection| {
                c.execute("INSERT INTO t (x, pad) VALUES (?1, zeroblob(100000))", [x])
                    .map_err(super::super::sql_error)
            })
        };
        let (tx, rx) = mpsc::channel::<Box<dyn Job>>(4);
        let writer = std::thread::spawn(move || {
            run(conn, rx, unsynced(), Levels::new(None), &AtomicU64::new(0))
        });
        let (first, first_answer) = too_big(2);
        tx.blocking_send(first).map_err(|_| ()).expect("queued");
        let refused = first_answer.blocking_recv().expect("answered");
        assert!(matches!(refused, Err(StoreError::Full(_))), "{refused:?}");

        let (delete, deleted) = drain_job(|c: &Connection| {
            c.execute("DELETE FROM t WHERE x = 1", [])
                .map_err(super::super::sql_error)
        });
        let (append, appended) = too_big(3);
        // The append goes first: sent together, the delete still commits.
        tx.blocking_send(append).map_err(|_| ()).expect("queued");
        tx.blocking_send(delete).map_err(|_| ()).expect("queued");
        drop(tx);
        writer.join().expect("writer thread");
        assert_eq!(deleted.blocking_recv().expect("answered").ok(), Some(1));
        let refused = appended.blocking_recv().expect("answered");
        assert!(matches!(refused, Err(StoreError::Full(_))), "{refused:?}");
    }
}
