//! Drain cycles against memory stores and a scripted sender.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use ferry_shared::config::{DrainPoll, FailureAction};
use ferry_shared::envelope::{Envelope, Source};
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::Drainer;
use super::cycle::Report;
use crate::health::Readiness;
use crate::metrics::Metrics;
use crate::routes::shared_outbox::OutboxDepth;
use crate::routes::{RouteBinding, RouteIdentity};
use crate::stores::memory::{MemoryDlqStore, MemoryLeaseStore, MemoryOutboxStore};
use crate::stores::{
    DlqFilter, DlqReason, DlqStore, NewMessage, NewRecord, OutboxRecord, OutboxStats, OutboxStore,
    PageRequest, Release, StoreError, StoreResult,
};
use crate::transports::{Address, SendError, SendFuture, Sender};
use futures::future::BoxFuture;

const P: &str = "b/r";

/// Accepts every send, except that from the `fail_from`-th send on (1-based) it answers
/// `error`. Records the payloads per address in send order.
struct Scripted {
    sent: Mutex<Vec<(String, String)>>,
    fail_from: Option<(usize, SendError)>,
    connected: watch::Receiver<bool>,
}

impl Sender for Scripted {
    fn send<'a>(&'a self, envelope: &'a Envelope, address: &'a Address) -> SendFuture<'a> {
        let mut sent = self.sent.lock().expect("lock");
        sent.push((
            address.to_string(),
            String::from_utf8_lossy(&envelope.payload).into_owned(),
        ));
        let n = sent.len();
        let result = match &self.fail_from {
            Some((from, error)) if n >= *from => Err(error.clone()),
            _ => Ok(()),
        };
        Box::pin(async move { result })
    }

    fn connected(&self) -> watch::Receiver<bool> {
        self.connected.clone()
    }
}

fn envelope(payload: &str, expires_at: Option<SystemTime>) -> Envelope {
    let source = Source::new("mqtt", "s", "in", SystemTime::now());
    Envelope {
        expires_at,
        ..Envelope::new(
            uuid::Uuid::now_v7().to_string(),
            payload.as_bytes().to_vec(),
            source,
        )
    }
}

/// The memory outbox with injected faults on `complete`: the next
/// `fail_completes` fail before anything is applied, the next
/// `lose_answers` are applied and then fail (a commit whose answer was lost
/// in a store outage); with `hold`, a
/// completion is applied at once but its answer waits for `release` (a
/// commit whose reply is still on its way, as with SQLite's writer thread);
/// with `fail_held`, the next completion waits for `release` and then fails
/// without applying anything. The claim numbered `hold_claim` (1-based;
/// 0: none) waits for `claim_release` before it is applied. The next
/// `fail_releases` releases fail before anything is applied. `expiries`
/// counts the expiry sweeps.
#[derive(Default)]
struct Faults {
    fail_completes: AtomicUsize,
    lose_answers: AtomicUsize,
    fail_releases: AtomicUsize,
    expiries: AtomicUsize,
    hold: AtomicBool,
    fail_held: AtomicBool,
    entered: Notify,
    release: Notify,
    hold_claim: AtomicUsize,
    claims: AtomicUsize,
    claim_entered: Notify,
    claim_release: Notify,
}

struct Faulty {
    inner: Arc<MemoryOutboxStore>,
    faults: Arc<Faults>,
}

impl OutboxStore for Faulty {
    fn append<'a>(
        &'a self,
        partition: &'a str,
        message: NewMessage,
    ) -> BoxFuture<'a, StoreResult<Vec<u64>>> {
        self.inner.append(partition, message)
    }

    fn claim<'a>(
        &'a self,
        partition: &'a str,
        owner: &'a str,
        version: u64,
        limit: usize,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Vec<OutboxRecord>>> {
        Box::pin(async move {
            let f = &self.faults;
            if f.claims.fetch_add(1, Ordering::SeqCst) + 1 == f.hold_claim.load(Ordering::SeqCst) {
                f.claim_entered.notify_one();
                f.claim_release.notified().await;
            }
            self.inner
                .claim(partition, owner, version, limit, now)
                .await
        })
    }

    fn complete<'a>(
        &'a self,
        partition: &'a str,
        version: u64,
        seqs: &'a [u64],
    ) -> BoxFuture<'a, StoreResult<Vec<u64>>> {
        Box::pin(async move {
            let f = &self.faults;
            let injected = || Err(StoreError::Unavailable("injected".into()));
            if take_one(&f.fail_completes) {
                return injected();
            }
            if f.fail_held.swap(false, Ordering::SeqCst) {
                f.entered.notify_one();
                f.release.notified().await;
                return injected();
            }
            let done = self.inner.complete(partition, version, seqs).await;
            if take_one(&f.lose_answers) {
                return injected();
            }
            if f.hold.load(Ordering::SeqCst) {
                f.entered.notify_one();
                f.release.notified().await;
            }
            done
        })
    }

    fn release<'a>(
        &'a self,
        partition: &'a str,
        version: u64,
        seqs: &'a [u64],
        release: Release,
    ) -> BoxFuture<'a, StoreResult<Vec<u64>>> {
        if take_one(&self.faults.fail_releases) {
            return Box::pin(async { Err(StoreError::Unavailable("injected".into())) });
        }
        self.inner.release(partition, version, seqs, release)
    }

    fn expire<'a>(
        &'a self,
        partition: &'a str,
        owner: &'a str,
        version: u64,
        now: SystemTime,
        limit: usize,
    ) -> BoxFuture<'a, StoreResult<Vec<OutboxRecord>>> {
        self.faults.expiries.fetch_add(1, Ordering::SeqCst);
        self.inner.expire(partition, owner, version, now, limit)
    }

    fn stats<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, StoreResult<OutboxStats>> {
        self.inner.stats(partition)
    }
}

