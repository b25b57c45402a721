//! ConfigService: bridge configurations, their versions and history.
//!
//! Every change goes through [`ConfigServiceImpl::store`]: the whole
//! document is validated by the shared validator (nothing is stored when it
//! is refused), stored as the next version with the caller's
//! `expected_version` as compare-and-swap and the caller as its author
//! ([`AppliedBy`]), and the agent streams are told.
//!
//! Audit: every apply, route edit, rollback and delete writes one audit
//! event ([`ferry_shared::audit`]), also when refused; so does every read
//! that reveals secrets.
//!
//! Secrets: every document a response carries is masked
//! ([`ferry_shared::config::secret`]) unless the request asks for
//! `reveal_secrets` and the caller has the admin role
//! (`PERMISSION_DENIED` naming the role otherwise).

use ferry_shared::api::v1 as pb;
use ferry_shared::audit::{self, Action, Outcome};
use ferry_shared::auth::{Caller, Role};
use ferry_shared::config::secret::mask_yaml;
use pb::config_service_server::ConfigService;
use tonic::{Request, Response, Status};

use super::Context;
use super::documents;
use super::status::{page, require, selector_labels, state_status, timestamp};
use crate::state::{AppliedBy, AppliedConfig, ApplyConfig, Labels, StoredConfig};

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
        caller: &Caller,
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
                applied_by: AppliedBy {
                    principal: caller.principal.name.clone(),
                    client_address: caller.peer_text(),
                },
            })
            .await
            .map_err(state_status)?;
        if applied.changed {
            tracing::info!(bridge = %applied.config.bridge_id, version = applied.config.version, applied_by = %caller, "configuration stored");
            self.ctx.notify_config_change();
        }
        Ok(applied)
    }

    /// Changes the current document of `bridge_id` with `edit` and stores the
    /// result as a new version (validated as a whole, compare-and-swap on the
    /// version it was read at, the selector kept).
    async fn edit(
        &self,
        caller: &Caller,
        bridge_id: &str,
        expected_version: Option<u64>,
        change_note: String,
        edit: impl FnOnce(&str) -> Result<String, Status>,
    ) -> Result<AppliedConfig, Status> {
        let current = self.current(bridge_id).await?;
        check_expected(&current, expected_version)?;
        let yaml = edit(&current.yaml)?;
        self.store(
            caller,
            Some(bridge_id),
            yaml,
            current.selector,
            Some(current.version),
            change_note,
        )
        .await
    }

    /// Stores an old version's document and selector as the next version.
    async fn rollback(
        &self,
        caller: &Caller,
        request: &pb::RollbackConfigRequest,
    ) -> Result<AppliedConfig, Status> {
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
        self.store(
            caller,
            Some(&request.bridge_id),
            old.yaml,
            old.selector,
            request.expected_version,
            note,
        )
        .await
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

/// Whether a document is shown as stored or with its secrets masked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Secrets {
    Masked,
    Revealed,
}

impl Secrets {
    /// What a read may show: `Revealed` only when asked for and the caller
    /// is an admin; asked for by anyone else, `PERMISSION_DENIED`. A reveal
    /// (granted or refused) is audited.
    fn for_read(caller: &Caller, asked: bool, bridge: &str) -> Result<Self, Status> {
        if !asked {
            return Ok(Self::Masked);
        }
        let result = if caller.principal.role == Role::Admin {
            Ok(Self::Revealed)
        } else {
            Err(Status::permission_denied(format!(
                "reveal_secrets needs the admin role; {} has the {} role",
                caller.principal.name, caller.principal.role
            )))
        };
        audit::record(
            caller,
            Action::ConfigRevealSecrets,
            bridge,
            "",
            &Outcome::of(&result),
        );
        result
    }
}

/// The gRPC form of a stored version, its document masked unless
/// `secrets` is `Revealed`.
fn bridge_config(config: StoredConfig, secrets: Secrets) -> pb::BridgeConfig {
    let yaml = match secrets {
        Secrets::Masked => mask_yaml(&config.yaml),
        Secrets::Revealed => config.yaml,
    };
    pb::BridgeConfig {
        bridge_id: config.bridge_id,
        version: config.version,
        selector: Some(pb::LabelSelector {
            match_labels: config.selector.into_iter().collect(),
        }),
        yaml,
        created_at: Some(timestamp(config.created_at)),
        change_note: config.change_note,
        applied_by: config.applied_by.principal,
        client_address: config.applied_by.client_address,
    }
}

