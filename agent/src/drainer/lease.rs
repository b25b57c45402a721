//! Keeping the partition lease: acquire, renew every `renew_interval`,
//! publish the held version (or `None`) on a watch channel.
//!
//! The held version is withdrawn (draining stops) when a renew is refused,
//! and at the latest when the grant expires: a renew is never awaited past
//! `expires_at`, and the loop wakes at `expires_at` if that comes before the
//! next renewal — whatever the lease store (a remote one may hang).
//!
//! A grant our agent id still holds from a previous run of this agent needs
//! no clean-up: every acquire is granted a new version (ADR 0004), so the
//! first claim under it takes that run's claims back.

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
    let mut held: Option<Lease> = None;
    // When another agent's grant lapses unless renewed: the next acquire is
    // tried then rather than up to a `renew_interval` later, so a dead
    // holder is replaced about one lease TTL after its last renewal.
    let mut other_expires: Option<SystemTime> = None;
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
                    d.set_held_until(Some(lease.expires_at));
                    tx.send_replace(Some(lease.version));
                    d.route_metrics.set_lease_held(true);
                    d.lease_resolved.set(true);
                    held = Some(lease);
                }
                Ok(Acquired::HeldByOther(lease)) => {
                    tracing::debug!(partition = %d.partition, holder = %lease.holder, "lease held by another agent");
                    d.lease_resolved.set(true);
                    other_expires = Some(lease.expires_at);
                }
                Err(error) => {
                    tracing::debug!(partition = %d.partition, %error, "acquiring the lease failed; the store observer logs the failure");
                }
            },
            Some(lease) => {
                // A renew that answers after the grant expired is worth
                // nothing: never wait past `expires_at`, whatever the store.
                let left = lease.expires_at.duration_since(now).unwrap_or_default();
                let renewed = tokio::time::timeout(
                    left,
                    d.leases
                        .renew(&d.partition, &d.holder, lease.version, d.lease_ttl, now),
                )
                .await;
                match renewed {
                    Ok(Ok(renewed)) => {
                        d.set_held_until(Some(renewed.expires_at));
                        held = Some(renewed);
                    }
                    Ok(Err(error))
                        if error.outcome_known() || SystemTime::now() >= lease.expires_at =>
                    {
                        tracing::warn!(partition = %d.partition, %error, "lease lost");
                        lose(&d, &tx, &mut held);
                    }
                    Ok(Err(error)) => {
                        tracing::debug!(partition = %d.partition, %error, "renewing the lease failed; retrying");
                    }
                    Err(_) => {
                        tracing::warn!(partition = %d.partition, version = lease.version, "lease expired before it could be renewed");
                        lose(&d, &tx, &mut held);
                    }
                }
            }
        }
        // While holding, wake no later than the grant's expiry: a lease that
        // could not be renewed stops draining at `expires_at`, not one
        // `renew_interval` after it.
        let until = |at: SystemTime| at.duration_since(SystemTime::now()).unwrap_or_default();
        let pause = match (&held, other_expires.take()) {
            (Some(lease), _) => d.renew_interval.min(until(lease.expires_at)),
            // Not sooner than a tenth of the interval: a holder whose
            // clock runs behind ours is not polled in a tight loop.
            (None, Some(at)) => d.renew_interval.min(until(at).max(d.renew_interval / 10)),
            (None, None) => d.renew_interval,
        };
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = tokio::time::sleep(pause) => {}
        }
    }
    held.map(|l| l.version)
}

/// Stops draining under the held grant.
fn lose(d: &Drainer, tx: &watch::Sender<Option<u64>>, held: &mut Option<Lease>) {
    d.set_held_until(None);
    tx.send_replace(None);
    d.route_metrics.set_lease_held(false);
    *held = None;
}