/// Takes one from a fault's count; false when it is spent.
fn take_one(count: &AtomicUsize) -> bool {
    count
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

struct Fixture {
    drainer: Arc<Drainer>,
    outbox: Arc<MemoryOutboxStore>,
    faults: Arc<Faults>,
    dlq: Arc<MemoryDlqStore>,
    sender: Arc<Scripted>,
    _connected: watch::Sender<bool>,
}

/// The replay limits most tests use (`max_replay_attempts`, `replay_budget`):
/// 5 attempts, a budget no test runs out of.
const REPLAY: (u32, Duration) = (5, Duration::from_secs(900));

fn fixture(
    fail_from: Option<(usize, SendError)>,
    connected: bool,
    replay: (u32, Duration),
) -> Fixture {
    batched(fail_from, connected, replay, 100)
}

/// A fixture whose drainer claims `batch` records at a time. With fewer
/// records left than a batch, a cycle writes its outcomes as soon as a
/// batch's worth came back, while it still claims: not at its end, where
/// it would leave them to the next cycle (invariant 9 of the drainer).
fn batched(
    fail_from: Option<(usize, SendError)>,
    connected: bool,
    replay: (u32, Duration),
    batch: usize,
) -> Fixture {
    let metrics = Metrics::new();
    let (tx, rx) = watch::channel(connected);
    let sender = Arc::new(Scripted {
        sent: Mutex::default(),
        fail_from,
        connected: rx.clone(),
    });
    let outbox = Arc::new(MemoryOutboxStore::new(Duration::from_secs(300)));
    let faults = Arc::new(Faults::default());
    let dlq = Arc::new(MemoryDlqStore::new());
    let bindings: HashMap<String, RouteBinding> = ["x", "y"]
        .iter()
        .map(|b| {
            (
                (*b).to_owned(),
                RouteBinding {
                    id: (*b).to_owned(),
                    address: format!("out/{b}"),
                    metrics: metrics.binding("b", "r", b),
                },
            )
        })
        .collect();
    let drainer = Drainer {
        identity: RouteIdentity {
            bridge_id: "b".into(),
            route_id: "r".into(),
            agent_id: "a".into(),
        },
        partition: P.into(),
        holder: "a".into(),
        owner: "a/1".into(),
        bindings,
        outbox: Arc::new(Faulty {
            inner: Arc::clone(&outbox),
            faults: Arc::clone(&faults),
        }) as Arc<dyn OutboxStore>,
        leases: Arc::new(MemoryLeaseStore::new()),
        dlq: Some(Arc::clone(&dlq) as Arc<dyn DlqStore>),
        sender: Arc::clone(&sender) as Arc<dyn Sender>,
        connected: rx,
        wake: Arc::new(Notify::new()),
        depth: Arc::new(OutboxDepth::default()),
        batch,
        poll: DrainPoll::Fixed(ferry_shared::config::Duration::from_millis(100)),
        lease_ttl: Duration::from_secs(15),
        renew_interval: Duration::from_secs(5),
        grace: Duration::from_secs(1),
        on_expired: FailureAction::Dlq,
        on_permanent_failure: FailureAction::Dlq,
        max_replay_attempts: replay.0,
        replay_budget: replay.1,
        route_metrics: metrics.route("b", "r"),
        lease_resolved: Readiness::default().condition("lease"),
        state: Default::default(),
    };
    // The tests run cycles directly, without a lease keeper: a grant that lasts.
    drainer.set_held_until(Some(SystemTime::now() + Duration::from_secs(3600)));
    Fixture {
        drainer: Arc::new(drainer),
        outbox,
        faults,
        dlq,
        sender,
        _connected: tx,
    }
}

async fn append(f: &Fixture, binding: &str, payloads: std::ops::Range<u32>) {
    for i in payloads {
        put(f, binding, envelope(&i.to_string(), None)).await;
    }
}

/// Appends `envelope` as a message for `binding` alone.
async fn put(f: &Fixture, binding: &str, envelope: Envelope) {
    let record = NewRecord::new(binding, format!("out/{binding}"));
    let message = NewMessage::new(envelope, SystemTime::now(), vec![record]);
    f.outbox.append(P, message).await.expect("append");
}

/// One cycle under version 1 and the write of what it left (see
/// [`Drainer::cycle_and_flush`]).
async fn try_cycle(f: &Fixture) -> StoreResult<Report> {
    f.drainer
        .cycle_and_flush(1, &CancellationToken::new())
        .await
}

async fn cycle(f: &Fixture) -> usize {
    try_cycle(f).await.expect("cycle").claimed
}

#[tokio::test]
async fn bindings_keep_record_order_and_completed_records_are_gone() {
    let f = fixture(None, true, REPLAY);
    append(&f, "x", 0..3).await;
    append(&f, "y", 0..2).await;
    append(&f, "x", 3..5).await;
    cycle(&f).await;
    let sent = f.sender.sent.lock().expect("lock").clone();
    let of = |a: &str| -> Vec<String> {
        sent.iter()
            .filter(|(addr, _)| addr == a)
            .map(|(_, p)| p.clone())
            .collect()
    };
    assert_eq!(of("out/x"), ["0", "1", "2", "3", "4"]);
    assert_eq!(of("out/y"), ["0", "1"]);
    assert_eq!(f.outbox.stats(P).await.expect("stats").total.depth, 0);
}

/// A process resumed from a pause runs its cycle before its lease keeper notices that the
/// grant expired: the cycle claims nothing and sends nothing (a new holder may have taken the
/// records back and sent them), and the records stay pending.
#[tokio::test]
async fn a_cycle_past_the_grant_expiry_claims_and_sends_nothing() {
    let f = fixture(None, true, REPLAY);
    append(&f, "x", 0..3).await;
    f.drainer
        .set_held_until(Some(SystemTime::now() - Duration::from_secs(1)));
    assert_eq!(cycle(&f).await, 0);
    assert!(f.sender.sent.lock().expect("lock").is_empty());
    let left = f.outbox.dump(P).expect("dump");
    assert_eq!(left.len(), 3);
    assert!(left.iter().all(|r| r.claim.is_none()), "nothing claimed");
}

#[tokio::test]
async fn a_failure_counts_the_tried_records_and_releases_the_rest_untried() {
    let f = fixture(
        Some((2, SendError::Transient("connection lost".into()))),
        true,
        REPLAY,
    );
    append(&f, "x", 0..40).await;
    cycle(&f).await;
    let left = f.outbox.dump(P).expect("dump");
    assert_eq!(
        left.len(),
        39,
        "the first record was accepted and completed"
    );
    assert!(left.iter().all(|r| r.claim.is_none()), "all released");
    let counted = left.iter().filter(|r| r.replay_count == 1).count();
    // Records 2..=33 were in flight (window of 32 refilled once); 34..=40 never started.
    assert_eq!(counted, super::SEND_WINDOW);
    assert!(left[..counted].iter().all(|r| r.replay_count == 1));
    assert!(
        left[counted..]
            .iter()
            .all(|r| r.replay_count == 0 && r.last_error.is_none())
    );
}

#[tokio::test]
async fn a_permanent_error_dead_letters_the_record_under_its_id() {
    let f = fixture(
        Some((1, SendError::Permanent("too large".into()))),
        true,
        REPLAY,
    );
    append(&f, "x", 0..1).await;
    let id = f.outbox.dump(P).expect("dump")[0].id.clone();
    cycle(&f).await;
    let entry = f.dlq.get(&id).await.expect("dlq entry");
    assert_eq!(entry.reason, DlqReason::PermanentError);
    assert!(entry.last_error.contains("too large"));
    assert!(f.outbox.dump(P).expect("dump").is_empty());
}

#[tokio::test]
async fn replays_beyond_count_and_budget_are_dead_lettered_without_a_send() {
    let f = fixture(
        Some((1, SendError::Transient("down".into()))),
        true,
        (0, Duration::ZERO),
    );
    append(&f, "x", 0..1).await;
    cycle(&f).await;
    assert_eq!(f.outbox.dump(P).expect("dump")[0].replay_count, 1);
    cycle(&f).await;
    assert_eq!(
        f.sender.sent.lock().expect("lock").len(),
        1,
        "no second send"
    );
    let page = f
        .dlq
        .list(&DlqFilter::default(), PageRequest::default())
        .await
        .expect("list");
    assert_eq!(page.entries[0].reason, DlqReason::ReplayExhausted);
    assert!(f.outbox.dump(P).expect("dump").is_empty());
}

#[tokio::test]
async fn expiry_runs_while_disconnected_and_nothing_is_sent() {
    let f = fixture(None, false, REPLAY);
    let past = SystemTime::now() - Duration::from_secs(1);
    put(&f, "x", envelope("old", Some(past))).await;
    put(&f, "y", envelope("new", None)).await;
    cycle(&f).await;
    assert!(f.sender.sent.lock().expect("lock").is_empty());
    let page = f
        .dlq
        .list(&DlqFilter::default(), PageRequest::default())
        .await
        .expect("list");
    assert_eq!(page.entries.len(), 1);
    assert_eq!(page.entries[0].reason, DlqReason::Expired);
    let left = f.outbox.dump(P).expect("dump");
    assert_eq!(left.len(), 1);
    assert_eq!(&*left[0].binding, "y");
    assert!(left[0].claim.is_none(), "the live record stays pending");
    let x = &f.drainer.bindings["x"].metrics.counts();
    assert_eq!(x.expired, 1);
}

#[tokio::test]
async fn cycles_in_quick_succession_sweep_for_expired_records_once() {
    let f = fixture(None, true, REPLAY);
    for i in 0..3 {
        append(&f, "x", i..i + 1).await;
        cycle(&f).await;
    }
    assert_eq!(f.faults.expiries.load(Ordering::SeqCst), 1);
    assert_eq!(f.sender.sent.lock().expect("lock").len(), 3);
}

#[tokio::test]
async fn pipelined_batches_keep_order_and_complete_everything() {
    let mut f = fixture(None, true, REPLAY);
    Arc::get_mut(&mut f.drainer).expect("not shared yet").batch = 4;
    append(&f, "x", 0..5).await;
    append(&f, "y", 0..3).await;
    append(&f, "x", 5..10).await;
    assert_eq!(cycle(&f).await, 13, "one cycle drains every batch");
    assert_eq!(cycle(&f).await, 0);
    let sent = f.sender.sent.lock().expect("lock").clone();
    let of = |a: &str| -> Vec<String> {
        sent.iter()
            .filter(|(addr, _)| addr == a)
            .map(|(_, p)| p.clone())
            .collect()
    };
    let x: Vec<String> = (0..10).map(|i| i.to_string()).collect();
    assert_eq!(of("out/x"), x, "each record once, in order");
    assert_eq!(of("out/y"), ["0", "1", "2"]);
    assert_eq!(f.outbox.stats(P).await.expect("stats").total.depth, 0);
}

#[tokio::test]
async fn a_failure_releases_the_batch_claimed_ahead_untried() {
    let mut f = fixture(
        Some((2, SendError::Transient("connection lost".into()))),
        true,
        REPLAY,
    );
    Arc::get_mut(&mut f.drainer).expect("not shared yet").batch = 4;
    append(&f, "x", 0..12).await;
    assert_eq!(cycle(&f).await, 8, "the next batch was claimed ahead");
    let sent = f.sender.sent.lock().expect("lock").len();
    assert_eq!(sent, 4, "only the first batch was sent");
    let left = f.outbox.dump(P).expect("dump");
    assert_eq!(left.len(), 11, "the first record was completed");
    assert!(left.iter().all(|r| r.claim.is_none()), "all released");
    assert!(left[..3].iter().all(|r| r.replay_count == 1));
    assert!(
        left[3..].iter().all(|r| r.replay_count == 0),
        "the batch claimed ahead went back untried"
    );
}

/// A fixture with batches of 4 and, in order, the bindings' records: seqs
/// 1..=12 for x, 13..=16 for `fourth` (the fourth batch), 17..=20 for x.
async fn four_batches_and_one(fourth: &str) -> Fixture {
    let mut f = fixture(None, true, REPLAY);
    Arc::get_mut(&mut f.drainer).expect("not shared yet").batch = 4;
    append(&f, "x", 0..12).await;
    append(&f, fourth, 12..16).await;
    append(&f, "x", 16..20).await;
    f
}

/// Waits, with a deadline, for `point` to be reached.
async fn reached(point: &Notify) {
    tokio::time::timeout(Duration::from_secs(5), point.notified())
        .await
        .expect("the fault point is reached");
}

fn spawn_cycle(f: &Fixture, stop: &CancellationToken) -> JoinHandle<StoreResult<Report>> {
    let (d, stop) = (Arc::clone(&f.drainer), stop.clone());
    tokio::spawn(async move { d.cycle_and_flush(1, &stop).await })
}

async fn finished(run: JoinHandle<StoreResult<Report>>) -> StoreResult<Report> {
    tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .expect("the cycle ends")
        .expect("the cycle task")
}

fn sent(f: &Fixture) -> Vec<(String, String)> {
    f.sender.sent.lock().expect("lock").clone()
}

/// How many records are claimed.
fn claimed(f: &Fixture) -> usize {
    left(f).iter().filter(|(_, claimed, _)| *claimed).count()
}

/// The records left in the outbox: (seq, claimed, replay count).
fn left(f: &Fixture) -> Vec<(u64, bool, u32)> {
    let dump = f.outbox.dump(P).expect("dump");
    dump.iter()
        .map(|r| (r.seq, r.claim.is_some(), r.replay_count))
        .collect()
}

#[tokio::test]
async fn a_batch_claimed_beside_a_write_is_sent_only_once_that_write_is_answered() {
    // The claim that a write makes room for goes to the store with it, but
    // its records start only once the write succeeded: never more than
    // three batches sent and unsettled (the crash window, invariant 2).
    let f = four_batches_and_one("x").await;
    f.faults.hold.store(true, Ordering::SeqCst);
    let run = spawn_cycle(&f, &CancellationToken::new());
    reached(&f.faults.entered).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        sent(&f).len(),
        12,
        "three batches sent while the first one's write is unanswered"
    );
    let claimed = claimed(&f);
    assert_eq!(claimed, 12, "the fourth batch was claimed beside the write");
    f.faults.hold.store(false, Ordering::SeqCst);
    f.faults.release.notify_one();
    assert_eq!(finished(run).await.expect("cycle").claimed, 20);
    let payloads: Vec<String> = sent(&f).into_iter().map(|(_, p)| p).collect();
    let all: Vec<String> = (0..20).map(|i| i.to_string()).collect();
    assert_eq!(payloads, all, "each record once, in order");
    assert_eq!(f.outbox.stats(P).await.expect("stats").total.depth, 0);
}

