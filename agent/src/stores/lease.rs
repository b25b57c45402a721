//! Lease types and the grant rules every backend applies the same way: a
//! backend loads a key's [`LeaseState`], calls [`acquire`], [`renew`] or
//! [`release`], and stores the state they return in the same transaction.

use std::time::{Duration, SystemTime};

use super::{StoreError, StoreResult};

/// A lease granted to a holder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The lease key (`{bridge}/{partition}`).
    pub key: String,
    /// Who holds it.
    pub holder: String,
    /// The fencing version of this grant.
    pub version: u64,
    /// When the holder acquired it.
    pub acquired_at: SystemTime,
    /// When it lapses unless renewed.
    pub expires_at: SystemTime,
}

/// The result of `acquire`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Acquired {
    /// The caller holds the lease.
    Granted(Lease),
    /// Somebody else holds it, unexpired.
    HeldByOther(Lease),
}

/// A key's state, held or not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseState {
    /// The lease key.
    pub key: String,
    /// The last version granted.
    pub version: u64,
    /// The current grant; `None` after a release. A grant may have expired.
    pub grant: Option<Grant>,
}

/// Who a lease is granted to and until when.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The holder.
    pub holder: String,
    /// When it was acquired.
    pub acquired_at: SystemTime,
    /// When it lapses unless renewed.
    pub expires_at: SystemTime,
}

impl LeaseState {
    fn lease(&self, grant: &Grant) -> Lease {
        Lease {
            key: self.key.clone(),
            holder: grant.holder.clone(),
            version: self.version,
            acquired_at: grant.acquired_at,
            expires_at: grant.expires_at,
        }
    }

    /// The unexpired grant at `now`, if any.
    pub fn live_grant(&self, now: SystemTime) -> Option<&Grant> {
        self.grant.as_ref().filter(|g| g.expires_at > now)
    }
}

fn check(key: &str, holder: &str) -> StoreResult<()> {
    if key.is_empty() {
        return Err(StoreError::Invalid("empty lease key".into()));
    }
    if holder.is_empty() {
        return Err(StoreError::Invalid("empty lease holder".into()));
    }
    Ok(())
}

fn expiry(now: SystemTime, ttl: Duration) -> StoreResult<SystemTime> {
    if ttl.is_zero() {
        return Err(StoreError::Invalid("lease ttl must be positive".into()));
    }
    now.checked_add(ttl)
        .ok_or_else(|| StoreError::Invalid("lease ttl overflows the clock".into()))
}

/// Applies an acquire to `current` (`None` for a key never granted). Returns
/// the state to store (unchanged when held by another) and the outcome.
pub(crate) fn acquire(
    current: Option<LeaseState>,
    key: &str,
    holder: &str,
    ttl: Duration,
    now: SystemTime,
) -> StoreResult<(LeaseState, Acquired)> {
    check(key, holder)?;
    let expires_at = expiry(now, ttl)?;
    let mut state = current.unwrap_or_else(|| LeaseState {
        key: key.to_owned(),
        version: 0,
        grant: None,
    });
    match state.live_grant(now) {
        Some(g) if g.holder != holder => {
            let lease = state.lease(g);
            return Ok((state, Acquired::HeldByOther(lease)));
        }
        // The same holder, unexpired: same version, later expiry.
        Some(g) => {
            let acquired_at = g.acquired_at;
            state.grant = Some(Grant {
                holder: holder.to_owned(),
                acquired_at,
                expires_at,
            });
        }
        // Free or expired: a new grant, always above every earlier one.
        None => {
            state.version = state
                .version
                .checked_add(1)
                .ok_or_else(|| StoreError::Conflict(format!("lease {key}: versions exhausted")))?;
            state.grant = Some(Grant {
                holder: holder.to_owned(),
                acquired_at: now,
                expires_at,
            });
        }
    }
    let lease = match &state.grant {
        Some(g) => state.lease(g),
        None => return Err(StoreError::Conflict(format!("lease {key}: not granted"))),
    };
    Ok((state, Acquired::Granted(lease)))
}

fn lost(key: &str, holder: &str, version: u64) -> StoreError {
    StoreError::Stale(format!(
        "lease {key} is not held by {holder} at version {version}"
    ))
}

/// Applies a renew: only the unexpired holder at `version` may.
pub(crate) fn renew(
    current: Option<LeaseState>,
    key: &str,
    holder: &str,
    version: u64,
    ttl: Duration,
    now: SystemTime,
) -> StoreResult<(LeaseState, Lease)> {
    check(key, holder)?;
    let expires_at = expiry(now, ttl)?;
    let mut state = current.ok_or_else(|| StoreError::NotFound(format!("lease {key}")))?;
    let acquired_at = match state.live_grant(now) {
        Some(g) if g.holder == holder && state.version == version => g.acquired_at,
        _ => return Err(lost(key, holder, version)),
    };
    let grant = Grant {
        holder: holder.to_owned(),
        acquired_at,
        expires_at,
    };
    let lease = state.lease(&grant);
    state.grant = Some(grant);
    Ok((state, lease))
}

/// Applies a release: only the holder at `version` may (also after expiry,
/// as long as nobody else took it).
pub(crate) fn release(
    current: Option<LeaseState>,
    key: &str,
    holder: &str,
    version: u64,
) -> StoreResult<LeaseState> {
    check(key, holder)?;
    let mut state = current.ok_or_else(|| StoreError::NotFound(format!("lease {key}")))?;
    match &state.grant {
        Some(g) if g.holder == holder && state.version == version => {
            state.grant = None;
            Ok(state)
        }
        _ => Err(lost(key, holder, version)),
    }
}
