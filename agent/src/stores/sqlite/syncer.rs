//! The syncer: a store's durable writes made durable off the writer thread.
//!
//! With `synchronous: full` a commit's answer must wait until its WAL frames
//! are on disk. Done by SQLite at `COMMIT` (`PRAGMA synchronous=FULL`), that
//! fsync blocked the writer thread: no claim, completion or other append
//! could commit until it returned, and on a disk whose fsync now and then
//! takes tens of milliseconds every route of the store stalled that long.
//! So the write connection commits with `NORMAL` (no sync at commit), and
//! this thread syncs the WAL file and answers the durable writes.
//!
//! # Invariants
//!
//! 1. A waiting write is answered `Ok` only by a sync that began after its
//!    commit returned. The writer hands a write over only once its
//!    `COMMIT` returned, and a sync covers exactly the writes taken before
//!    it began: the WAL is one append-only file, and an fsync makes durable
//!    everything written to the file before it was called. Writes handed
//!    over during a sync wait for the next one.
//! 2. Nothing is answered `Ok` after a sync failed. A failed fsync may have
//!    dropped dirty pages, and the WAL's frames are chained by checksum, so
//!    a lost frame takes every later commit with it at recovery: the
//!    writes of the failed sync, and those handed over during it, are
//!    answered `Unavailable`; they stay written (an outbox append among
//!    them is held back from claims, invariant 5, until the agent restarts,
//!    and its source, never acknowledged, delivers it again). From then on
//!    the writer refuses every durable write without running it
//!    ([`Durability::has_failed`]) until the agent restarts: run, it would
//!    be written though answered as failed, and its caller's retries would
//!    each store another copy.
//! 3. Frames may be overwritten only once durable elsewhere: SQLite restarts
//!    the WAL only after a checkpoint copied every frame into the database
//!    file and synced it (as it does at `NORMAL`), so a write whose frames a
//!    restart overwrote before its sync was durable already.
//! 4. Closing answers every write handed over (after a last sync) before the
//!    thread ends.
//! 5. The writer numbers its groups ([`Durability`]); a group is *durable*
//!    once a sync covered it, and the mark rises before that sync's writes
//!    are answered. Reads see a commit before it is durable, so what must
//!    not be acted on before its write is acknowledged (the outbox's fresh
//!    records: a claim never sees a record before its append returned) is
//!    held back until its group is durable.

use std::fs::File;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use crate::stores::{StoreError, StoreResult};

/// The writer's group numbers and how far they are durable (invariant 5).
#[derive(Debug)]
pub(crate) struct Durability {
    /// The number of the group the writer runs or last ran (from 1).
    group: AtomicU64,
    /// Every group up to this one is durable.
    durable: AtomicU64,
    /// A sync failed (invariant 2).
    failed: AtomicBool,
}

impl Durability {
    /// `synced_later` when a [`Syncer`] makes the groups durable; otherwise
    /// every group counts as durable as soon as it committed.
    pub(super) fn new(synced_later: bool) -> Arc<Self> {
        Arc::new(Durability {
            group: AtomicU64::new(0),
            durable: AtomicU64::new(if synced_later { 0 } else { u64::MAX }),
            failed: AtomicBool::new(false),
        })
    }

