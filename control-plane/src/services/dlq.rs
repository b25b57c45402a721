//! DlqService: dead letters written by agents (stored durably before the
//! reply), inspected, redriven, deleted and purged by operators.
//!
//! A redrive sends each entry over the Connect stream of a connected agent
//! whose running configuration has the entry's route, waits for the agent's
//! CommandResult (`command_timeout`), and deletes the entry only after the
//! agent reports its redelivery durable.

use std::collections::HashMap;

use ferry_shared::api::v1 as pb;
use pb::dlq_service_server::DlqService;
use tonic::{Request, Response, Status};

use super::Context;
use super::dlq_convert::{entry_to_proto, entry_to_store, filter, is_empty, reason_to_proto};
use super::documents;
use super::registry::Runner;
use super::status::{page, require, state_status, timestamp};
use crate::state::{DEFAULT_PAGE_SIZE, DlqEntry, MAX_PAGE_SIZE, PageRequest, StateError};

/// The DlqService implementation.
#[derive(Clone)]
pub struct DlqServiceImpl {
    ctx: Context,
}

impl DlqServiceImpl {
    /// The service over `ctx`.
    pub fn new(ctx: Context) -> Self {
        Self { ctx }
    }

    /// A connected agent running the entry's route, if any. `routes` caches
    /// whether a (bridge, version) has a route.
    async fn runner_for(
        &self,
        entry: &DlqEntry,
        routes: &mut HashMap<(String, u64), Vec<String>>,
    ) -> Option<Runner> {
        for runner in self.ctx.agents.runners(&entry.bridge_id) {
            let key = (entry.bridge_id.clone(), runner.version);
            if !routes.contains_key(&key) {
                let ids = match self.ctx.store.get_config(&key.0, Some(key.1)).await {
                    Ok(config) => documents::validate(&config.yaml)
                        .map(|valid| valid.routes.iter().map(|r| r.id.clone()).collect())
                        .unwrap_or_default(),
                    Err(_) => Vec::new(),
                };
                routes.insert(key.clone(), ids);
            }
            if routes
                .get(&key)
                .is_some_and(|ids| ids.contains(&entry.route_id))
            {
                return Some(runner);
            }
        }
        None
    }

    async fn redrive_one(
        &self,
        entry: DlqEntry,
        routes: &mut HashMap<(String, u64), Vec<String>>,
    ) -> Result<(), RedriveFailure> {
        let id = entry.id.clone();
        let Some(runner) = self.runner_for(&entry, routes).await else {
            return Err(RedriveFailure::NoRunner(format!(
                "failed precondition: no connected agent runs route {:?} of bridge {:?}",
                entry.route_id, entry.bridge_id
            )));
        };
        let proto = entry_to_proto(entry, true)
            .map_err(|s| RedriveFailure::Other(s.message().to_owned()))?;
        let command = pb::Command {
            command_id: uuid::Uuid::now_v7().to_string(),
            kind: Some(pb::command::Kind::Redrive(pb::RedriveCommand {
                entry: Some(proto),
            })),
        };
        let result = self
            .ctx
            .agents
            .execute(&runner, command, self.ctx.options.command_timeout)
            .await
            .map_err(RedriveFailure::Other)?;
        if !result.ok {
            return Err(RedriveFailure::Other(format!(
                "agent {} could not redrive it: {}",
                runner.agent_id, result.error
            )));
        }
        match self.ctx.store.delete_dlq(&id).await {
            // Deleted meanwhile by somebody else: the redelivery stands.
            Ok(()) | Err(StateError::NotFound { .. }) => Ok(()),
            Err(error) => Err(RedriveFailure::Other(format!(
                "redelivered, but the entry could not be deleted (it may be redriven twice): {error}"
            ))),
        }
    }
}

enum RedriveFailure {
    NoRunner(String),
    Other(String),
}

fn limit(value: u32) -> usize {
    let size = match value {
        0 => DEFAULT_PAGE_SIZE,
        n => n.min(MAX_PAGE_SIZE),
    };
    size as usize
}

#[tonic::async_trait]
impl DlqService for DlqServiceImpl {
    async fn write_dlq_entry(
        &self,
        request: Request<pb::WriteDlqEntryRequest>,
    ) -> Result<Response<pb::WriteDlqEntryResponse>, Status> {
        let entry = entry_to_store(request.into_inner().entry)?;
        let created = self.ctx.store.put_dlq(entry).await.map_err(state_status)?;
        Ok(Response::new(pb::WriteDlqEntryResponse { created }))
    }

    async fn list_dlq_entries(
        &self,
        request: Request<pb::ListDlqEntriesRequest>,
    ) -> Result<Response<pb::ListDlqEntriesResponse>, Status> {
        let request = request.into_inner();
        let filter = filter(request.filter)?;
        let listed = self
            .ctx
            .store
            .list_dlq(&filter, page(request.page_size, request.page_token))
            .await
            .map_err(state_status)?;
        let entries = listed
            .items
            .into_iter()
            .map(|e| entry_to_proto(e, !request.omit_payload))
            .collect::<Result<_, _>>()?;
        Ok(Response::new(pb::ListDlqEntriesResponse {
            entries,
            next_page_token: listed.next_token.unwrap_or_default(),
        }))
    }

