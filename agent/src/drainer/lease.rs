//! Keeping the partition lease: acquire, renew every `renew_interval`,
//! publish the held version (or `None`) on a watch channel.

use std::sync::Arc;
use std::time::SystemTime;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::Drainer;
use crate::stores::{Acquired, Lease};

/// Runs until `shutdown`; returns the version still held then (the caller
/// releases it once draining stopped).
pub(super) async fn keep(
    d: Arc<Drainer>,
    tx: watch::Sender<Option<u64>>,
    shutdown: CancellationToken,
) -> Option<u64> {
    fence_out_previous_incarnation(&d).await;
    let mut held: Option<Lease> = None;
    loop {
        let now = SystemTime::now();
        match &held {
            None => match d
                .leases
                .acquire(&d.partition, &d.holder, d.lease_ttl, now)
                .await
            {
                Ok(Acquired::Granted(lease)) => {
                    tracing::info!(partition = %d.partition, version = lease.version, "lease acquired");
                    tx.send_replace(Some(lease.version));
                    d.route_metrics.set_lease_held(true);
                    d.lease_resolved.set(true);
                    held = Some(lease);
                }
                Ok(Acquired::HeldByOther(lease)) => {
                    tracing::debug!(partition = %d.partition, holder = %lease.holder, "lease held by another agent");
                    d.lease_resolved.set(true);
                }
                Err(error) => {
                    tracing::warn!(partition = %d.partition, %error, "acquiring the lease failed");
                }
            },
            Some(lease) => {
                match d
                    .leases
                    .renew(&d.partition, &d.holder, lease.version, d.lease_ttl, now)
                    .await
                {
                    Ok(renewed) => held = Some(renewed),
                    Err(error)
                        if error.outcome_known() || SystemTime::now() >= lease.expires_at =>
                    {
                        tracing::warn!(partition = %d.partition, %error, "lease lost");
                        tx.send_replace(None);
                        d.route_metrics.set_lease_held(false);
                        held = None;
                    }
                    Err(error) => {
                        tracing::warn!(partition = %d.partition, %error, "renewing the lease failed; retrying");
                    }
                }
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = tokio::time::sleep(d.renew_interval) => {}
        }
    }
    held.map(|l| l.version)
}

/// A grant our own agent id still holds comes from a previous process that
/// died without releasing it: release it, so the next acquire gets a higher
/// version and takes back that process's claims at once.
async fn fence_out_previous_incarnation(d: &Drainer) {
    let Ok(states) = d.leases.list().await else {
        return;
    };
    let Some(state) = states.into_iter().find(|s| s.key == d.partition) else {
        return;
    };
    if state.grant.as_ref().is_some_and(|g| g.holder == d.holder) {
        match d
            .leases
            .release(&d.partition, &d.holder, state.version)
            .await
        {
            Ok(()) => tracing::info!(
                partition = %d.partition,
                version = state.version,
                "released the lease of a previous run of this agent"
            ),
            Err(error) => {
                tracing::warn!(partition = %d.partition, %error, "releasing an old lease failed")
            }
        }
    }
}
