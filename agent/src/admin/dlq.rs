//! The agent's local DLQ store as a [`DlqBackend`], so the admin listener
//! serves the one `ferry.v1.DlqService` of [`ferry_shared::dlq::service`]
//! (the control plane serves the same) and `ferryctl` can administer a
//! standalone agent.
//!
//! Only the store is adapted here: a redrive puts the entry back on its
//! failed binding through [`Redrive`]; every check and rule is the service's.

use std::sync::Arc;

use ferry_shared::api::v1 as pb;
use ferry_shared::api::v1::dlq_service_server::DlqServiceServer;
use ferry_shared::dlq::backend::{DlqBackend, DlqBackendError, DlqPage, RedriveError};
use ferry_shared::dlq::service::DlqServer;
use ferry_shared::dlq::{DlqFilter, DlqStat};

use crate::routes::Redrive;
use crate::stores::{DlqEntry, DlqStore, PageRequest, StoreError};

/// The local DLQ store and the routes running here.
pub struct LocalDlq {
    store: Arc<dyn DlqStore>,
    redrive: Arc<Redrive>,
}

impl LocalDlq {
    /// The `DlqService` server over `store`.
    pub fn server(store: Arc<dyn DlqStore>, redrive: Arc<Redrive>) -> DlqServiceServer<DlqServer> {
        DlqServer::server(Arc::new(Self { store, redrive }))
    }
}

/// A store error as the service sees it.
fn backend_error(e: StoreError) -> DlqBackendError {
    match e {
        StoreError::NotFound(m) => DlqBackendError::NotFound(m),
        StoreError::Invalid(m) => DlqBackendError::Invalid(m),
        StoreError::Stale(m) | StoreError::Conflict(m) => DlqBackendError::Conflict(m),
        StoreError::Corrupt(m) => DlqBackendError::Corrupt(m),
        StoreError::Full(m) => DlqBackendError::Full(m),
        StoreError::Unavailable(m) => DlqBackendError::Unavailable(m),
        StoreError::Timeout(m) => DlqBackendError::Timeout(m),
    }
}

#[tonic::async_trait]
impl DlqBackend for LocalDlq {
    async fn write(&self, entry: pb::DlqEntry) -> Result<bool, DlqBackendError> {
        let entry = DlqEntry::try_from(entry).map_err(backend_error)?;
        self.store.put(entry).await.map_err(backend_error)
    }

    async fn list(
        &self,
        filter: &DlqFilter,
        size: u32,
        token: Option<String>,
    ) -> Result<DlqPage, DlqBackendError> {
        let page = PageRequest {
            size: size as usize,
            token,
        };
        let page = self.store.list(filter, page).await.map_err(backend_error)?;
        Ok(DlqPage {
            entries: page.entries.iter().map(pb::DlqEntry::from).collect(),
            next_page_token: page.next_page_token,
        })
    }

    async fn get(&self, id: &str) -> Result<pb::DlqEntry, DlqBackendError> {
        let entry = self.store.get(id).await.map_err(backend_error)?;
        Ok(pb::DlqEntry::from(&entry))
    }

    async fn delete(&self, id: &str) -> Result<(), DlqBackendError> {
        self.store.delete(id).await.map_err(backend_error)
    }

    async fn purge(&self, filter: &DlqFilter) -> Result<u64, DlqBackendError> {
        self.store.purge(filter).await.map_err(backend_error)
    }

    async fn stats(&self, filter: &DlqFilter) -> Result<Vec<DlqStat>, DlqBackendError> {
        Ok(self.store.stats(filter).await.map_err(backend_error)?.rows)
    }

    async fn redrive(&self, entry: &pb::DlqEntry) -> Result<(), RedriveError> {
        let entry =
            DlqEntry::try_from(entry.clone()).map_err(|e| RedriveError::Failed(e.to_string()))?;
        self.redrive
            .redrive(&entry)
            .await
            .map_err(RedriveError::Failed)
    }
}
