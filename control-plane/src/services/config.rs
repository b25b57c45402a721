//! ConfigService: bridge configurations, their versions and history.
//!
//! Every change goes through [`ConfigServiceImpl::store`]: the whole
//! document is validated by the shared validator (nothing is stored when it
//! is refused), stored as the next version with the caller's
//! `expected_version` as compare-and-swap, and the agent streams are told.

use ferry_shared::api::v1 as pb;
use pb::config_service_server::ConfigService;
use tonic::{Request, Response, Status};

use super::Context;
use super::documents;
use super::status::{page, require, selector_labels, state_status, timestamp};
use crate::state::{AppliedConfig, ApplyConfig, Labels, StoredConfig};

/// The ConfigService implementation.
#[derive(Clone)]
pub struct ConfigServiceImpl {
    ctx: Context,
}

impl ConfigServiceImpl {
    /// The service over `ctx`.
    pub fn new(ctx: Context) -> Self {
        Self { ctx }
    }

    /// Validates `yaml` and stores it as `bridge_id`'s next version (when
    /// given, the document must carry that bridge id).
    async fn store(
        &self,
        bridge_id: Option<&str>,
        yaml: String,
        selector: Labels,
        expected_version: Option<u64>,
        change_note: String,
    ) -> Result<AppliedConfig, Status> {
        let valid = documents::validate(&yaml)?;
        if let Some(bridge_id) = bridge_id.filter(|id| *id != valid.bridge_id()) {
            return Err(Status::invalid_argument(format!(
                "bridge.id: the document's id {:?} differs from the configuration {bridge_id:?}",
                valid.bridge_id()
            )));
        }
        let applied = self
            .ctx
            .store
            .apply_config(ApplyConfig {
                bridge_id: valid.bridge_id().to_owned(),
                yaml,
                selector,
                change_note,
                expected_version,
            })
            .await
            .map_err(state_status)?;
        if applied.changed {
            tracing::info!(bridge = %applied.config.bridge_id, version = applied.config.version, "configuration stored");
            self.ctx.notify_config_change();
        }
        Ok(applied)
    }

    /// Changes the current document of `bridge_id` with `edit` and stores the
    /// result as a new version (validated as a whole, compare-and-swap on the
    /// version it was read at, the selector kept).
    async fn edit(
        &self,
        bridge_id: &str,
        expected_version: Option<u64>,
        change_note: String,
        edit: impl FnOnce(&str) -> Result<String, Status>,
    ) -> Result<pb::BridgeConfig, Status> {
        let current = self.current(bridge_id).await?;
        check_expected(&current, expected_version)?;
        let yaml = edit(&current.yaml)?;
        let applied = self
            .store(
                Some(bridge_id),
                yaml,
                current.selector,
                Some(current.version),
                change_note,
            )
            .await?;
        Ok(bridge_config(applied.config))
    }

    async fn current(&self, bridge_id: &str) -> Result<StoredConfig, Status> {
        require("bridge_id", bridge_id)?;
        self.ctx
            .store
            .get_config(bridge_id, None)
            .await
            .map_err(state_status)
    }
}

/// The gRPC form of a stored version.
pub fn bridge_config(config: StoredConfig) -> pb::BridgeConfig {
    pb::BridgeConfig {
        bridge_id: config.bridge_id,
        version: config.version,
        selector: Some(pb::LabelSelector {
            match_labels: config.selector.into_iter().collect(),
        }),
        yaml: config.yaml,
        created_at: Some(timestamp(config.created_at)),
        change_note: config.change_note,
    }
}

/// `expected_version` must match before an edit derived from `current`.
fn check_expected(current: &StoredConfig, expected: Option<u64>) -> Result<(), Status> {
    match expected {
        Some(expected) if expected != current.version => {
            Err(state_status(crate::state::StateError::Conflict {
                current: current.version,
            }))
        }
        _ => Ok(()),
    }
}

#[tonic::async_trait]
impl ConfigService for ConfigServiceImpl {
    async fn apply_config(
        &self,
        request: Request<pb::ApplyConfigRequest>,
    ) -> Result<Response<pb::ApplyConfigResponse>, Status> {
        let request = request.into_inner();
        let yaml = documents::from_request(request.document)?;
        let selector = selector_labels(request.selector)?;
        let applied = self
            .store(
                None,
                yaml,
                selector,
                request.expected_version,
                request.change_note,
            )
            .await?;
        crate::rpc_span::record_bridge(&applied.config.bridge_id);
        Ok(Response::new(pb::ApplyConfigResponse {
            changed: applied.changed,
            config: Some(bridge_config(applied.config)),
        }))
    }

    async fn get_config(
        &self,
        request: Request<pb::GetConfigRequest>,
    ) -> Result<Response<pb::GetConfigResponse>, Status> {
        let request = request.into_inner();
        require("bridge_id", &request.bridge_id)?;
        let version = (request.version != 0).then_some(request.version);
        let config = self
            .ctx
            .store
            .get_config(&request.bridge_id, version)
            .await
            .map_err(state_status)?;
        Ok(Response::new(pb::GetConfigResponse {
            config: Some(bridge_config(config)),
        }))
    }

