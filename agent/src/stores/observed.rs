//! Store health: a decorator around each opened store (outbox, lease, DLQ)
//! that watches every result, so that a full disk or an unreachable store is
//! visible without reading one log line per failed operation.
//!
//! For each store it keeps:
//! - `ferry_store_errors_total{bridge, store, kind}`: one per operation that
//!   failed because of the store ([`StoreError::is_store_failure`]: full,
//!   unavailable, timeout, corrupt). `stale` is not counted: it is the normal
//!   outcome of fencing (a lease handed over, a drainer stepping down), the
//!   store answered correctly, and counting it would page someone for a
//!   routine handover. `conflict`, `not_found` and `invalid` are answers
//!   about the request, not failures of the store, and are not counted either;
//! - `ferry_store_fenced_total{bridge, store, op}`: one per operation the
//!   store rejected as `stale` — the trace of a holder that went on under a
//!   lease version a newer holder had fenced out (a paused process resumed,
//!   a lease lost mid-cycle). Not an error, but what shows that the fence
//!   held;
//! - a readiness condition `store {name}`: not met while any operation kind
//!   is failing, with the last error as the reason
//!   (`store dlq: full: sqlite: database or disk is full` in `/readyz`);
//! - one log line per change of state: `store failing` (warn, with the error)
//!   when the first operation kind starts failing, `store recovered` (info,
//!   with how many operations failed meanwhile) when the last one succeeds
//!   again, and at most one `store still failing` reminder every
//!   [`REMINDER`] in between.
//!
//! Invariants: health is tracked per operation kind (`append`, `put`, ...),
//! because on a full disk deletes and reads still succeed while inserts fail:
//! a successful `complete` must not declare the store recovered while every
//! `append` fails. A store is healthy again only when every operation kind
//! that failed has succeeded since — except failures to reach the store
//! (`unavailable`, `timeout`), which any later answer ends: they say nothing
//! about the kind of operation, and a kind tried only during the outage (a
//! release) would otherwise keep the agent unready forever. The decorator never changes a result.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use super::{
    Acquired, BoxFuture, DlqEntry, DlqFilter, DlqPage, DlqStats, DlqStore, Lease, LeaseState,
    LeaseStore, NewMessage, OutboxRecord, OutboxStats, OutboxStore, PageRequest, Release,
    StoreError, StoreResult,
};
use crate::health::{Readiness, ReadinessCondition};
use crate::metrics::Metrics;

/// How often a store that keeps failing is logged again.
pub const REMINDER: Duration = Duration::from_secs(30);

/// Watches the results of one store; shared by its decorator.
#[derive(Debug)]
pub struct StoreObserver {
    bridge: String,
    store: &'static str,
    metrics: Arc<Metrics>,
    condition: ReadinessCondition,
    /// Fast path: false while every operation kind succeeds.
    failing: AtomicBool,
    state: Mutex<Failing>,
}

#[derive(Debug, Default)]
struct Failing {
    /// Operation kinds failing now, with their last error.
    ops: BTreeMap<&'static str, StoreError>,
    /// When the store started failing.
    since: Option<Instant>,
    /// Operations failed since then.
    failed: u64,
    /// When the last line about it was logged.
    logged: Option<Instant>,
}

impl StoreObserver {
    /// An observer for store `store` (`outbox`, `lease`, `dlq`) of `bridge`;
    /// registers its readiness condition, met until something fails.
    pub fn new(
        bridge: &str,
        store: &'static str,
        metrics: Arc<Metrics>,
        readiness: &Readiness,
    ) -> Arc<Self> {
        let condition = readiness.condition(format!("store {store}"));
        condition.set(true);
        Arc::new(StoreObserver {
            bridge: bridge.to_owned(),
            store,
            metrics,
            condition,
            failing: AtomicBool::new(false),
            state: Mutex::new(Failing::default()),
        })
    }

    /// Records the result of one `op`.
    pub fn record<T>(&self, op: &'static str, result: &StoreResult<T>) {
        match result {
            Err(error) if error.is_store_failure() => return self.failed(op, error),
            Err(StoreError::Stale(_)) => {
                self.metrics
                    .store_fenced(&self.bridge, self.store, op)
                    .inc();
            }
            _ => {}
        }
        // The store answered (a value, or stale / not found / ...).
        if self.failing.load(Ordering::Acquire) {
            self.succeeded(op);
        }
    }