    /// Numbers the next group: called by the writer before it runs one.
    pub(super) fn begin_group(&self) -> u64 {
        self.group.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The group the writer is running: read by a job's work.
    pub(crate) fn group(&self) -> u64 {
        self.group.load(Ordering::Relaxed)
    }

    /// Whether group `n` is durable.
    pub(crate) fn is_durable(&self, n: u64) -> bool {
        n <= self.durable.load(Ordering::Acquire)
    }

    /// Whether a sync failed: durable writes are then refused (invariant 2).
    pub(super) fn has_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// A sync failed: set by the syncer.
    pub(super) fn fail(&self) {
        self.failed.store(true, Ordering::Release);
    }

    /// Every group up to `n` is durable: set by the syncer after a sync.
    pub(super) fn synced_to(&self, n: u64) {
        self.durable.fetch_max(n, Ordering::Release);
    }
}

/// What a failed sync means for every later durable write (invariant 2).
const AFTER: &str = "nothing written since is known to be durable; restart the agent";

/// The answer to a durable write refused after a sync failed (invariant 2).
pub(super) fn refused_after_failed_sync() -> StoreError {
    StoreError::Unavailable(format!("an earlier fsync of the WAL failed: {AFTER}"))
}

/// A committed write waiting to be durable.
pub(super) trait Waiting: Send {
    /// Answers the caller with the outcome of the write and its sync.
    fn answer(self: Box<Self>, outcome: &StoreResult<()>);
}

/// Makes a file's data durable: `fsync` of the WAL, or a stand-in in tests.
type SyncFn = Box<dyn FnMut() -> std::io::Result<()> + Send>;

/// Handle to the syncer thread.
pub(super) struct Syncer {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Default)]
struct State {
    /// Committed writes not yet taken by a sync.
    waiting: Vec<Box<dyn Waiting>>,
    /// The newest group they were committed in.
    newest: u64,
    closed: bool,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Syncer {
    /// Starts a syncer for the WAL file `wal` (opened, not created: SQLite
    /// created it with the store's schema).
    pub(super) fn for_wal(
        wal: &std::path::Path,
        name: &str,
        durability: Arc<Durability>,
    ) -> StoreResult<Self> {
        // Opened as SQLite opens it (a sync needs no more than any open
        // file, but tools that watch syncs read the file through it).
        let file = File::options()
            .read(true)
            .write(true)
            .open(wal)
            .map_err(|e| {
                StoreError::Unavailable(format!("cannot open {} to sync it: {e}", wal.display()))
            })?;
        Self::start(name, Box::new(move || file.sync_data()), durability)
    }

    fn start(name: &str, sync: SyncFn, durability: Arc<Durability>) -> StoreResult<Self> {
        let shared = Arc::new(Shared::default());
        let thread = std::thread::Builder::new()
            .name(format!("ferry-sync-{name}"))
            .spawn({
                let shared = Arc::clone(&shared);
                move || run(&shared, sync, &durability)
            })
            .map_err(|e| StoreError::Unavailable(format!("cannot start sync thread: {e}")))?;
        Ok(Syncer {
            shared,
            thread: Some(thread),
        })
    }

    /// Hands over writes whose `COMMIT` (of group `group`) returned
    /// (invariant 1).
    pub(super) fn committed(&self, group: u64, writes: impl IntoIterator<Item = Box<dyn Waiting>>) {
        let mut state = self.shared.state();
        let was_empty = state.waiting.is_empty();
        state.waiting.extend(writes);
        state.newest = state.newest.max(group);
        // The thread sleeps only on an empty list; a sync in progress takes
        // the rest when it is done.
        if was_empty && !state.waiting.is_empty() {
            self.shared.wake.notify_one();
        }
    }
}

impl Drop for Syncer {
    /// Answers every write handed over, then stops the thread (invariant 4).
    fn drop(&mut self) {
        self.shared.state().closed = true;
        self.shared.wake.notify_one();
        if let Some(thread) = self.thread.take() {
            // A panicked syncer dropped its writes' answers: their callers
            // were told the writer stopped.
            let _ = thread.join();
        }
    }
}

fn run(shared: &Shared, mut sync: SyncFn, durability: &Durability) {
    // Set by the first failed sync, for good (invariant 2).
    let mut failed: Option<StoreError> = None;
    loop {
        let taken = {
            let mut state = shared.state();
            while state.waiting.is_empty() && !state.closed {
                state = shared
                    .wake
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            if state.waiting.is_empty() {
                return;
            }
            (std::mem::take(&mut state.waiting), state.newest)
        };
        let (taken, newest) = taken;
        // Every write taken committed before this sync begins (invariant 1).
        let outcome = match &failed {
            Some(error) => Err(error.clone()),
            None => sync().map_err(|e| {
                let error =
                    StoreError::Unavailable(format!("fsync of the WAL failed ({e}): {AFTER}"));
                failed = Some(error.clone());
                durability.fail();
                error
            }),
        };
        if outcome.is_ok() {
            // Before the answers (invariant 5).
            durability.synced_to(newest);
        }
        for write in taken {
            write.answer(&outcome);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;

    use super::*;

    /// A write that reports its outcome on a channel.
    struct Reported(usize, mpsc::Sender<(usize, StoreResult<()>)>);

    impl Waiting for Reported {
        fn answer(self: Box<Self>, outcome: &StoreResult<()>) {
            let _ = self.1.send((self.0, outcome.clone()));
        }
    }

    fn write(n: usize, to: &mpsc::Sender<(usize, StoreResult<()>)>) -> Box<dyn Waiting> {
        Box::new(Reported(n, to.clone()))
    }

    const WAIT: std::time::Duration = std::time::Duration::from_secs(10);

    #[test]
    fn a_write_handed_over_during_a_sync_waits_for_the_next_one() {
        // Each sync tells it began, then waits to be let go.
        let (began_tx, began) = mpsc::channel();
        let (go, go_rx) = mpsc::channel::<()>();
        let go_rx = Mutex::new(go_rx);
        let syncs = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&syncs);
        let durability = Durability::new(true);
        let syncer = Syncer::start(
            "test",
            Box::new(move || {
                let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
                began_tx.send(n).expect("test listens");
                let go = go_rx.lock().expect("lock");
                go.recv_timeout(WAIT).expect("let go");
                Ok(())
            }),
            Arc::clone(&durability),
        )
        .expect("start");
        let (to, answers) = mpsc::channel();

        syncer.committed(1, [write(1, &to)]);
        assert_eq!(began.recv_timeout(WAIT), Ok(1));
        // Committed while the first sync runs: not covered by it.
        syncer.committed(2, [write(2, &to), write(3, &to)]);
        assert!(!durability.is_durable(1), "durable only once synced");
        go.send(()).expect("sync waits");
        assert_eq!(answers.recv_timeout(WAIT), Ok((1, Ok(()))));
        assert!(durability.is_durable(1), "durable before it is answered");
        assert_eq!(began.recv_timeout(WAIT), Ok(2), "a second sync for 2 and 3");
        assert!(answers.try_recv().is_err(), "2 and 3 wait for their sync");
        assert!(!durability.is_durable(2));
        go.send(()).expect("sync waits");
        assert_eq!(answers.recv_timeout(WAIT), Ok((2, Ok(()))));
        assert_eq!(answers.recv_timeout(WAIT), Ok((3, Ok(()))));
        assert!(durability.is_durable(2));
        drop(syncer);
        assert_eq!(
            syncs.load(Ordering::SeqCst),
            2,
            "one sync per group, no more"
        );
    }

    #[test]
    fn after_a_failed_sync_nothing_is_answered_ok() {
        let durability = Durability::new(true);
        let syncs = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&syncs);
        let syncer = Syncer::start(
            "test",
            Box::new(move || match counted.fetch_add(1, Ordering::SeqCst) {
                0 => Err(std::io::Error::other("EIO")),
                _ => Ok(()),
            }),
            Arc::clone(&durability),
        )
        .expect("start");
        let (to, answers) = mpsc::channel();
        for n in 0..3 {
            syncer.committed(n as u64 + 1, [write(n, &to)]);
            let (got, outcome) = answers.recv_timeout(WAIT).expect("answered");
            assert_eq!(got, n);
            // Set before the first answer: a retry must find it refused.
            assert!(durability.has_failed(), "the writer refuses durable writes");
            match outcome {
                Err(StoreError::Unavailable(message)) => {
                    assert!(message.contains("EIO"), "{message}");
                    assert!(message.contains("restart the agent"), "{message}");
                }
                other => panic!("write {n} answered {other:?}"),
            }
        }
        assert_eq!(syncs.load(Ordering::SeqCst), 1, "no sync is tried again");
        assert!(!durability.is_durable(1), "nothing became durable");
    }

    #[test]
    fn closing_answers_every_write_handed_over() {
        let syncer =
            Syncer::start("test", Box::new(|| Ok(())), Durability::new(true)).expect("start");
        let (to, answers) = mpsc::channel();
        syncer.committed(1, (0..100).map(|n| write(n, &to)));
        drop(syncer);
        drop(to);
        let got: Vec<_> = answers.iter().collect();
        assert_eq!(got.len(), 100);
        assert!(got.iter().all(|(_, outcome)| outcome.is_ok()));
    }

    #[test]
    fn without_a_syncer_every_group_is_durable_at_once() {
        let durability = Durability::new(false);
        let n = durability.begin_group();
        assert_eq!(durability.group(), n);
        assert!(durability.is_durable(n));
    }
}
