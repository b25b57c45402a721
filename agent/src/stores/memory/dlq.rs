//! The memory DLQ: entries ordered by (dead-lettered time, id).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use super::lock;
use crate::stores::dlq::{page_of, stats_of};
use crate::stores::{
    BoxFuture, DlqEntry, DlqFilter, DlqPage, DlqStats, DlqStore, PageRequest, StoreError,
    StoreResult, unix_nanos,
};

/// Dead letters kept in process memory.
#[derive(Debug, Default)]
pub struct MemoryDlqStore {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Entries in listing order.
    entries: BTreeMap<(i64, String), DlqEntry>,
    /// Id → listing key.
    by_id: HashMap<String, (i64, String)>,
}

impl MemoryDlqStore {
    /// An empty DLQ.
    pub fn new() -> Self {
        Self::default()
    }

    fn put_now(&self, entry: DlqEntry) -> StoreResult<bool> {
        entry.validate()?;
        let key = (unix_nanos(entry.dead_lettered_at)?, entry.id.clone());
        let mut s = lock(&self.state)?;
        if s.by_id.contains_key(&entry.id) {
            return Ok(false);
        }
        s.by_id.insert(entry.id.clone(), key.clone());
        s.entries.insert(key, entry);
        Ok(true)
    }

    fn list_now(&self, filter: &DlqFilter, page: &PageRequest) -> StoreResult<DlqPage> {
        let s = lock(&self.state)?;
        page_of(s.entries.values(), filter, page)
    }

    fn get_now(&self, id: &str) -> StoreResult<DlqEntry> {
        let s = lock(&self.state)?;
        s.by_id
            .get(id)
            .and_then(|k| s.entries.get(k))
            .cloned()
            .ok_or_else(|| StoreError::NotFound(format!("dlq entry {id}")))
    }

    fn delete_now(&self, id: &str) -> StoreResult<()> {
        let mut s = lock(&self.state)?;
        let key = s
            .by_id
            .remove(id)
            .ok_or_else(|| StoreError::NotFound(format!("dlq entry {id}")))?;
        s.entries.remove(&key);
        Ok(())
    }

    fn purge_now(&self, filter: &DlqFilter) -> StoreResult<u64> {
        let mut s = lock(&self.state)?;
        let doomed: Vec<(i64, String)> = s
            .entries
            .iter()
            .filter(|(_, e)| e.matches(filter))
            .map(|(k, _)| k.clone())
            .collect();
        for key in &doomed {
            s.entries.remove(key);
            s.by_id.remove(&key.1);
        }
        Ok(doomed.len() as u64)
    }

    fn stats_now(&self, filter: &DlqFilter) -> StoreResult<DlqStats> {
        let s = lock(&self.state)?;
        Ok(stats_of(s.entries.values(), filter))
    }
}

impl DlqStore for MemoryDlqStore {
    fn put(&self, entry: DlqEntry) -> BoxFuture<'_, StoreResult<bool>> {
        Box::pin(async move { self.put_now(entry) })
    }

    fn list<'a>(
        &'a self,
        filter: &'a DlqFilter,
        page: PageRequest,
    ) -> BoxFuture<'a, StoreResult<DlqPage>> {
        Box::pin(async move { self.list_now(filter, &page) })
    }

    fn get<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<DlqEntry>> {
        Box::pin(async move { self.get_now(id) })
    }

    fn delete<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(async move { self.delete_now(id) })
    }

    fn purge<'a>(&'a self, filter: &'a DlqFilter) -> BoxFuture<'a, StoreResult<u64>> {
        Box::pin(async move { self.purge_now(filter) })
    }

    fn stats<'a>(&'a self, filter: &'a DlqFilter) -> BoxFuture<'a, StoreResult<DlqStats>> {
        Box::pin(async move { self.stats_now(filter) })
    }
}