    /// True while some operation kind is failing.
    pub fn is_failing(&self) -> bool {
        self.failing.load(Ordering::Acquire)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Failing> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn failed(&self, op: &'static str, error: &StoreError) {
        self.metrics
            .store_errors(&self.bridge, self.store, error.kind())
            .inc();
        let now = Instant::now();
        let mut state = self.lock();
        let first = state.ops.is_empty();
        state.ops.insert(op, error.clone());
        state.failed += 1;
        self.condition.fail(error.to_string());
        if first {
            self.failing.store(true, Ordering::Release);
            state.since = Some(now);
            state.logged = Some(now);
            tracing::warn!(
                bridge = %self.bridge,
                store = self.store,
                op,
                kind = error.kind(),
                %error,
                "store failing; the agent is not ready until it recovers"
            );
        } else if state
            .logged
            .is_none_or(|at| now.duration_since(at) >= REMINDER)
        {
            state.logged = Some(now);
            let failing_for = state.since.map(|s| now.duration_since(s));
            tracing::warn!(
                bridge = %self.bridge,
                store = self.store,
                op,
                kind = error.kind(),
                %error,
                failed = state.failed,
                ?failing_for,
                "store still failing"
            );
        }
    }

    fn succeeded(&self, op: &'static str) {
        let mut state = self.lock();
        let before = state.ops.len();
        state.ops.remove(op);
        // Any answer shows the store is reachable again: kinds that failed
        // only because it was not (unavailable, timeout) are over too, even
        // if they are not tried again soon (a release that failed during an
        // outage may never be repeated).
        state.ops.retain(|_, error| !error.is_unreachable());
        if state.ops.len() == before {
            return;
        }
        if let Some(error) = state.ops.values().next_back() {
            // Another operation kind still fails.
            self.condition.fail(error.to_string());
            return;
        }
        let failing_for = state.since.map(|s| s.elapsed());
        tracing::info!(
            bridge = %self.bridge,
            store = self.store,
            op,
            failed = state.failed,
            ?failing_for,
            "store recovered"
        );
        *state = Failing::default();
        self.failing.store(false, Ordering::Release);
        self.condition.set(true);
    }

    fn observe<'a, T: Send + 'a>(
        &'a self,
        op: &'static str,
        future: BoxFuture<'a, StoreResult<T>>,
    ) -> BoxFuture<'a, StoreResult<T>> {
        Box::pin(async move {
            let result = future.await;
            self.record(op, &result);
            result
        })
    }
}

/// `inner` with every result recorded by `observer`.
pub fn outbox(inner: Arc<dyn OutboxStore>, observer: Arc<StoreObserver>) -> Arc<dyn OutboxStore> {
    Arc::new(Observed { inner, observer })
}

/// `inner` with every result recorded by `observer`.
pub fn lease(inner: Arc<dyn LeaseStore>, observer: Arc<StoreObserver>) -> Arc<dyn LeaseStore> {
    Arc::new(Observed { inner, observer })
}

/// `inner` with every result recorded by `observer`.
pub fn dlq(inner: Arc<dyn DlqStore>, observer: Arc<StoreObserver>) -> Arc<dyn DlqStore> {
    Arc::new(Observed { inner, observer })
}

struct Observed<S: ?Sized> {
    inner: Arc<S>,
    observer: Arc<StoreObserver>,
}

impl OutboxStore for Observed<dyn OutboxStore> {
    fn append<'a>(
        &'a self,
        partition: &'a str,
        message: NewMessage,
    ) -> BoxFuture<'a, StoreResult<Vec<u64>>> {
        self.observer
            .observe("append", self.inner.append(partition, message))
    }

    fn claim<'a>(
        &'a self,
        partition: &'a str,
        owner: &'a str,
        version: u64,
        limit: usize,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Vec<OutboxRecord>>> {
        self.observer.observe(
            "claim",
            self.inner.claim(partition, owner, version, limit, now),
        )
    }

    fn complete<'a>(
        &'a self,
        partition: &'a str,
        version: u64,
        seqs: &'a [u64],
    ) -> BoxFuture<'a, StoreResult<Vec<u64>>> {
        self.observer
            .observe("complete", self.inner.complete(partition, version, seqs))
    }

    fn release<'a>(
        &'a self,
        partition: &'a str,
        version: u64,
        seqs: &'a [u64],
        release: Release,
    ) -> BoxFuture<'a, StoreResult<Vec<u64>>> {
        self.observer.observe(
            "release",
            self.inner.release(partition, version, seqs, release),
        )
    }

    fn expire<'a>(
        &'a self,
        partition: &'a str,
        owner: &'a str,
        version: u64,
        now: SystemTime,
        limit: usize,
    ) -> BoxFuture<'a, StoreResult<Vec<OutboxRecord>>> {
        self.observer.observe(
            "expire",
            self.inner.expire(partition, owner, version, now, limit),
        )
    }

    fn stats<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, StoreResult<OutboxStats>> {
        self.observer.observe("stats", self.inner.stats(partition))
    }
}

