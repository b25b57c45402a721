//! The state store's dead letters as a [`DlqBackend`], so the control plane
//! serves the one `ferry.v1.DlqService` of [`ferry_shared::dlq::service`]
//! (an agent's admin listener serves the same over its own store). Agents
//! write entries; operators inspect, redrive, delete and purge them.
//!
//! A redrive sends the entry over the Connect stream of a connected agent
//! whose running configuration has the entry's route and waits for the
//! agent's CommandResult (`command_timeout`); the service deletes the entry
//! once the agent reports its redelivery durable.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use ferry_shared::api::v1 as pb;
use ferry_shared::api::v1::dlq_service_server::DlqServiceServer;
use ferry_shared::dlq::backend::{DlqBackend, DlqBackendError, DlqPage, RedriveError};
use ferry_shared::dlq::service::DlqServer;
use ferry_shared::dlq::{DlqFilter, DlqStat};

use ferry_shared::auth::Principal;

use super::Context;
use super::assignment::require_assigned;
use super::dlq_convert::{backend_error, entry_to_proto, entry_to_store};
use super::documents;
use super::registry::Runner;
use crate::state::PageRequest;

/// Most (bridge, version) route lists kept; the cache is emptied when full.
const ROUTE_CACHE_CAPACITY: usize = 256;

/// The route ids of each (bridge, version) looked up. A stored version never
/// changes, so an entry never goes stale.
type RouteCache = HashMap<(String, u64), Arc<[String]>>;

/// The state store's DLQ and the connected agents.
pub struct StateDlq {
    ctx: Context,
    routes: Mutex<RouteCache>,
}

impl StateDlq {
    /// The `DlqService` server over `ctx`.
    pub fn server(ctx: Context) -> DlqServiceServer<DlqServer> {
        DlqServer::server(Arc::new(Self {
            ctx,
            routes: Mutex::default(),
        }))
    }

    /// The route ids of `bridge_id` at `version`; `None` when the store
    /// cannot say now (not cached, so a later call asks again).
    async fn routes_of(&self, bridge_id: &str, version: u64) -> Option<Arc<[String]>> {
        let key = (bridge_id.to_owned(), version);
        if let Some(ids) = self.cache().get(&key) {
            return Some(ids.clone());
        }
        let config = self
            .ctx
            .store
            .get_config(bridge_id, Some(version))
            .await
            .ok()?;
        let ids: Arc<[String]> = documents::validate(&config.yaml)
            .map(|valid| valid.routes.iter().map(|r| r.id.clone()).collect())
            .unwrap_or_default();
        let mut cache = self.cache();
        if cache.len() >= ROUTE_CACHE_CAPACITY {
            cache.clear();
        }
        cache.insert(key, ids.clone());
        Some(ids)
    }

    fn cache(&self) -> MutexGuard<'_, RouteCache> {
        self.routes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A connected agent running the entry's route, if any.
    async fn runner_for(&self, entry: &pb::DlqEntry) -> Option<Runner> {
        for runner in self.ctx.agents.runners(&entry.bridge_id) {
            let routes = self.routes_of(&entry.bridge_id, runner.version).await;
            if routes.is_some_and(|ids| ids.contains(&entry.route_id)) {
                return Some(runner);
            }
        }
        None
    }
}

#[tonic::async_trait]
impl DlqBackend for StateDlq {
    async fn write(&self, entry: pb::DlqEntry) -> Result<bool, DlqBackendError> {
        let entry = entry_to_store(entry)?;
        self.ctx.store.put_dlq(entry).await.map_err(backend_error)
    }

    async fn authorize_write(
        &self,
        caller: &Principal,
        entry: &pb::DlqEntry,
    ) -> Result<(), tonic::Status> {
        require_assigned(&self.ctx, caller, &entry.bridge_id).await
    }

    async fn list(
        &self,
        filter: &DlqFilter,
        size: u32,
        token: Option<String>,
    ) -> Result<DlqPage, DlqBackendError> {
        let listed = self
            .ctx
            .store
            .list_dlq(filter, PageRequest { size, token })
            .await
            .map_err(backend_error)?;
        Ok(DlqPage {
            entries: listed
                .items
                .into_iter()
                .map(entry_to_proto)
                .collect::<Result<_, _>>()?,
            next_page_token: listed.next_token,
        })
    }

    async fn get(&self, id: &str) -> Result<pb::DlqEntry, DlqBackendError> {
        entry_to_proto(self.ctx.store.get_dlq(id).await.map_err(backend_error)?)
    }

    async fn delete(&self, id: &str) -> Result<(), DlqBackendError> {
        self.ctx.store.delete_dlq(id).await.map_err(backend_error)
    }

    async fn purge(&self, filter: &DlqFilter) -> Result<u64, DlqBackendError> {
        self.ctx
            .store
            .purge_dlq(filter)
            .await
            .map_err(backend_error)
    }

    async fn stats(&self, filter: &DlqFilter) -> Result<Vec<DlqStat>, DlqBackendError> {
        self.ctx
            .store
            .dlq_stats(filter)
            .await
            .map_err(backend_error)
    }

    async fn redrive(&self, entry: &pb::DlqEntry) -> Result<(), RedriveError> {
        let Some(runner) = self.runner_for(entry).await else {
            return Err(RedriveError::Unroutable(format!(
                "no connected agent runs route {:?} of bridge {:?}",
                entry.route_id, entry.bridge_id
            )));
        };
        let command = pb::Command {
            command_id: uuid::Uuid::now_v7().to_string(),
            kind: Some(pb::command::Kind::Redrive(pb::RedriveCommand {
                entry: Some(entry.clone()),
            })),
        };
        let result = self
            .ctx
            .agents
            .execute(&runner, command, self.ctx.options.command_timeout)
            .await
            .map_err(RedriveError::Failed)?;
        if !result.ok {
            return Err(RedriveError::Failed(format!(
                "agent {} could not redrive it: {}",
                runner.agent_id, result.error
            )));
        }
        Ok(())
    }
}