    async fn list_configs(
        &self,
        request: Request<pb::ListConfigsRequest>,
    ) -> Result<Response<pb::ListConfigsResponse>, Status> {
        let request = request.into_inner();
        let listed = self
            .ctx
            .store
            .list_configs(page(request.page_size, request.page_token))
            .await
            .map_err(state_status)?;
        Ok(Response::new(pb::ListConfigsResponse {
            configs: listed.items.into_iter().map(bridge_config).collect(),
            next_page_token: listed.next_token.unwrap_or_default(),
        }))
    }

    async fn delete_config(
        &self,
        request: Request<pb::DeleteConfigRequest>,
    ) -> Result<Response<pb::DeleteConfigResponse>, Status> {
        let request = request.into_inner();
        require("bridge_id", &request.bridge_id)?;
        self.ctx
            .store
            .delete_config(&request.bridge_id, request.expected_version)
            .await
            .map_err(state_status)?;
        tracing::info!(bridge = %request.bridge_id, "configuration deleted");
        self.ctx.notify_config_change();
        Ok(Response::new(pb::DeleteConfigResponse {}))
    }

    async fn get_route(
        &self,
        request: Request<pb::GetRouteRequest>,
    ) -> Result<Response<pb::GetRouteResponse>, Status> {
        let request = request.into_inner();
        require("route_id", &request.route_id)?;
        let current = self.current(&request.bridge_id).await?;
        let route_yaml = documents::get_route(&current.yaml, &request.route_id)?
            .ok_or_else(|| route_not_found(&request.bridge_id, &request.route_id))?;
        Ok(Response::new(pb::GetRouteResponse {
            route_yaml,
            version: current.version,
        }))
    }

    async fn put_route(
        &self,
        request: Request<pb::PutRouteRequest>,
    ) -> Result<Response<pb::PutRouteResponse>, Status> {
        let request = request.into_inner();
        let config = self
            .edit(
                &request.bridge_id,
                request.expected_version,
                request.change_note,
                |yaml| documents::put_route(yaml, &request.route_yaml),
            )
            .await?;
        Ok(Response::new(pb::PutRouteResponse {
            config: Some(config),
        }))
    }

    async fn delete_route(
        &self,
        request: Request<pb::DeleteRouteRequest>,
    ) -> Result<Response<pb::DeleteRouteResponse>, Status> {
        let request = request.into_inner();
        require("route_id", &request.route_id)?;
        let config = self
            .edit(
                &request.bridge_id,
                request.expected_version,
                request.change_note,
                |yaml| {
                    documents::delete_route(yaml, &request.route_id)?
                        .ok_or_else(|| route_not_found(&request.bridge_id, &request.route_id))
                },
            )
            .await?;
        Ok(Response::new(pb::DeleteRouteResponse {
            config: Some(config),
        }))
    }

    async fn list_config_versions(
        &self,
        request: Request<pb::ListConfigVersionsRequest>,
    ) -> Result<Response<pb::ListConfigVersionsResponse>, Status> {
        let request = request.into_inner();
        require("bridge_id", &request.bridge_id)?;
        let listed = self
            .ctx
            .store
            .list_config_versions(
                &request.bridge_id,
                page(request.page_size, request.page_token),
            )
            .await
            .map_err(state_status)?;
        Ok(Response::new(pb::ListConfigVersionsResponse {
            versions: listed
                .items
                .into_iter()
                .map(|v| pb::ConfigVersion {
                    version: v.version,
                    created_at: Some(timestamp(v.created_at)),
                    change_note: v.change_note,
                    digest: v.digest,
                })
                .collect(),
            next_page_token: listed.next_token.unwrap_or_default(),
        }))
    }

    async fn rollback_config(
        &self,
        request: Request<pb::RollbackConfigRequest>,
    ) -> Result<Response<pb::RollbackConfigResponse>, Status> {
        let request = request.into_inner();
        require("bridge_id", &request.bridge_id)?;
        if request.to_version == 0 {
            return Err(Status::invalid_argument(
                "to_version: must be a version (1 or more)",
            ));
        }
        let old = self
            .ctx
            .store
            .get_config(&request.bridge_id, Some(request.to_version))
            .await
            .map_err(state_status)?;
        let note = format!("rollback to version {}", request.to_version);
        let applied = self
            .store(
                Some(&request.bridge_id),
                old.yaml,
                old.selector,
                request.expected_version,
                note,
            )
            .await?;
        Ok(Response::new(pb::RollbackConfigResponse {
            config: Some(bridge_config(applied.config)),
        }))
    }
}

fn route_not_found(bridge_id: &str, route_id: &str) -> Status {
    Status::not_found(format!(
        "route {route_id:?} not found in configuration {bridge_id:?}"
    ))
}
