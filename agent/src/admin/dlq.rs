//! The local `ferry.v1.DlqService`: the agent's own DLQ store, served on the
//! admin listener so `ferryctl` can administer a standalone agent.
//!
//! List, get, delete, purge (with `confirm`) and stats act on the store
//! directly. Redrive puts each entry back on its failed binding through
//! [`Redrive`] and deletes the entry only after that is durable; an entry whose
//! redrive failed stays. `WriteDlqEntry` writes into the local store too
//! (idempotent by id), so tools can seed or move entries.

use std::sync::Arc;

use ferry_shared::api::v1 as pb;
use ferry_shared::api::v1::dlq_service_server::{DlqService, DlqServiceServer};
use ferry_shared::dlq::{DlqRequestError, check_purge_confirmed, check_written_entry};
use tonic::{Request, Response, Status};

use crate::routes::Redrive;
use crate::stores::{DlqEntry, DlqFilter, DlqStore, PageRequest, StoreError};

/// Most entries one redrive call handles when it names no limit.
const DEFAULT_REDRIVE_LIMIT: usize = 1000;

/// The service over one DLQ store.
pub struct LocalDlqService {
    store: Arc<dyn DlqStore>,
    redrive: Arc<Redrive>,
}

impl LocalDlqService {
    /// A tonic server for `store`.
    pub fn server(store: Arc<dyn DlqStore>, redrive: Arc<Redrive>) -> DlqServiceServer<Self> {
        DlqServiceServer::new(Self { store, redrive })
    }
}

/// The one mapping of store errors to gRPC status codes.
fn status(e: StoreError) -> Status {
    match e {
        StoreError::NotFound(m) => Status::not_found(m),
        StoreError::Invalid(m) => Status::invalid_argument(m),
        StoreError::Stale(m) | StoreError::Conflict(m) => Status::failed_precondition(m),
        StoreError::Corrupt(m) => Status::data_loss(m),
        StoreError::Full(m) => Status::resource_exhausted(m),
        StoreError::Unavailable(m) => Status::unavailable(m),
        StoreError::Timeout(m) => Status::deadline_exceeded(m),
    }
}

/// A refused request field.
fn invalid(e: DlqRequestError) -> Status {
    Status::invalid_argument(e.to_string())
}

fn filter(f: Option<pb::DlqFilter>) -> Result<DlqFilter, Status> {
    DlqFilter::from_proto(f).map_err(invalid)
}

#[tonic::async_trait]
impl DlqService for LocalDlqService {
    async fn write_dlq_entry(
        &self,
        request: Request<pb::WriteDlqEntryRequest>,
    ) -> Result<Response<pb::WriteDlqEntryResponse>, Status> {
        let written = check_written_entry(request.into_inner().entry).map_err(invalid)?;
        let entry = pb::DlqEntry {
            envelope: Some(written.envelope),
            ..written.entry
        };
        let entry = DlqEntry::try_from(entry).map_err(status)?;
        let created = self.store.put(entry).await.map_err(status)?;
        Ok(Response::new(pb::WriteDlqEntryResponse { created }))
    }

    async fn list_dlq_entries(
        &self,
        request: Request<pb::ListDlqEntriesRequest>,
    ) -> Result<Response<pb::ListDlqEntriesResponse>, Status> {
        let r = request.into_inner();
        let f = filter(r.filter)?;
        let page = PageRequest {
            size: r.page_size as usize,
            token: (!r.page_token.is_empty()).then_some(r.page_token),
        };
        let page = self.store.list(&f, page).await.map_err(status)?;
        let entries = page
            .entries
            .iter()
            .map(|e| {
                let mut m = pb::DlqEntry::from(e);
                if r.omit_payload
                    && let Some(env) = m.envelope.as_mut()
                {
                    env.payload.clear();
                }
                m
            })
            .collect();
        Ok(Response::new(pb::ListDlqEntriesResponse {
            entries,
            next_page_token: page.next_page_token.unwrap_or_default(),
        }))
    }

    async fn get_dlq_entry(
        &self,
        request: Request<pb::GetDlqEntryRequest>,
    ) -> Result<Response<pb::GetDlqEntryResponse>, Status> {
        let entry = self
            .store
            .get(&request.into_inner().id)
            .await
            .map_err(status)?;
        Ok(Response::new(pb::GetDlqEntryResponse {
            entry: Some(pb::DlqEntry::from(&entry)),
        }))
    }

    async fn redrive_dlq_entries(
        &self,
        request: Request<pb::RedriveDlqEntriesRequest>,
    ) -> Result<Response<pb::RedriveDlqEntriesResponse>, Status> {
        let r = request.into_inner();
        let limit = match r.limit {
            0 => DEFAULT_REDRIVE_LIMIT,
            n => n as usize,
        };
        let mut entries = Vec::new();
        let truncated;
        if r.ids.is_empty() {
            let f = filter(r.filter)?;
            let page = self
                .store
                .list(
                    &f,
                    PageRequest {
                        size: limit,
                        token: None,
                    },
                )
                .await
                .map_err(status)?;
            truncated = page.next_page_token.is_some();
            entries.extend(page.entries.into_iter().map(Ok));
        } else {
            truncated = r.ids.len() > limit;
            for id in r.ids.into_iter().take(limit) {
                entries.push(self.store.get(&id).await.map_err(|e| (id, e)));
            }
        }
        let mut outcomes = Vec::with_capacity(entries.len());
        for entry in entries {
            let outcome = match entry {
                Err((id, e)) => pb::RedriveOutcome {
                    id,
                    ok: false,
                    error: e.to_string(),
                },
                Ok(entry) => {
                    let result =
                        match self.redrive.redrive(&entry).await {
                            Ok(()) => self.store.delete(&entry.id).await.map_err(|e| {
                                format!("redriven, but deleting the entry failed: {e}")
                            }),
                            Err(e) => Err(e),
                        };
                    tracing::info!(id = %entry.id, ok = result.is_ok(), "dlq redrive");
                    pb::RedriveOutcome {
                        id: entry.id,
                        ok: result.is_ok(),
                        error: result.err().unwrap_or_default(),
                    }
                }
            };
            outcomes.push(outcome);
        }
        Ok(Response::new(pb::RedriveDlqEntriesResponse {
            outcomes,
            truncated,
        }))
    }

    async fn delete_dlq_entry(
        &self,
        request: Request<pb::DeleteDlqEntryRequest>,
    ) -> Result<Response<pb::DeleteDlqEntryResponse>, Status> {
        self.store
            .delete(&request.into_inner().id)
            .await
            .map_err(status)?;
        Ok(Response::new(pb::DeleteDlqEntryResponse {}))
    }

    async fn purge_dlq_entries(
        &self,
        request: Request<pb::PurgeDlqEntriesRequest>,
    ) -> Result<Response<pb::PurgeDlqEntriesResponse>, Status> {
        let r = request.into_inner();
        check_purge_confirmed(r.confirm).map_err(invalid)?;
        let f = filter(r.filter)?;
        let purged = self.store.purge(&f).await.map_err(status)?;
        Ok(Response::new(pb::PurgeDlqEntriesResponse { purged }))
    }

    async fn get_dlq_stats(
        &self,
        request: Request<pb::GetDlqStatsRequest>,
    ) -> Result<Response<pb::GetDlqStatsResponse>, Status> {
        let f = filter(request.into_inner().filter)?;
        let stats = self.store.stats(&f).await.map_err(status)?;
        Ok(Response::new(pb::GetDlqStatsResponse {
            stats: stats.rows.into_iter().map(pb::DlqStat::from).collect(),
            total: stats.total,
        }))
    }
}