#[tokio::test]
async fn a_claim_answered_after_the_write_it_waited_for_is_sent_at_once() {
    // The fourth claim goes out beside the first write and is answered only
    // after that write (and while the next one is unanswered): it waits for
    // nothing more.
    let f = four_batches_and_one("x").await;
    f.faults.hold.store(true, Ordering::SeqCst);
    f.faults.hold_claim.store(4, Ordering::SeqCst);
    let run = spawn_cycle(&f, &CancellationToken::new());
    reached(&f.faults.entered).await;
    reached(&f.faults.claim_entered).await;
    f.faults.release.notify_one();
    // The second write: the outcomes of batches 2 and 3.
    reached(&f.faults.entered).await;
    f.faults.claim_release.notify_one();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        sent(&f).len(),
        16,
        "the fourth batch went out while the second write is unanswered"
    );
    f.faults.hold.store(false, Ordering::SeqCst);
    f.faults.release.notify_one();
    assert_eq!(finished(run).await.expect("cycle").claimed, 20);
    assert_eq!(sent(&f).len(), 20);
    assert_eq!(f.outbox.stats(P).await.expect("stats").total.depth, 0);
}

#[tokio::test]
async fn a_batch_claimed_beside_a_failed_write_goes_back_untried() {
    // The fourth batch is binding y's first: no lane is opened for it.
    let f = four_batches_and_one("y").await;
    f.faults.fail_held.store(true, Ordering::SeqCst);
    let run = spawn_cycle(&f, &CancellationToken::new());
    reached(&f.faults.entered).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let claimed = claimed(&f);
    assert_eq!(claimed, 16, "the fourth batch was claimed beside the write");
    f.faults.release.notify_one();
    let first = finished(run).await;
    assert!(
        first.is_err(),
        "the failed write fails the cycle: {first:?}"
    );
    assert_eq!(sent(&f).len(), 12, "nothing of the fourth batch was sent");
    // The first batch's outcome is kept for the next cycle (still claimed
    // under its version); the two after it were written; the fourth went
    // back untried.
    let expected: Vec<(u64, bool, u32)> = (1..=4)
        .map(|seq| (seq, true, 0))
        .chain((13..=20).map(|seq| (seq, false, 0)))
        .collect();
    assert_eq!(left(&f), expected);
    assert_eq!(cycle(&f).await, 8, "the next cycle sends the rest");
    assert_eq!(sent(&f).len(), 20, "nothing twice");
    assert_eq!(f.outbox.stats(P).await.expect("stats").total.depth, 0);
}

