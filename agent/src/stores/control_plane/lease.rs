//! [`LeaseStore`] over the control plane's `LeaseService`. The control plane
//! applies the shared lease rules ([`ferry_shared::lease`]) on its clock; the
//! expiry of a lease this store grants or renews is the caller's `now + ttl`
//! (see the module contract in [`super`]).
//!
//! An acquire or renew waits at most a third of its TTL (the default renew
//! interval) for the answer, and never more than [`REQUEST_TIMEOUT`]: a
//! control plane that stops answering makes the renewal fail `Timeout` while
//! the lease still has time left, so the drainer learns in time that it
//! could not renew.

use std::future::Future;
use std::time::{Duration, SystemTime};

use ferry_shared::api::v1 as pb;
use ferry_shared::auth::client::{AuthChannel, ClientAuth};
use ferry_shared::config::store::ControlPlaneOptions;
use pb::acquire_lease_response::Outcome;
use pb::lease_service_client::LeaseServiceClient;

use super::{REQUEST_TIMEOUT, Service, channel, store_error, time};
use crate::stores::{
    Acquired, BoxFuture, Grant, Lease, LeaseState, LeaseStore, StoreError, StoreResult,
};

/// Leases kept by the control plane.
#[derive(Clone, Debug)]
pub struct ControlPlaneLeaseStore {
    client: LeaseServiceClient<AuthChannel>,
}

/// How many leases one `ListLeases` page asks for.
const LIST_PAGE_SIZE: u32 = 1000;

impl ControlPlaneLeaseStore {
    /// A store over the endpoint of `options`; connects on first use.
    /// `Invalid` when the endpoint is unset or malformed.
    pub fn open(options: &ControlPlaneOptions, client: &ClientAuth) -> StoreResult<Self> {
        Ok(Self {
            client: LeaseServiceClient::new(channel("lease", options, client)?),
        })
    }
}

/// The request's ttl; a zero one is refused here, as the control plane would
/// (the answer could otherwise lose the race with a zero wait).
fn ttl(ttl: Duration) -> StoreResult<prost_types::Duration> {
    if ttl.is_zero() {
        return Err(StoreError::Invalid("the lease ttl must be positive".into()));
    }
    prost_types::Duration::try_from(ttl)
        .map_err(|_| StoreError::Invalid(format!("ttl {ttl:?} is out of range")))
}

fn err(status: tonic::Status) -> StoreError {
    store_error(Service::Lease, &status)
}

/// A lease as the control plane reported it.
fn observed(l: pb::Lease) -> StoreResult<Lease> {
    Ok(Lease {
        acquired_at: time("lease.acquired_at", l.acquired_at)?,
        expires_at: time("lease.expires_at", l.expires_at)?,
        key: l.key,
        holder: l.holder,
        version: l.version,
    })
}

/// A lease the caller holds: its expiry counted on the caller's clock.
fn held(l: Option<pb::Lease>, expires_at: Option<SystemTime>) -> StoreResult<Lease> {
    let l = l.ok_or_else(|| StoreError::Corrupt("control plane: lease missing".into()))?;
    let mut lease = observed(l)?;
    if let Some(at) = expires_at {
        lease.expires_at = at;
    }
    Ok(lease)
}

fn deadline(now: SystemTime, ttl: Duration) -> Option<SystemTime> {
    now.checked_add(ttl)
}

