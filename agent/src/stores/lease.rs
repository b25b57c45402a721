//! Lease types, and the shared lease rules ([`ferry_shared::lease`], with
//! their fencing argument) in the agent's terms: a backend loads a key's
//! [`LeaseState`], calls [`acquire`], [`renew`] or [`release`], and stores
//! the state they return in the same transaction.

use std::time::{Duration, SystemTime};

use ferry_shared::lease::{
    self as rules, AcquireDecision, LeaseRuleError, LeaseView, ReleaseDecision,
};

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

impl LeaseState {
    /// The row as the shared rules see it.
    fn view(&self) -> LeaseView<'_> {
        LeaseView {
            version: self.version,
            holder: self.grant.as_ref().map(|g| g.holder.as_str()),
            expires_at: self
                .grant
                .as_ref()
                .map_or(SystemTime::UNIX_EPOCH, |g| g.expires_at),
        }
    }
}

/// The agent's form of a refusal of the shared rules: a lost lease is
/// `Stale` (fenced out, certainly not applied).
fn refused(e: LeaseRuleError) -> StoreError {
    match e {
        LeaseRuleError::Invalid(m) => StoreError::Invalid(m),
        LeaseRuleError::Lost { .. } => StoreError::Stale(e.to_string()),
        LeaseRuleError::Exhausted(_) => StoreError::Conflict(e.to_string()),
    }
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
    let decision = rules::decide_acquire(
        current.as_ref().map(LeaseState::view),
        key,
        holder,
        ttl,
        now,
    )
    .map_err(refused)?;
    let mut state = current.unwrap_or_else(|| LeaseState {
        key: key.to_owned(),
        version: 0,
        grant: None,
    });
    match decision {
        AcquireDecision::HeldByOther => {
            let other = state
                .grant
                .as_ref()
                .map(|g| state.lease(g))
                .ok_or_else(|| StoreError::Corrupt(format!("lease {key}: held without a grant")))?;
            Ok((state, Acquired::HeldByOther(other)))
        }
        AcquireDecision::Grant {
            version,
            expires_at,
        } => {
            let grant = Grant {
                holder: holder.to_owned(),
                acquired_at: now,
                expires_at,
            };
            state.version = version;
            let lease = state.lease(&grant);
            state.grant = Some(grant);
            Ok((state, Acquired::Granted(lease)))
        }
    }
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
    let expires_at = rules::decide_renew(
        current.as_ref().map(LeaseState::view),
        key,
        holder,
        version,
        ttl,
        now,
    )
    .map_err(refused)?;
    let mut state = current.ok_or_else(|| StoreError::Stale(format!("lease {key}")))?;
    let grant = state
        .grant
        .take()
        .map(|g| Grant { expires_at, ..g })
        .ok_or_else(|| StoreError::Stale(format!("lease {key}")))?;
    let lease = state.lease(&grant);
    state.grant = Some(grant);
    Ok((state, lease))
}

/// Applies a release: the holder at `version` may (also after expiry, as
/// long as nobody else took it), and may again once released.
pub(crate) fn release(
    current: Option<LeaseState>,
    key: &str,
    holder: &str,
    version: u64,
) -> StoreResult<LeaseState> {
    let decision =
        rules::decide_release(current.as_ref().map(LeaseState::view), key, holder, version)
            .map_err(refused)?;
    let mut state = current.ok_or_else(|| StoreError::Stale(format!("lease {key}")))?;
    if decision == ReleaseDecision::Release {
        state.grant = None;
    }
    Ok(state)
}
