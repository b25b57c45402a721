//! LeaseService: leases with fencing versions, over the state store (which
//! decides and writes each grant in one transaction, so versions never
//! repeat, also between replicas). The control plane decides time: every
//! call reads [`Options::clock`](super::Options::clock), never the caller's.
//!
//! Audit: an acquire that changes the lease (granted, or refused with an
//! error) and every release by an operator or admin writes one audit event.
//! Agents' own acquires, renewals and releases are their routine work and
//! are not audited (nor are renewals by anyone: they change no holder).

use ferry_shared::api::v1 as pb;
use ferry_shared::audit::{self, Action, Outcome};
use ferry_shared::auth::policy::require_own_agent;
use ferry_shared::auth::{Caller, Principal, Role};
use pb::lease_service_server::LeaseService;
use tonic::{Request, Response, Status};

use super::Context;
use super::assignment::{lease_bridge, require_assigned};
use super::status::{page, positive_duration, require, state_status, timestamp};
use crate::rpc_span;
use crate::state::{Lease, LeaseAcquisition};

/// The LeaseService implementation.
#[derive(Clone)]
pub struct LeaseServiceImpl {
    ctx: Context,
}

impl LeaseServiceImpl {
    /// The service over `ctx`.
    pub fn new(ctx: Context) -> Self {
        Self { ctx }
    }
}

fn lease(lease: Lease) -> pb::Lease {
    pb::Lease {
        key: lease.key,
        holder: lease.holder.unwrap_or_default(),
        version: lease.version,
        expires_at: Some(timestamp(lease.expires_at)),
        acquired_at: Some(timestamp(lease.acquired_at)),
    }
}

/// Writes the audit event of a lease operation when an operator or admin
/// made it.
fn audit_lease<T>(caller: &Caller, action: Action, key: &str, result: &Result<T, Status>) {
    if matches!(caller.principal.role, Role::Admin | Role::Operator) {
        audit::record(
            caller,
            action,
            lease_bridge(key),
            &format!("key {key}"),
            &Outcome::of(result),
        );
    }
}

impl LeaseServiceImpl {
    /// An agent takes and renews leases only as itself and only for the
    /// bridges assigned to it.
    async fn authorize(&self, caller: &Principal, key: &str, holder: &str) -> Result<(), Status> {
        require_own_agent(caller, holder, "the lease holder")?;
        require_assigned(&self.ctx, caller, lease_bridge(key)).await
    }
}

fn require_version(version: u64) -> Result<(), Status> {
    if version == 0 {
        return Err(Status::invalid_argument(
            "version: must be the fencing version the caller holds (1 or more)",
        ));
    }
    Ok(())
}

impl LeaseServiceImpl {
    async fn acquire(
        &self,
        caller: &Principal,
        request: &pb::AcquireLeaseRequest,
    ) -> Result<pb::AcquireLeaseResponse, Status> {
        require("key", &request.key)?;
        require("holder", &request.holder)?;
        rpc_span::record_agent(&request.holder);
        rpc_span::record_bridge(&request.key);
        self.authorize(caller, &request.key, &request.holder)
            .await?;
        let ttl = positive_duration("ttl", request.ttl)?;
        let outcome = self
            .ctx
            .store
            .acquire_lease(
                &request.key,
                &request.holder,
                ttl,
                self.ctx.options.clock.now(),
            )
            .await
            .map_err(state_status)?;
        let outcome = match outcome {
            LeaseAcquisition::Granted(granted) => {
                pb::acquire_lease_response::Outcome::Granted(lease(granted))
            }
            LeaseAcquisition::HeldByOther(held) => {
                pb::acquire_lease_response::Outcome::HeldByOther(lease(held))
            }
        };
        Ok(pb::AcquireLeaseResponse {
            outcome: Some(outcome),
        })
    }

    async fn release(
        &self,
        caller: &Principal,
        request: &pb::ReleaseLeaseRequest,
    ) -> Result<(), Status> {
        require("key", &request.key)?;
        require("holder", &request.holder)?;
        rpc_span::record_agent(&request.holder);
        rpc_span::record_bridge(&request.key);
        // Giving a lease up needs no assignment (a withdrawn bridge's drainer
        // still releases), only the agent's own id.
        require_own_agent(caller, &request.holder, "the lease holder")?;
        require_version(request.version)?;
        self.ctx
            .store
            .release_lease(&request.key, &request.holder, request.version)
            .await
            .map_err(state_status)
    }
}

#[tonic::async_trait]
impl LeaseService for LeaseServiceImpl {
    async fn acquire_lease(
        &self,
        request: Request<pb::AcquireLeaseRequest>,
    ) -> Result<Response<pb::AcquireLeaseResponse>, Status> {
        let caller = Caller::of(&request);
        let request = request.into_inner();
        let result = self.acquire(&caller.principal, &request).await;
        // A lease held by somebody else is left as it was: nothing to audit.
        let held_by_other = result.as_ref().is_ok_and(|r| {
            matches!(
                r.outcome,
                Some(pb::acquire_lease_response::Outcome::HeldByOther(_))
            )
        });
        if !held_by_other {
            audit_lease(&caller, Action::LeaseAcquire, &request.key, &result);
        }
        result.map(Response::new)
    }

