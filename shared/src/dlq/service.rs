//! The one `ferry.v1.DlqService`: served by the control plane over its state
//! store and by an agent on its admin listener over its local DLQ store, each
//! through a [`DlqBackend`]. Every check and decision is made here, once:
//!
//! - requests are checked before the backend is called: ids must not be
//!   empty, filters must parse, a purge needs `confirm`, a written entry
//!   needs its required fields (and an unset `dead_lettered_at` is now);
//! - page sizes and redrive limits follow [`page_size`]: 0 means
//!   [`DEFAULT_PAGE_SIZE`](super::DEFAULT_PAGE_SIZE), above
//!   [`MAX_PAGE_SIZE`](super::MAX_PAGE_SIZE) is lowered to it;
//! - a redrive selects by `ids`, or else by `filter`, and an empty filter is
//!   refused: redriving the whole DLQ must be asked for by a filter (a purge
//!   of everything says so with `confirm`);
//! - a redriven entry is deleted only after its redelivery is durable; an
//!   entry that failed (unknown, refused, unroutable, timed out) is kept and
//!   its error reported in its outcome; when no entry could be routed at all
//!   the call fails with `FAILED_PRECONDITION`;
//! - backend errors become statuses in [`backend::status`];
//! - redrive, delete and purge each write one audit event
//!   ([`crate::audit`]) naming the caller, what was selected and the
//!   outcome, also when refused.
//!
//! Authorization: the role table of [`crate::auth::policy`] is checked by
//! the authentication layer before a call reaches this service; what depends
//! on the entry (an agent writes only for its own bridges) is asked of the
//! backend ([`DlqBackend::authorize_write`]) before a write.

use std::sync::Arc;
use std::time::SystemTime;

use tonic::{Request, Response, Status};

use super::backend::{self, DlqBackend, DlqBackendError, RedriveError};
use super::{DlqFilter, DlqRequestError, check_purge_confirmed, check_written_entry, page_size};
use crate::api::v1 as pb;
use crate::api::v1::dlq_service_server::{DlqService, DlqServiceServer};
use crate::audit::{self, Action, Outcome};
use crate::auth::Caller;

/// The service over one backend.
pub struct DlqServer {
    backend: Arc<dyn DlqBackend>,
}

impl DlqServer {
    /// The service over `backend`.
    pub fn new(backend: Arc<dyn DlqBackend>) -> Self {
        Self { backend }
    }

    /// A tonic server of the service over `backend`.
    pub fn server(backend: Arc<dyn DlqBackend>) -> DlqServiceServer<Self> {
        DlqServiceServer::new(Self::new(backend))
    }

    /// Redrives one fetched entry and deletes it once redelivered.
    async fn redrive_one(&self, entry: &pb::DlqEntry) -> Result<(), RedriveError> {
        self.backend.redrive(entry).await?;
        match self.backend.delete(&entry.id).await {
            // Deleted meanwhile by somebody else: the redelivery stands.
            Ok(()) | Err(DlqBackendError::NotFound(_)) => Ok(()),
            Err(e) => Err(RedriveError::Failed(format!(
                "redelivered, but the entry could not be deleted (it may be redriven twice): {e}"
            ))),
        }
    }

    /// Redrives what the request selects; see the module documentation.
    async fn redrive(
        &self,
        r: pb::RedriveDlqEntriesRequest,
    ) -> Result<pb::RedriveDlqEntriesResponse, Status> {
        let Selection { entries, truncated } = self.select(r).await?;
        let mut outcomes = Vec::with_capacity(entries.len());
        let (mut routed, mut unroutable) = (0usize, None);
        for (id, entry) in entries {
            let result = match entry {
                Err(e) => Err(e.to_string()),
                Ok(entry) => match self.redrive_one(&entry).await {
                    Err(RedriveError::Unroutable(e)) => {
                        unroutable.get_or_insert_with(|| e.clone());
                        Err(e)
                    }
                    other => {
                        routed += 1;
                        other.map_err(|e| e.to_string())
                    }
                },
            };
            outcomes.push(pb::RedriveOutcome {
                id,
                ok: result.is_ok(),
                error: result.err().unwrap_or_default(),
            });
        }
        if let Some(first) = unroutable
            && routed == 0
        {
            return Err(Status::failed_precondition(format!(
                "nothing redriven: {first}"
            )));
        }
        Ok(pb::RedriveDlqEntriesResponse {
            outcomes,
            truncated,
        })
    }

