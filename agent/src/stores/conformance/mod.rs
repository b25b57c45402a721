//! Conformance suites: one per store trait, generic `async fn` tests over the
//! trait, and a macro that instantiates a whole suite for one backend in one
//! line (`outbox_conformance!(memory, make_memory_outbox)`). A new backend
//! passes when its one line passes.
//!
//! Backend-only helpers (reopen, dump) live in the test-only [`Harness`]
//! traits. Every test reopens its store at least once: for durable backends
//! that checks that what was acknowledged survives closing; volatile
//! backends reopen as themselves.

use std::any::Any;
use std::time::{Duration, SystemTime};

use ferry_shared::envelope::{Envelope, Source, TraceContext};
use prost::bytes::Bytes;

use super::memory::{MemoryDlqStore, MemoryLeaseStore, MemoryOutboxStore};
use super::sqlite::{
    SqliteDlqStore, SqliteLeaseStore, SqliteOptions, SqliteOutboxStore, Synchronous,
};
use super::{BoxFuture, OutboxRecord, StoreResult};

pub(crate) mod dlq;
pub(crate) mod lease;
mod model;
pub(crate) mod outbox;
mod sigkill;

/// The `stale_claim_duration` every outbox under test is opened with.
pub(crate) const STALE: Duration = Duration::from_secs(30);

/// Keeps whatever a backend needs alive for a test (a temporary directory).
pub(crate) type Guard = Box<dyn Any + Send>;

/// What the suites need from a backend beyond its trait.
pub(crate) trait Harness: Sized + Send + Sync + 'static {
    /// True when the store keeps its data across `reopen`.
    const DURABLE: bool;
    /// Closes the store and opens it again on the same data (volatile
    /// backends return themselves).
    fn reopen(self) -> BoxFuture<'static, Self>;
}

/// Outbox backends also show every record of a partition.
pub(crate) trait OutboxHarness: Harness {
    fn dump<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, StoreResult<Vec<OutboxRecord>>>;
}

/// A fixed point in time plus `secs`, so tests never read the clock.
pub(crate) fn t(secs: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000 + secs)
}

/// A random id, so suites can share a database.
pub(crate) fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::now_v7())
}

/// A small envelope whose payload names it.
pub(crate) fn envelope(name: &str) -> Envelope {
    Envelope {
        id: unique("msg"),
        headers: vec![("k".into(), name.into())],
        payload: Bytes::from(name.as_bytes().to_vec()),
        content_type: None,
        source: Source {
            transport: "mqtt".into(),
            session_id: "in".into(),
            address: "sensors/1".into(),
            received_at: t(0),
        },
        expires_at: None,
        trace: TraceContext::default(),
    }
}

pub(crate) fn sqlite_options(dir: &tempfile::TempDir, file: &str) -> SqliteOptions {
    SqliteOptions {
        stale_claim_duration: STALE,
        ..SqliteOptions::new(dir.path().join(file))
    }
}

fn temp_dir() -> tempfile::TempDir {
    tempfile::tempdir().expect("temporary directory")
}

// ---- backends under test -------------------------------------------------

impl Harness for MemoryOutboxStore {
    const DURABLE: bool = false;
    fn reopen(self) -> BoxFuture<'static, Self> {
        Box::pin(async move { self })
    }
}

impl OutboxHarness for MemoryOutboxStore {
    fn dump<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, StoreResult<Vec<OutboxRecord>>> {
        Box::pin(async move { MemoryOutboxStore::dump(self, partition) })
    }
}

impl Harness for SqliteOutboxStore {
    const DURABLE: bool = true;
    fn reopen(self) -> BoxFuture<'static, Self> {
        Box::pin(async move {
            let options = self.options().clone();
            self.close().await;
            SqliteOutboxStore::open(options)
                .await
                .expect("reopen outbox")
        })
    }
}