impl LeaseStore for Observed<dyn LeaseStore> {
    fn acquire<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        ttl: Duration,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Acquired>> {
        self.observer
            .observe("acquire", self.inner.acquire(key, holder, ttl, now))
    }

    fn renew<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
        ttl: Duration,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Lease>> {
        self.observer
            .observe("renew", self.inner.renew(key, holder, version, ttl, now))
    }

    fn release<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
    ) -> BoxFuture<'a, StoreResult<()>> {
        self.observer
            .observe("release", self.inner.release(key, holder, version))
    }

    fn list(&self) -> BoxFuture<'_, StoreResult<Vec<LeaseState>>> {
        self.observer.observe("list", self.inner.list())
    }
}

impl DlqStore for Observed<dyn DlqStore> {
    fn put(&self, entry: DlqEntry) -> BoxFuture<'_, StoreResult<bool>> {
        self.observer.observe("put", self.inner.put(entry))
    }

    fn list<'a>(
        &'a self,
        filter: &'a DlqFilter,
        page: PageRequest,
    ) -> BoxFuture<'a, StoreResult<DlqPage>> {
        self.observer.observe("list", self.inner.list(filter, page))
    }

    fn get<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<DlqEntry>> {
        self.observer.observe("get", self.inner.get(id))
    }

    fn delete<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<()>> {
        self.observer.observe("delete", self.inner.delete(id))
    }

    fn purge<'a>(&'a self, filter: &'a DlqFilter) -> BoxFuture<'a, StoreResult<u64>> {
        self.observer.observe("purge", self.inner.purge(filter))
    }

    fn stats<'a>(&'a self, filter: &'a DlqFilter) -> BoxFuture<'a, StoreResult<DlqStats>> {
        self.observer.observe("stats", self.inner.stats(filter))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full() -> StoreError {
        StoreError::Full("sqlite: database or disk is full".into())
    }

    #[test]
    fn any_answer_ends_a_failure_to_reach_the_store() {
        let metrics = Arc::new(Metrics::new());
        let readiness = Readiness::default();
        let observer = StoreObserver::new("b", "outbox", metrics, &readiness);
        let down = StoreError::Unavailable("postgres: connection refused".into());
        observer.record::<()>("append", &Err(down.clone()));
        observer.record::<()>("release", &Err(down));
        observer.record::<()>("append", &Err(full()));
        // The store answers again; the release is not tried again, and the
        // append still fails for want of room.
        observer.record("claim", &Ok(()));
        assert!(
            observer.is_failing(),
            "the full store still refuses appends"
        );
        observer.record("append", &Ok(()));
        assert!(!observer.is_failing());
        assert!(readiness.unmet().is_empty());
    }

    #[test]
    fn health_follows_each_operation_kind_and_counts_only_store_failures() {
        let metrics = Arc::new(Metrics::new());
        let readiness = Readiness::default();
        let observer = StoreObserver::new("b", "dlq", Arc::clone(&metrics), &readiness);
        assert!(readiness.unmet().is_empty());

        observer.record::<()>("put", &Err(full()));
        observer.record::<()>("put", &Err(full()));
        assert_eq!(
            readiness.unmet(),
            vec!["store dlq: full: sqlite: database or disk is full".to_owned()]
        );
        // Reads still work on a full disk: not a recovery of `put`.
        observer.record("list", &Ok(()));
        assert!(observer.is_failing());
        // Answers about the request are not failures and not counted.
        observer.record::<()>("get", &Err(StoreError::NotFound("x".into())));
        observer.record::<()>("put", &Err(StoreError::Stale("x".into())));
        assert!(!observer.is_failing(), "the store answered the put");
        assert!(readiness.unmet().is_empty());

        let text = metrics.encode().expect("encode");
        assert!(
            text.contains(r#"ferry_store_errors_total{bridge="b",store="dlq",kind="full"} 2"#),
            "{text}"
        );
        assert!(!text.contains(r#"kind="stale""#), "{text}");
        // A fencing rejection is counted apart, per operation.
        assert!(
            text.contains(r#"ferry_store_fenced_total{bridge="b",store="dlq",op="put"} 1"#),
            "{text}"
        );
        assert!(!text.contains(r#"kind="not_found""#), "{text}");
    }
}