/// `call`, given at most a third of `ttl` (and [`REQUEST_TIMEOUT`]).
async fn within_ttl<T>(
    ttl: Duration,
    call: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> StoreResult<T> {
    let limit = (ttl / 3).min(REQUEST_TIMEOUT);
    match tokio::time::timeout(limit, call).await {
        Ok(answer) => Ok(answer.map_err(err)?.into_inner()),
        Err(_) => Err(StoreError::Timeout(format!(
            "control plane: no answer within {limit:?} (a third of the lease ttl)"
        ))),
    }
}

impl LeaseStore for ControlPlaneLeaseStore {
    fn acquire<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        ttl_: Duration,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Acquired>> {
        Box::pin(async move {
            let request = pb::AcquireLeaseRequest {
                key: key.to_owned(),
                holder: holder.to_owned(),
                ttl: Some(ttl(ttl_)?),
            };
            let mut client = self.client.clone();
            let response = within_ttl(ttl_, client.acquire_lease(request)).await?;
            match response.outcome {
                Some(Outcome::Granted(l)) => {
                    Ok(Acquired::Granted(held(Some(l), deadline(now, ttl_))?))
                }
                Some(Outcome::HeldByOther(l)) => Ok(Acquired::HeldByOther(observed(l)?)),
                None => Err(StoreError::Corrupt(
                    "control plane: AcquireLease answered without an outcome".into(),
                )),
            }
        })
    }

    fn renew<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
        ttl_: Duration,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Lease>> {
        Box::pin(async move {
            let request = pb::RenewLeaseRequest {
                key: key.to_owned(),
                holder: holder.to_owned(),
                version,
                ttl: Some(ttl(ttl_)?),
            };
            let mut client = self.client.clone();
            let response = within_ttl(ttl_, client.renew_lease(request)).await?;
            held(response.lease, deadline(now, ttl_))
        })
    }

    fn release<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
    ) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(async move {
            let request = pb::ReleaseLeaseRequest {
                key: key.to_owned(),
                holder: holder.to_owned(),
                version,
            };
            self.client
                .clone()
                .release_lease(request)
                .await
                .map_err(err)?;
            Ok(())
        })
    }

    fn list(&self) -> BoxFuture<'_, StoreResult<Vec<LeaseState>>> {
        Box::pin(async move {
            let mut states = Vec::new();
            let mut page_token = String::new();
            loop {
                let request = pb::ListLeasesRequest {
                    key_prefix: String::new(),
                    page_size: LIST_PAGE_SIZE,
                    page_token,
                };
                let page = self
                    .client
                    .clone()
                    .list_leases(request)
                    .await
                    .map_err(err)?
                    .into_inner();
                for l in page.leases {
                    let grant = if l.holder.is_empty() {
                        None
                    } else {
                        Some(Grant {
                            acquired_at: time("lease.acquired_at", l.acquired_at)?,
                            expires_at: time("lease.expires_at", l.expires_at)?,
                            holder: l.holder,
                        })
                    };
                    states.push(LeaseState {
                        key: l.key,
                        version: l.version,
                        grant,
                    });
                }
                if page.next_page_token.is_empty() {
                    return Ok(states);
                }
                page_token = page.next_page_token;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    /// A control plane that accepts connections and never answers: acquire and renew fail
    /// `Timeout` within a third of the TTL, not after the lease would have expired.
    #[tokio::test]
    async fn a_silent_control_plane_times_out_within_a_third_of_the_ttl() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("address");
        let accepted = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
            }
        });
        let store = ControlPlaneLeaseStore::open(
            &ControlPlaneOptions {
                endpoint: Some(format!("http://{addr}")),
            },
            &ClientAuth::default(),
        )
        .expect("open");
        let ttl = Duration::from_millis(900);
        let started = Instant::now();
        let acquired = store.acquire("k", "A", ttl, SystemTime::now()).await;
        assert!(
            matches!(acquired, Err(StoreError::Timeout(_))),
            "{acquired:?}"
        );
        let renewed = store.renew("k", "A", 1, ttl, SystemTime::now()).await;
        assert!(
            matches!(renewed, Err(StoreError::Timeout(_))),
            "{renewed:?}"
        );
        assert!(started.elapsed() < ttl, "{:?}", started.elapsed());
        accepted.abort();
    }

    #[tokio::test]
    async fn an_unreachable_control_plane_is_unavailable() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("address");
        drop(listener);
        let store = ControlPlaneLeaseStore::open(
            &ControlPlaneOptions {
                endpoint: Some(format!("http://{addr}")),
            },
            &ClientAuth::default(),
        )
        .expect("open");
        let acquired = store
            .acquire("k", "A", Duration::from_secs(15), SystemTime::now())
            .await;
        assert!(
            matches!(acquired, Err(StoreError::Unavailable(_))),
            "{acquired:?}"
        );
        let listed = store.list().await;
        assert!(
            matches!(listed, Err(StoreError::Unavailable(_))),
            "{listed:?}"
        );
    }
}
