//! The memory lease store: versions restart at 0 with the process.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use super::lock;
use crate::stores::lease::{self, LeaseState};
use crate::stores::{Acquired, BoxFuture, Lease, LeaseStore, StoreResult};

/// Leases kept in process memory.
#[derive(Debug, Default)]
pub struct MemoryLeaseStore {
    leases: Mutex<BTreeMap<String, LeaseState>>,
}

impl MemoryLeaseStore {
    /// An empty lease store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs one of the shared grant rules on `key`'s state and stores the
    /// state it returns.
    fn apply<T>(
        &self,
        key: &str,
        rule: impl FnOnce(Option<LeaseState>) -> StoreResult<(LeaseState, T)>,
    ) -> StoreResult<T> {
        let mut leases = lock(&self.leases)?;
        let (state, out) = rule(leases.get(key).cloned())?;
        leases.insert(key.to_owned(), state);
        Ok(out)
    }
}

impl LeaseStore for MemoryLeaseStore {
    fn acquire<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        ttl: Duration,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Acquired>> {
        Box::pin(async move { self.apply(key, |s| lease::acquire(s, key, holder, ttl, now)) })
    }

    fn renew<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
        ttl: Duration,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Lease>> {
        Box::pin(
            async move { self.apply(key, |s| lease::renew(s, key, holder, version, ttl, now)) },
        )
    }

    fn release<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
    ) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(async move {
            self.apply(key, |s| {
                lease::release(s, key, holder, version).map(|s| (s, ()))
            })
        })
    }

    fn list(&self) -> BoxFuture<'_, StoreResult<Vec<LeaseState>>> {
        Box::pin(async move { Ok(lock(&self.leases)?.values().cloned().collect()) })
    }
}