    /// Purges what a confirmed request's filter selects; how many.
    async fn purge(&self, r: pb::PurgeDlqEntriesRequest) -> Result<u64, Status> {
        check_purge_confirmed(r.confirm).map_err(invalid)?;
        let f = filter(r.filter)?;
        self.backend.purge(&f).await.map_err(backend::status)
    }

    /// The entries a redrive selects: by `ids`, or else by a non-empty
    /// filter; at most `limit` of them.
    async fn select(&self, r: pb::RedriveDlqEntriesRequest) -> Result<Selection, Status> {
        let limit = page_size(r.limit);
        if r.ids.is_empty() {
            let f = filter(r.filter)?;
            if f.is_empty() {
                return Err(invalid(DlqRequestError::new(
                    "filter",
                    "an empty filter is refused for a redrive; name ids, or filter by bridge, route, binding, reason or time",
                )));
            }
            let page = self
                .backend
                .list(&f, limit, None)
                .await
                .map_err(backend::status)?;
            return Ok(Selection {
                truncated: page.next_page_token.is_some(),
                entries: page
                    .entries
                    .into_iter()
                    .map(|e| (e.id.clone(), Ok(e)))
                    .collect(),
            });
        }
        for (i, id) in r.ids.iter().enumerate() {
            require_id(&format!("ids[{i}]"), id)?;
        }
        let truncated = r.ids.len() > limit as usize;
        let mut entries = Vec::new();
        for id in r.ids.into_iter().take(limit as usize) {
            let entry = self.backend.get(&id).await;
            entries.push((id, entry));
        }
        Ok(Selection { entries, truncated })
    }
}

/// What a redrive or purge selects, as its audit event names it: the bridge
/// of the filter, and the ids or the filter.
fn audit_subject(ids: &[String], f: Option<&pb::DlqFilter>) -> (String, String) {
    let parsed = DlqFilter::from_proto(f.cloned());
    let bridge = parsed
        .as_ref()
        .ok()
        .and_then(|f| f.bridge_id.clone())
        .unwrap_or_default();
    let subject = if !ids.is_empty() {
        format!("ids {}", ids.join(","))
    } else {
        match parsed {
            Ok(f) => format!("filter {f}"),
            Err(e) => format!("filter ({e})"),
        }
    };
    (bridge, subject)
}

/// A refused request: `INVALID_ARGUMENT` naming the field.
fn invalid(e: DlqRequestError) -> Status {
    Status::invalid_argument(e.to_string())
}

fn filter(f: Option<pb::DlqFilter>) -> Result<DlqFilter, Status> {
    DlqFilter::from_proto(f).map_err(invalid)
}

/// `INVALID_ARGUMENT` naming `field` when `id` is blank.
fn require_id(field: &str, id: &str) -> Result<(), Status> {
    if id.trim().is_empty() {
        return Err(invalid(DlqRequestError::new(field, "must not be empty")));
    }
    Ok(())
}

/// The entries a redrive works on, each fetched or the reason it could not
/// be, and whether more were selected than `limit` allowed.
struct Selection {
    entries: Vec<(String, Result<pb::DlqEntry, DlqBackendError>)>,
    truncated: bool,
}

#[tonic::async_trait]
impl DlqService for DlqServer {
    async fn write_dlq_entry(
        &self,
        request: Request<pb::WriteDlqEntryRequest>,
    ) -> Result<Response<pb::WriteDlqEntryResponse>, Status> {
        let caller = crate::auth::Caller::of(&request).principal;
        let written = check_written_entry(request.into_inner().entry).map_err(invalid)?;
        self.backend
            .authorize_write(&caller, &written.entry)
            .await?;
        let entry = pb::DlqEntry {
            envelope: Some(written.envelope),
            dead_lettered_at: Some(
                written
                    .entry
                    .dead_lettered_at
                    .unwrap_or_else(|| SystemTime::now().into()),
            ),
            ..written.entry
        };
        let created = self.backend.write(entry).await.map_err(backend::status)?;
        Ok(Response::new(pb::WriteDlqEntryResponse { created }))
    }