#[tokio::test]
async fn a_stop_while_a_batch_is_held_sends_none_of_it() {
    let f = four_batches_and_one("x").await;
    f.faults.hold.store(true, Ordering::SeqCst);
    let stop = CancellationToken::new();
    let run = spawn_cycle(&f, &stop);
    reached(&f.faults.entered).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    stop.cancel();
    tokio::time::sleep(Duration::from_millis(20)).await;
    f.faults.hold.store(false, Ordering::SeqCst);
    f.faults.release.notify_one();
    assert_eq!(finished(run).await.expect("cycle").claimed, 16);
    assert_eq!(sent(&f).len(), 12);
    let expected: Vec<(u64, bool, u32)> = (13..=20).map(|seq| (seq, false, 0)).collect();
    assert_eq!(left(&f), expected, "the held batch went back untried");
}

#[tokio::test]
async fn a_claim_answered_after_the_cycle_stopped_sends_nothing() {
    let f = fixture(None, true, REPLAY);
    append(&f, "x", 0..3).await;
    f.faults.hold_claim.store(1, Ordering::SeqCst);
    let stop = CancellationToken::new();
    let run = spawn_cycle(&f, &stop);
    reached(&f.faults.claim_entered).await;
    stop.cancel();
    tokio::time::sleep(Duration::from_millis(20)).await;
    f.faults.claim_release.notify_one();
    assert_eq!(finished(run).await.expect("cycle").claimed, 3);
    assert!(sent(&f).is_empty(), "nothing sent");
    assert_eq!(
        left(&f),
        [(1, false, 0), (2, false, 0), (3, false, 0)],
        "all went back untried"
    );
}