impl OutboxHarness for SqliteOutboxStore {
    fn dump<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, StoreResult<Vec<OutboxRecord>>> {
        Box::pin(SqliteOutboxStore::dump(self, partition))
    }
}

impl Harness for MemoryLeaseStore {
    const DURABLE: bool = false;
    fn reopen(self) -> BoxFuture<'static, Self> {
        Box::pin(async move { self })
    }
}

impl Harness for SqliteLeaseStore {
    const DURABLE: bool = true;
    fn reopen(self) -> BoxFuture<'static, Self> {
        Box::pin(async move {
            let options = self.options().clone();
            self.close().await;
            SqliteLeaseStore::open(options)
                .await
                .expect("reopen leases")
        })
    }
}

impl Harness for MemoryDlqStore {
    const DURABLE: bool = false;
    fn reopen(self) -> BoxFuture<'static, Self> {
        Box::pin(async move { self })
    }
}

impl Harness for SqliteDlqStore {
    const DURABLE: bool = true;
    fn reopen(self) -> BoxFuture<'static, Self> {
        Box::pin(async move {
            let options = self.options().clone();
            self.close().await;
            SqliteDlqStore::open(options).await.expect("reopen dlq")
        })
    }
}

pub(crate) async fn memory_outbox() -> (MemoryOutboxStore, Guard) {
    (MemoryOutboxStore::new(STALE), Box::new(()))
}

pub(crate) async fn sqlite_outbox() -> (SqliteOutboxStore, Guard) {
    let dir = temp_dir();
    let store = SqliteOutboxStore::open(sqlite_options(&dir, "outbox.db"))
        .await
        .expect("open outbox");
    (store, Box::new(dir))
}

/// The outbox on `synchronous=NORMAL`, for the many short-lived stores of
/// the property test (the durability tests use the default `FULL`).
pub(crate) async fn sqlite_outbox_normal() -> (SqliteOutboxStore, Guard) {
    let dir = temp_dir();
    let options = SqliteOptions {
        synchronous: Synchronous::Normal,
        ..sqlite_options(&dir, "outbox.db")
    };
    let store = SqliteOutboxStore::open(options).await.expect("open outbox");
    (store, Box::new(dir))
}

pub(crate) async fn memory_lease() -> (MemoryLeaseStore, Guard) {
    (MemoryLeaseStore::new(), Box::new(()))
}

pub(crate) async fn sqlite_lease() -> (SqliteLeaseStore, Guard) {
    let dir = temp_dir();
    let store = SqliteLeaseStore::open(sqlite_options(&dir, "lease.db"))
        .await
        .expect("open leases");
    (store, Box::new(dir))
}

pub(crate) async fn memory_dlq() -> (MemoryDlqStore, Guard) {
    (MemoryDlqStore::new(), Box::new(()))
}

pub(crate) async fn sqlite_dlq() -> (SqliteDlqStore, Guard) {
    let dir = temp_dir();
    let store = SqliteDlqStore::open(sqlite_options(&dir, "dlq.db"))
        .await
        .expect("open dlq");
    (store, Box::new(dir))
}

/// Instantiates `$suite`'s tests (listed in `$suite::tests!`) for a backend.
macro_rules! conformance {
    ($suite:ident, $backend:ident, $make:path; $($test:ident),+ $(,)?) => {
        mod $backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    let (store, _guard) = $make().await;
                    $crate::stores::conformance::$suite::$test(store).await;
                }
            )+
        }
    };
}
pub(crate) use conformance;

outbox::outbox_conformance!(memory_outbox, memory_outbox);
outbox::outbox_conformance!(sqlite_outbox, sqlite_outbox);
lease::lease_conformance!(memory_lease, memory_lease);
lease::lease_conformance!(sqlite_lease, sqlite_lease);
dlq::dlq_conformance!(memory_dlq, memory_dlq);
dlq::dlq_conformance!(sqlite_dlq, sqlite_dlq);
