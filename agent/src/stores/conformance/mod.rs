//! Conformance suites: one per store trait, generic `async fn` tests over the
//! trait, and a macro that instantiates a whole suite for one backend in one
//! line (`outbox_conformance!(memory, make_memory_outbox)`). A new backend
//! passes when its one line passes.
//!
//! Backend-only helpers (reopen, dump) live in the [`Harness`] traits. Every
//! test reopens its store at least once: for durable backends that checks
//! that what was acknowledged survives closing; volatile backends reopen as
//! themselves.
//!
//! The agent's own backends are instantiated in `backends` (test-only). The
//! lease and DLQ suites are also exported behind the `conformance` feature,
//! for backends whose server lives in another crate: `ferry-tests` runs them
//! against an in-process control plane (`lease_conformance!`,
//! `dlq_conformance!`, both at the crate root).

use std::any::Any;
use std::time::{Duration, SystemTime};

use ferry_shared::envelope::{Envelope, Source};

use super::BoxFuture;
#[cfg(test)]
use super::{OutboxRecord, StoreResult};

#[cfg(test)]
mod backends;
pub mod dlq;
pub mod lease;
#[cfg(test)]
mod model;
#[cfg(test)]
pub(crate) mod outbox;
#[cfg(test)]
mod power_loss;
#[cfg(test)]
mod sigkill;

#[cfg(test)]
pub(crate) use backends::{
    dynamodb_outbox, dynamodb_table, memory_outbox, postgres_database, postgres_outbox,
    sqlite_options, sqlite_outbox_normal,
};

/// The `stale_claim_duration` every outbox under test is opened with.
#[cfg(test)]
pub(crate) const STALE: Duration = Duration::from_secs(30);

/// Keeps whatever a backend needs alive for a test (a temporary directory,
/// a server).
pub type Guard = Box<dyn Any + Send>;

/// What the suites need from a backend beyond its trait.
pub trait Harness: Sized + Send + Sync + 'static {
    /// True when the store keeps its data across `reopen`.
    const DURABLE: bool;
    /// Closes the store and opens it again on the same data (volatile
    /// backends return themselves).
    fn reopen(self) -> BoxFuture<'static, Self>;
}

/// Outbox backends also show every record of a partition, and how many
/// envelopes they keep for it.
#[cfg(test)]
pub(crate) trait OutboxHarness: Harness {
    fn dump<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, StoreResult<Vec<OutboxRecord>>>;
    /// Envelopes stored for `partition`: one per message with a record left.
    fn envelopes<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, StoreResult<usize>>;
    /// What breaks the backend's own invariants in `partition`, for a
    /// backend that can check its tables (none by default).
    fn broken_invariants<'a>(
        &'a self,
        _partition: &'a str,
    ) -> BoxFuture<'a, StoreResult<Vec<String>>> {
        Box::pin(async { Ok(Vec::new()) })
    }
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
    let source = Source::new("mqtt", "in", "sensors/1", t(0));
    Envelope::new(unique("msg"), name.as_bytes().to_vec(), source).with_headers(&[("k", name)])
}

/// Instantiates `$suite`'s tests (listed in `$suite`'s macro) for a
/// backend: `$make` is an `async fn() -> (S, Guard)` in the invoking module.
#[doc(hidden)]
#[macro_export]
macro_rules! __store_conformance {
    ($suite:ident, $backend:ident, $make:ident; $($test:ident),+ $(,)?) => {
        mod $backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    let (store, _guard) = super::$make().await;
                    $crate::stores::conformance::$suite::$test(store).await;
                }
            )+
        }
    };
}