#[tokio::test]
async fn expired_records_past_the_sweep_are_disposed_of_not_claimed_forever() {
    let mut f = fixture(None, true, REPLAY);
    // The sweep takes one batch; the claims meet the other expired records.
    Arc::get_mut(&mut f.drainer).expect("not shared yet").batch = 2;
    let past = SystemTime::now() - Duration::from_secs(1);
    for i in 0..5 {
        put(&f, "x", envelope(&format!("old{i}"), Some(past))).await;
    }
    put(&f, "x", envelope("live", None)).await;
    tokio::time::timeout(Duration::from_secs(5), cycle(&f))
        .await
        .expect("the cycle ends");
    let sent = f.sender.sent.lock().expect("lock").clone();
    assert_eq!(sent, [("out/x".to_owned(), "live".to_owned())]);
    assert!(f.outbox.dump(P).expect("dump").is_empty());
    assert_eq!(f.drainer.bindings["x"].metrics.counts().expired, 5);
}

#[tokio::test]
async fn a_stopped_cycle_claims_nothing() {
    let f = fixture(None, true, REPLAY);
    append(&f, "x", 0..3).await;
    let stop = CancellationToken::new();
    stop.cancel();
    let report = f.drainer.cycle_and_flush(1, &stop).await.expect("cycle");
    assert_eq!(report.claimed, 0);
    assert!(f.sender.sent.lock().expect("lock").is_empty());
    let left = f.outbox.dump(P).expect("dump");
    assert!(
        left.iter().all(|r| r.claim.is_none()),
        "nothing left claimed"
    );
}