/// Writes the audit event of a change: `action` on `bridge`, the version it
/// stored (or kept) as subject.
fn audit_change(
    caller: &Caller,
    action: Action,
    bridge: &str,
    detail: &str,
    result: &Result<AppliedConfig, Status>,
) {
    let subject = match result {
        Ok(applied) if applied.changed => format!("{detail}version {}", applied.config.version),
        Ok(applied) => format!("{detail}unchanged at version {}", applied.config.version),
        Err(_) => detail.trim_end_matches([',', ' ']).to_owned(),
    };
    audit::record(caller, action, bridge, &subject, &Outcome::of(result));
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
        let caller = Caller::of(&request);
        let request = request.into_inner();
        let result = async {
            let yaml = documents::from_request(request.document)?;
            let selector = selector_labels(request.selector)?;
            self.store(
                &caller,
                None,
                yaml,
                selector,
                request.expected_version,
                request.change_note,
            )
            .await
        }
        .await;
        // The bridge id is the document's; a refused document may not have one.
        let bridge = result
            .as_ref()
            .map(|a| a.config.bridge_id.clone())
            .unwrap_or_default();
        crate::rpc_span::record_bridge(&bridge);
        audit_change(&caller, Action::ConfigApply, &bridge, "", &result);
        let applied = result?;
        Ok(Response::new(pb::ApplyConfigResponse {
            changed: applied.changed,
            config: Some(bridge_config(applied.config, Secrets::Masked)),
        }))
    }

    async fn get_config(
        &self,
        request: Request<pb::GetConfigRequest>,
    ) -> Result<Response<pb::GetConfigResponse>, Status> {
        let caller = Caller::of(&request);
        let request = request.into_inner();
        require("bridge_id", &request.bridge_id)?;
        let secrets = Secrets::for_read(&caller, request.reveal_secrets, &request.bridge_id)?;
        let version = (request.version != 0).then_some(request.version);
        let config = self
            .ctx
            .store
            .get_config(&request.bridge_id, version)
            .await
            .map_err(state_status)?;
        Ok(Response::new(pb::GetConfigResponse {
            config: Some(bridge_config(config, secrets)),
        }))
    }

    async fn list_configs(
        &self,
        request: Request<pb::ListConfigsRequest>,
    ) -> Result<Response<pb::ListConfigsResponse>, Status> {
        let caller = Caller::of(&request);
        let request = request.into_inner();
        let secrets = Secrets::for_read(&caller, request.reveal_secrets, "")?;
        let listed = self
            .ctx
            .store
            .list_configs(page(request.page_size, request.page_token))
            .await
            .map_err(state_status)?;
        Ok(Response::new(pb::ListConfigsResponse {
            configs: listed
                .items
                .into_iter()
                .map(|c| bridge_config(c, secrets))
                .collect(),
            next_page_token: listed.next_token.unwrap_or_default(),
        }))
    }

    async fn delete_config(
        &self,
        request: Request<pb::DeleteConfigRequest>,
    ) -> Result<Response<pb::DeleteConfigResponse>, Status> {
        let caller = Caller::of(&request);
        let request = request.into_inner();
        let result = match require("bridge_id", &request.bridge_id) {
            Ok(()) => self
                .ctx
                .store
                .delete_config(&request.bridge_id, request.expected_version)
                .await
                .map_err(state_status),
            Err(refused) => Err(refused),
        };
        let subject = request
            .expected_version
            .map(|v| format!("expected version {v}"))
            .unwrap_or_default();
        audit::record(
            &caller,
            Action::ConfigDelete,
            &request.bridge_id,
            &subject,
            &Outcome::of(&result),
        );
        result?;
        tracing::info!(bridge = %request.bridge_id, deleted_by = %caller, "configuration deleted");
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
        let caller = Caller::of(&request);
        let request = request.into_inner();
        let result = self
            .edit(
                &caller,
                &request.bridge_id,
                request.expected_version,
                request.change_note,
                |yaml| documents::put_route(yaml, &request.route_yaml),
            )
            .await;
        audit_change(
            &caller,
            Action::ConfigApply,
            &request.bridge_id,
            "put route, ",
            &result,
        );
        Ok(Response::new(pb::PutRouteResponse {
            config: Some(bridge_config(result?.config, Secrets::Masked)),
        }))
    }

    async fn delete_route(
        &self,
        request: Request<pb::DeleteRouteRequest>,
    ) -> Result<Response<pb::DeleteRouteResponse>, Status> {
        let caller = Caller::of(&request);
        let request = request.into_inner();
        require("route_id", &request.route_id)?;
        let result = self
            .edit(
                &caller,
                &request.bridge_id,
                request.expected_version,
                request.change_note,
                |yaml| {
                    documents::delete_route(yaml, &request.route_id)?
                        .ok_or_else(|| route_not_found(&request.bridge_id, &request.route_id))
                },
            )
            .await;
        let detail = format!("delete route {}, ", request.route_id);
        audit_change(
            &caller,
            Action::ConfigApply,
            &request.bridge_id,
            &detail,
            &result,
        );
        Ok(Response::new(pb::DeleteRouteResponse {
            config: Some(bridge_config(result?.config, Secrets::Masked)),
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
                    applied_by: v.applied_by.principal,
                    client_address: v.applied_by.client_address,
                })
                .collect(),
            next_page_token: listed.next_token.unwrap_or_default(),
        }))
    }

    async fn rollback_config(
        &self,
        request: Request<pb::RollbackConfigRequest>,
    ) -> Result<Response<pb::RollbackConfigResponse>, Status> {
        let caller = Caller::of(&request);
        let request = request.into_inner();
        let result = self.rollback(&caller, &request).await;
        let detail = format!("to version {}, ", request.to_version);
        audit_change(
            &caller,
            Action::ConfigRollback,
            &request.bridge_id,
            &detail,
            &result,
        );
        Ok(Response::new(pb::RollbackConfigResponse {
            config: Some(bridge_config(result?.config, Secrets::Masked)),
        }))
    }
}

fn route_not_found(bridge_id: &str, route_id: &str) -> Status {
    Status::not_found(format!(
        "route {route_id:?} not found in configuration {bridge_id:?}"
    ))
}

#[cfg(test)]
mod tests;