    async fn renew_lease(
        &self,
        request: Request<pb::RenewLeaseRequest>,
    ) -> Result<Response<pb::RenewLeaseResponse>, Status> {
        let caller = Caller::of(&request).principal;
        let request = request.into_inner();
        require("key", &request.key)?;
        require("holder", &request.holder)?;
        rpc_span::record_agent(&request.holder);
        rpc_span::record_bridge(&request.key);
        self.authorize(&caller, &request.key, &request.holder)
            .await?;
        require_version(request.version)?;
        let ttl = positive_duration("ttl", request.ttl)?;
        let renewed = self
            .ctx
            .store
            .renew_lease(
                &request.key,
                &request.holder,
                request.version,
                ttl,
                self.ctx.options.clock.now(),
            )
            .await
            .map_err(state_status)?;
        Ok(Response::new(pb::RenewLeaseResponse {
            lease: Some(lease(renewed)),
        }))
    }

    async fn release_lease(
        &self,
        request: Request<pb::ReleaseLeaseRequest>,
    ) -> Result<Response<pb::ReleaseLeaseResponse>, Status> {
        let caller = Caller::of(&request);
        let request = request.into_inner();
        let result = self.release(&caller.principal, &request).await;
        audit_lease(&caller, Action::LeaseRelease, &request.key, &result);
        result.map(|()| Response::new(pb::ReleaseLeaseResponse {}))
    }

    async fn list_leases(
        &self,
        request: Request<pb::ListLeasesRequest>,
    ) -> Result<Response<pb::ListLeasesResponse>, Status> {
        let request = request.into_inner();
        let listed = self
            .ctx
            .store
            .list_leases(
                &request.key_prefix,
                page(request.page_size, request.page_token),
            )
            .await
            .map_err(state_status)?;
        Ok(Response::new(pb::ListLeasesResponse {
            leases: listed.items.into_iter().map(lease).collect(),
            next_page_token: listed.next_token.unwrap_or_default(),
        }))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use ferry_shared::audit::capture;
    use ferry_shared::auth::Principal;
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::services::{Context, Options};
    use crate::state::sqlite::SqliteStore;
    use crate::state::{AgentHello, ApplyConfig};

    fn by<T>(role: Role, message: T) -> Request<T> {
        let mut request = Request::new(message);
        request.extensions_mut().insert(Principal {
            name: format!("a-{role}"),
            role,
            agent_id: (role == Role::Agent).then(|| "edge-1".to_owned()),
        });
        request
    }

    fn acquire(holder: &str) -> pb::AcquireLeaseRequest {
        pb::AcquireLeaseRequest {
            key: "b1/main".into(),
            holder: holder.into(),
            ttl: Some(prost_types::Duration {
                seconds: 60,
                nanos: 0,
            }),
        }
    }

    #[tokio::test]
    async fn operators_lease_changes_are_audited_agents_routine_is_not() {
        let (captured, _guard) = capture::start();
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path().join("state.db"))
            .await
            .unwrap();
        let ctx = Context::new(
            std::sync::Arc::new(store),
            Options::default(),
            CancellationToken::new(),
        );
        // Bridge b1 is assigned to agent edge-1 (an empty selector matches
        // every agent), so its agent credential may hold b1's leases.
        ctx.store
            .upsert_agent(AgentHello {
                agent_id: "edge-1".into(),
                labels: Default::default(),
                build_version: String::new(),
                capabilities: Vec::new(),
                connected_at: std::time::SystemTime::now(),
            })
            .await
            .unwrap();
        ctx.store
            .apply_config(ApplyConfig {
                bridge_id: "b1".into(),
                yaml: "bridge:\n  id: b1\n".into(),
                selector: Default::default(),
                change_note: String::new(),
                expected_version: None,
                applied_by: Default::default(),
            })
            .await
            .unwrap();
        let service = LeaseServiceImpl::new(ctx);

        // An agent's own acquire, renewal and release: routine.
        let granted = service
            .acquire_lease(by(Role::Agent, acquire("edge-1")))
            .await
            .unwrap()
            .into_inner();
        let Some(pb::acquire_lease_response::Outcome::Granted(lease)) = granted.outcome else {
            panic!("{granted:?}");
        };
        service
            .renew_lease(by(
                Role::Agent,
                pb::RenewLeaseRequest {
                    key: lease.key.clone(),
                    holder: "edge-1".into(),
                    version: lease.version,
                    ttl: acquire("edge-1").ttl,
                },
            ))
            .await
            .unwrap();
        // An operator trying to take it while held changes nothing; then
        // releases the agent's lease and takes it.
        service
            .acquire_lease(by(Role::Operator, acquire("ops")))
            .await
            .unwrap();
        service
            .release_lease(by(
                Role::Operator,
                pb::ReleaseLeaseRequest {
                    key: lease.key.clone(),
                    holder: "edge-1".into(),
                    version: lease.version,
                },
            ))
            .await
            .unwrap();
        service
            .acquire_lease(by(Role::Admin, acquire("ops")))
            .await
            .unwrap();

        let events: Vec<[String; 5]> = captured
            .events()
            .into_iter()
            .map(|e| ["action", "principal", "bridge", "subject", "outcome"].map(|f| e[f].clone()))
            .collect();
        let expected = [
            ["lease.release", "a-operator", "b1", "key b1/main", "ok"],
            ["lease.acquire", "a-admin", "b1", "key b1/main", "ok"],
        ]
        .map(|row| row.map(str::to_owned));
        assert_eq!(events, expected);
    }
}