/// Waits, with a deadline, until binding `b` has counted `n` sent.
async fn sent_reaches(f: &Fixture, b: &str, n: u64) {
    let metrics = f.drainer.bindings[b].metrics.clone();
    tokio::time::timeout(Duration::from_secs(5), async {
        while metrics.counts().sent < n {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{b}: sent stayed at {}", metrics.counts().sent));
}

#[tokio::test]
async fn a_completion_is_counted_even_when_its_cycle_is_dropped() {
    // A lease loss drops the cycle while its completion is committed but not
    // yet answered: the records are gone from the outbox, so they must be
    // counted `sent` all the same (issue 12, 5a). A batch of five: the
    // cycle writes them while it claims again, not at its end.
    let f = batched(None, true, REPLAY, 5);
    append(&f, "x", 0..5).await;
    f.faults.hold.store(true, Ordering::SeqCst);
    let d = Arc::clone(&f.drainer);
    let dropped = tokio::spawn(async move { d.cycle(1, &CancellationToken::new()).await });
    f.faults.entered.notified().await;
    dropped.abort();
    assert!(dropped.await.is_err_and(|e| e.is_cancelled()));
    f.faults.release.notify_one();
    sent_reaches(&f, "x", 5).await;
    assert_eq!(f.outbox.stats(P).await.expect("stats").total.depth, 0);
    // Exactly once: nothing is left to count again.
    assert_eq!(cycle(&f).await, 0);
    assert_eq!(f.drainer.bindings["x"].metrics.counts().sent, 5);
}

#[tokio::test]
async fn a_failed_completion_is_written_again_by_the_next_cycle_and_counted_once() {
    let f = fixture(None, true, REPLAY);
    append(&f, "x", 0..5).await;
    f.faults.fail_completes.store(1, Ordering::SeqCst);
    let first = try_cycle(&f).await;
    assert!(first.is_err(), "{first:?}");
    assert_eq!(f.drainer.bindings["x"].metrics.counts().sent, 0);
    // Still claimed (not stale for 300 s): the next cycle writes the outcome
    // it kept instead of waiting for the claims to go stale.
    assert_eq!(cycle(&f).await, 0);
    assert_eq!(f.drainer.bindings["x"].metrics.counts().sent, 5);
    assert_eq!(f.outbox.stats(P).await.expect("stats").total.depth, 0);
    assert_eq!(
        f.sender.sent.lock().expect("lock").len(),
        5,
        "nothing sent twice"
    );
}

#[tokio::test]
async fn a_completion_whose_answer_was_lost_is_counted_when_written_again() {
    // The store deleted the records but its answer was lost (a cut
    // connection after COMMIT): the retry under the same version deletes
    // nothing, and finds them gone because that first attempt deleted them.
    let f = fixture(None, true, REPLAY);
    append(&f, "x", 0..5).await;
    f.faults.lose_answers.store(1, Ordering::SeqCst);
    assert!(try_cycle(&f).await.is_err());
    assert_eq!(f.outbox.stats(P).await.expect("stats").total.depth, 0);
    assert_eq!(f.drainer.bindings["x"].metrics.counts().sent, 0);
    assert_eq!(cycle(&f).await, 0);
    assert_eq!(f.drainer.bindings["x"].metrics.counts().sent, 5);
    assert_eq!(f.sender.sent.lock().expect("lock").len(), 5);
}

#[tokio::test]
async fn records_counted_after_a_lost_answer_are_not_counted_again_with_the_releases() {
    // Two accepted, the other three fail (all in flight at once). The
    // completion's answer is lost; its retry succeeds but the release after
    // it fails, so it is kept: the next retry writes only the release.
    let f = fixture(
        Some((3, SendError::Transient("connection lost".into()))),
        true,
        REPLAY,
    );
    append(&f, "x", 0..5).await;
    f.faults.lose_answers.store(1, Ordering::SeqCst);
    assert!(try_cycle(&f).await.is_err());
    f.faults.fail_releases.store(1, Ordering::SeqCst);
    assert!(try_cycle(&f).await.is_err());
    assert_eq!(f.drainer.bindings["x"].metrics.counts().sent, 2);
    let _ = try_cycle(&f).await;
    let counts = f.drainer.bindings["x"].metrics.counts();
    assert_eq!(counts.sent, 2, "{counts:?}");
    assert_eq!(f.outbox.dump(P).expect("dump").len(), 3);
}

#[tokio::test]
async fn a_dead_letter_whose_completion_failed_is_counted_once() {
    let f = fixture(
        Some((1, SendError::Permanent("rejected".into()))),
        true,
        REPLAY,
    );
    append(&f, "x", 0..1).await;
    f.faults.fail_completes.store(1, Ordering::SeqCst);
    assert!(try_cycle(&f).await.is_err());
    // The DLQ entry is written, but not counted until the record is completed.
    assert_eq!(f.drainer.bindings["x"].metrics.counts().dead_lettered, 0);
    cycle(&f).await;
    let counts = f.drainer.bindings["x"].metrics.counts();
    assert_eq!((counts.dead_lettered, counts.sent), (1, 0), "{counts:?}");
    let stats = f.dlq.stats(&DlqFilter::default()).await.expect("dlq stats");
    assert_eq!(stats.total, 1);
    assert_eq!(f.outbox.stats(P).await.expect("stats").total.depth, 0);
}

/// The store's depth and binding `x`'s `sent` count.
async fn depth_and_sent(f: &Fixture) -> (u64, u64) {
    let depth = f.outbox.stats(P).await.expect("stats").total.depth;
    (depth, f.drainer.bindings["x"].metrics.counts().sent)
}

#[tokio::test]
async fn a_drained_cycle_leaves_its_accepted_records_to_the_next_cycle() {
    let f = fixture(None, true, REPLAY);
    let defer = |f: &Fixture| {
        let d = Arc::clone(&f.drainer);
        async move { d.cycle(1, &CancellationToken::new()).await }
    };
    append(&f, "x", 0..3).await;
    defer(&f).await.expect("cycle");
    assert_eq!(f.sender.sent.lock().expect("lock").len(), 3);
    assert_eq!(depth_and_sent(&f).await, (3, 0), "delivered, not completed");
    append(&f, "x", 3..5).await;
    defer(&f).await.expect("cycle");
    assert_eq!(f.sender.sent.lock().expect("lock").len(), 5);
    assert_eq!(
        depth_and_sent(&f).await,
        (2, 3),
        "the first three completed"
    );
    f.drainer.flush_deferred(1).await.expect("flush");
    assert_eq!(depth_and_sent(&f).await, (0, 5));
    assert!(!f.drainer.has_deferred());
}

#[tokio::test]
async fn records_left_under_an_older_version_are_sent_again_not_completed() {
    let f = fixture(None, true, REPLAY);
    append(&f, "x", 0..3).await;
    f.drainer
        .cycle(1, &CancellationToken::new())
        .await
        .expect("cycle");
    // A newer grant voids the claims of version 1: the records are pending
    // again and go out once more under version 2.
    f.drainer
        .cycle_and_flush(2, &CancellationToken::new())
        .await
        .expect("cycle");
    assert_eq!(f.sender.sent.lock().expect("lock").len(), 6);
    assert_eq!(depth_and_sent(&f).await, (0, 3));
}

#[tokio::test]
async fn records_left_when_the_lease_is_lost_are_completed_unless_a_newer_holder_took_them() {
    let f = fixture(None, true, REPLAY);
    append(&f, "x", 0..3).await;
    f.drainer
        .cycle(1, &CancellationToken::new())
        .await
        .expect("cycle");
    // Nobody took them: the write under the lost version goes through.
    f.drainer.write_deferred_on_loss(1);
    sent_reaches(&f, "x", 3).await;
    assert_eq!(depth_and_sent(&f).await, (0, 3));

    // A newer holder claimed them first: the write is fenced out.
    append(&f, "x", 3..5).await;
    f.drainer
        .cycle(1, &CancellationToken::new())
        .await
        .expect("cycle");
    let taken = f.outbox.claim(P, "other", 2, 10, SystemTime::now()).await;
    assert_eq!(taken.expect("claim").len(), 2);
    f.drainer.write_deferred_on_loss(1);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(depth_and_sent(&f).await, (2, 3));
}

#[tokio::test]
async fn a_cycle_with_a_failed_send_writes_everything_before_it_ends() {
    let f = fixture(
        Some((2, SendError::Transient("connection lost".into()))),
        true,
        REPLAY,
    );
    append(&f, "x", 0..3).await;
    f.drainer
        .cycle(1, &CancellationToken::new())
        .await
        .expect("cycle");
    assert!(!f.drainer.has_deferred());
    assert_eq!(depth_and_sent(&f).await, (2, 1));
}

#[tokio::test]
async fn the_records_the_last_cycle_left_are_completed_at_shutdown_or_soon_after() {
    let f = fixture(None, true, REPLAY);
    append(&f, "x", 0..5).await;
    let Ok(drainer) = Arc::try_unwrap(f.drainer) else {
        panic!("the fixture's drainer has one owner")
    };
    let metrics = drainer.bindings["x"].metrics.clone();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(drainer.run(shutdown.clone()));
    tokio::time::timeout(Duration::from_secs(5), async {
        while f.sender.sent.lock().expect("lock").len() < 5 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("delivered");
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .expect("the drainer stops within its grace period")
        .expect("the drainer task");
    assert_eq!(f.outbox.stats(P).await.expect("stats").total.depth, 0);
    assert_eq!(metrics.counts().sent, 5);
}

#[tokio::test]
async fn shutdown_during_a_cycle_lets_it_finish_and_releases_the_lease() {
    // The lease keeper ends first at shutdown; the drain loop must not take
    // that for a lease loss (it would claim again under the same version
    // until aborted, and the lease would never be released). Which of the
    // two sees the shutdown first varies (`join!` rotates): try a few times.
    for _ in 0..10 {
        // A batch of five: the cycle writes them while it claims again.
        let f = batched(None, true, REPLAY, 5);
        append(&f, "x", 0..5).await;
        f.faults.hold.store(true, Ordering::SeqCst);
        let Ok(drainer) = Arc::try_unwrap(f.drainer) else {
            panic!("the fixture's drainer has one owner")
        };
        let leases = Arc::clone(&drainer.leases);
        let shutdown = CancellationToken::new();
        let run = tokio::spawn(drainer.run(shutdown.clone()));
        f.faults.entered.notified().await;
        shutdown.cancel();
        // The drainer sees the shutdown while its completion is still held.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        f.faults.release.notify_one();
        tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .expect("the drainer stops within its grace period")
            .expect("the drainer task");
        assert_eq!(f.outbox.stats(P).await.expect("stats").total.depth, 0);
        let other = leases
            .acquire(P, "other", Duration::from_secs(15), SystemTime::now())
            .await
            .expect("acquire");
        assert!(
            matches!(other, crate::stores::Acquired::Granted(_)),
            "released: {other:?}"
        );
    }
}