    async fn get_dlq_entry(
        &self,
        request: Request<pb::GetDlqEntryRequest>,
    ) -> Result<Response<pb::GetDlqEntryResponse>, Status> {
        let request = request.into_inner();
        require("id", &request.id)?;
        let entry = self
            .ctx
            .store
            .get_dlq(&request.id)
            .await
            .map_err(state_status)?;
        Ok(Response::new(pb::GetDlqEntryResponse {
            entry: Some(entry_to_proto(entry, true)?),
        }))
    }

    async fn redrive_dlq_entries(
        &self,
        request: Request<pb::RedriveDlqEntriesRequest>,
    ) -> Result<Response<pb::RedriveDlqEntriesResponse>, Status> {
        let request = request.into_inner();
        let limit = limit(request.limit);
        let mut outcomes = Vec::new();
        let mut entries = Vec::new();
        let truncated;
        if request.ids.is_empty() {
            let filter = filter(request.filter)?;
            if is_empty(&filter) {
                return Err(Status::invalid_argument(
                    "filter: an empty filter is refused for a redrive; name ids or filter by bridge, route, binding, reason or time",
                ));
            }
            let size = u32::try_from(limit).unwrap_or(MAX_PAGE_SIZE);
            let listed = self
                .ctx
                .store
                .list_dlq(&filter, PageRequest::first(size))
                .await
                .map_err(state_status)?;
            truncated = listed.next_token.is_some();
            entries = listed.items;
        } else {
            for id in &request.ids {
                require("ids[]", id)?;
            }
            truncated = request.ids.len() > limit;
            for id in request.ids.into_iter().take(limit) {
                match self.ctx.store.get_dlq(&id).await {
                    Ok(entry) => entries.push(entry),
                    Err(error @ StateError::NotFound { .. }) => outcomes.push(pb::RedriveOutcome {
                        id,
                        ok: false,
                        error: error.to_string(),
                    }),
                    Err(error) => return Err(state_status(error)),
                }
            }
        }
        let mut routes = HashMap::new();
        let (mut dispatched, mut no_runner) = (0usize, 0usize);
        for entry in entries {
            let id = entry.id.clone();
            let outcome = match self.redrive_one(entry, &mut routes).await {
                Ok(()) => {
                    dispatched += 1;
                    pb::RedriveOutcome {
                        id,
                        ok: true,
                        error: String::new(),
                    }
                }
                Err(RedriveFailure::NoRunner(error)) => {
                    no_runner += 1;
                    pb::RedriveOutcome {
                        id,
                        ok: false,
                        error,
                    }
                }
                Err(RedriveFailure::Other(error)) => {
                    dispatched += 1;
                    pb::RedriveOutcome {
                        id,
                        ok: false,
                        error,
                    }
                }
            };
            outcomes.push(outcome);
        }
        if dispatched == 0 && no_runner > 0 {
            let first = outcomes
                .iter()
                .find(|o| !o.ok)
                .map(|o| {
                    o.error
                        .trim_start_matches("failed precondition: ")
                        .to_owned()
                })
                .unwrap_or_default();
            return Err(Status::failed_precondition(format!(
                "nothing redriven: {first}"
            )));
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
        let request = request.into_inner();
        require("id", &request.id)?;
        self.ctx
            .store
            .delete_dlq(&request.id)
            .await
            .map_err(state_status)?;
        Ok(Response::new(pb::DeleteDlqEntryResponse {}))
    }

    async fn purge_dlq_entries(
        &self,
        request: Request<pb::PurgeDlqEntriesRequest>,
    ) -> Result<Response<pb::PurgeDlqEntriesResponse>, Status> {
        let request = request.into_inner();
        if !request.confirm {
            return Err(Status::invalid_argument(
                "confirm: must be true; a purge deletes entries for good",
            ));
        }
        let filter = filter(request.filter)?;
        let purged = self
            .ctx
            .store
            .purge_dlq(&filter)
            .await
            .map_err(state_status)?;
        Ok(Response::new(pb::PurgeDlqEntriesResponse { purged }))
    }

    async fn get_dlq_stats(
        &self,
        request: Request<pb::GetDlqStatsRequest>,
    ) -> Result<Response<pb::GetDlqStatsResponse>, Status> {
        let filter = filter(request.into_inner().filter)?;
        let stats = self
            .ctx
            .store
            .dlq_stats(&filter)
            .await
            .map_err(state_status)?;
        let total = stats.iter().map(|s| s.count).sum();
        Ok(Response::new(pb::GetDlqStatsResponse {
            stats: stats
                .into_iter()
                .map(|s| pb::DlqStat {
                    bridge_id: s.bridge_id,
                    route_id: s.route_id,
                    binding_id: s.binding_id,
                    reason: reason_to_proto(s.reason),
                    count: s.count,
                    oldest: Some(timestamp(s.oldest)),
                })
                .collect(),
            total,
        }))
    }
}
