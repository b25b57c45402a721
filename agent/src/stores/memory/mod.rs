//! In-process backends: nothing survives the process. For development and
//! tests only (the configuration requires `acknowledge_volatile: true`), and
//! a memory lease never fences a durable outbox (its versions restart at 0).
//!
//! Each store keeps its state behind one `std::sync::Mutex`, locked only
//! inside a synchronous step and never across an `.await`.

mod dlq;
mod lease;
mod outbox;

pub use dlq::MemoryDlqStore;
pub use lease::MemoryLeaseStore;
pub use outbox::MemoryOutboxStore;

use std::sync::{Mutex, MutexGuard};

use super::{StoreError, StoreResult};

/// Locks `m`; a poisoned lock (a panic while it was held) may have left the
/// state half-changed, so it reports the store as unavailable instead.
fn lock<T>(m: &Mutex<T>) -> StoreResult<MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| StoreError::Unavailable("memory store poisoned by a panic".into()))
}