    async fn list_dlq_entries(
        &self,
        request: Request<pb::ListDlqEntriesRequest>,
    ) -> Result<Response<pb::ListDlqEntriesResponse>, Status> {
        let r = request.into_inner();
        let f = filter(r.filter)?;
        let token = (!r.page_token.is_empty()).then_some(r.page_token);
        let mut page = self
            .backend
            .list(&f, page_size(r.page_size), token)
            .await
            .map_err(backend::status)?;
        if r.omit_payload {
            for envelope in page.entries.iter_mut().filter_map(|e| e.envelope.as_mut()) {
                envelope.payload.clear();
            }
        }
        Ok(Response::new(pb::ListDlqEntriesResponse {
            entries: page.entries,
            next_page_token: page.next_page_token.unwrap_or_default(),
        }))
    }

    async fn get_dlq_entry(
        &self,
        request: Request<pb::GetDlqEntryRequest>,
    ) -> Result<Response<pb::GetDlqEntryResponse>, Status> {
        let id = request.into_inner().id;
        require_id("id", &id)?;
        let entry = self.backend.get(&id).await.map_err(backend::status)?;
        Ok(Response::new(pb::GetDlqEntryResponse {
            entry: Some(entry),
        }))
    }

    async fn redrive_dlq_entries(
        &self,
        request: Request<pb::RedriveDlqEntriesRequest>,
    ) -> Result<Response<pb::RedriveDlqEntriesResponse>, Status> {
        let caller = Caller::of(&request);
        let r = request.into_inner();
        let (bridge, subject) = audit_subject(&r.ids, r.filter.as_ref());
        let result = self.redrive(r).await;
        let subject = match &result {
            Ok(done) => {
                let ok = done.outcomes.iter().filter(|o| o.ok).count();
                let failed = done.outcomes.len() - ok;
                format!("{subject}: {ok} redriven, {failed} failed")
            }
            Err(_) => subject,
        };
        audit::record(
            &caller,
            Action::DlqRedrive,
            &bridge,
            &subject,
            &Outcome::of(&result),
        );
        result.map(Response::new)
    }

    async fn delete_dlq_entry(
        &self,
        request: Request<pb::DeleteDlqEntryRequest>,
    ) -> Result<Response<pb::DeleteDlqEntryResponse>, Status> {
        let caller = Caller::of(&request);
        let id = request.into_inner().id;
        let result = match require_id("id", &id) {
            Ok(()) => self.backend.delete(&id).await.map_err(backend::status),
            Err(refused) => Err(refused),
        };
        audit::record(
            &caller,
            Action::DlqDelete,
            "",
            &format!("id {id}"),
            &Outcome::of(&result),
        );
        result.map(|()| Response::new(pb::DeleteDlqEntryResponse {}))
    }

    async fn purge_dlq_entries(
        &self,
        request: Request<pb::PurgeDlqEntriesRequest>,
    ) -> Result<Response<pb::PurgeDlqEntriesResponse>, Status> {
        let caller = Caller::of(&request);
        let r = request.into_inner();
        let (bridge, subject) = audit_subject(&[], r.filter.as_ref());
        let result = self.purge(r).await;
        let subject = match &result {
            Ok(purged) => format!("{subject}: {purged} purged"),
            Err(_) => subject,
        };
        audit::record(
            &caller,
            Action::DlqPurge,
            &bridge,
            &subject,
            &Outcome::of(&result),
        );
        result.map(|purged| Response::new(pb::PurgeDlqEntriesResponse { purged }))
    }

    async fn get_dlq_stats(
        &self,
        request: Request<pb::GetDlqStatsRequest>,
    ) -> Result<Response<pb::GetDlqStatsResponse>, Status> {
        let f = filter(request.into_inner().filter)?;
        let stats = self.backend.stats(&f).await.map_err(backend::status)?;
        Ok(Response::new(pb::GetDlqStatsResponse {
            total: stats.iter().map(|s| s.count).sum(),
            stats: stats.into_iter().map(pb::DlqStat::from).collect(),
        }))
    }
}

#[cfg(test)]
mod tests;
