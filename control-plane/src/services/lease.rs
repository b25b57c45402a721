//! LeaseService: leases with fencing versions, over the state store (which
//! decides and writes each grant in one transaction, so versions never
//! repeat, also between replicas). The control plane decides time: every
//! call reads [`Options::clock`](super::Options::clock), never the caller's.

use ferry_shared::api::v1 as pb;
use pb::lease_service_server::LeaseService;
use tonic::{Request, Response, Status};

use ferry_shared::auth::policy::require_own_agent;
use ferry_shared::auth::{Caller, Principal};

use super::Context;
use super::assignment::{lease_bridge, require_assigned};
use super::status::{page, positive_duration, require, state_status, timestamp};
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

#[tonic::async_trait]
impl LeaseService for LeaseServiceImpl {
    async fn acquire_lease(
        &self,
        request: Request<pb::AcquireLeaseRequest>,
    ) -> Result<Response<pb::AcquireLeaseResponse>, Status> {
        let caller = Caller::of(&request).principal;
        let request = request.into_inner();
        require("key", &request.key)?;
        require("holder", &request.holder)?;
        self.authorize(&caller, &request.key, &request.holder)
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
        Ok(Response::new(pb::AcquireLeaseResponse {
            outcome: Some(outcome),
        }))
    }

    async fn renew_lease(
        &self,
        request: Request<pb::RenewLeaseRequest>,
    ) -> Result<Response<pb::RenewLeaseResponse>, Status> {
        let caller = Caller::of(&request).principal;
        let request = request.into_inner();
        require("key", &request.key)?;
        require("holder", &request.holder)?;
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
        let caller = Caller::of(&request).principal;
        let request = request.into_inner();
        require("key", &request.key)?;
        require("holder", &request.holder)?;
        // Giving a lease up needs no assignment (a withdrawn bridge's drainer
        // still releases), only the agent's own id.
        require_own_agent(&caller, &request.holder, "the lease holder")?;
        require_version(request.version)?;
        self.ctx
            .store
            .release_lease(&request.key, &request.holder, request.version)
            .await
            .map_err(state_status)?;
        Ok(Response::new(pb::ReleaseLeaseResponse {}))
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
