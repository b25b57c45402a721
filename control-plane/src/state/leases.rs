//! Leases in the state store's terms. The rules, and why they fence, are
//! [`ferry_shared::lease`]'s — the same ones the agent's lease stores apply.
//! A backend reads the key's row under a write lock, asks these functions
//! what the row becomes, writes it and commits.

use std::time::{Duration, SystemTime};

use ferry_shared::lease::{self as rules, LeaseRuleError, LeaseView, ReleaseDecision};

use super::codec::time_to_db;
use super::error::{StateError, StateResult};
use super::types::{Lease, LeaseAcquisition};

/// The listing kind of lease page tokens.
pub(crate) const PAGE_KIND: &str = "leases";

/// What an acquire does to the row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AcquireDecision {
    /// Write this lease and answer `Granted`.
    Grant(Lease),
    /// Change nothing and answer `HeldByOther`.
    HeldByOther(Lease),
}

impl AcquireDecision {
    /// The answer once the row is written (if it had to be).
    pub(crate) fn into_acquisition(self) -> LeaseAcquisition {
        match self {
            Self::Grant(lease) => LeaseAcquisition::Granted(lease),
            Self::HeldByOther(lease) => LeaseAcquisition::HeldByOther(lease),
        }
    }
}

fn view(lease: &Lease) -> LeaseView<'_> {
    LeaseView {
        version: lease.version,
        holder: lease.holder.as_deref(),
        expires_at: lease.expires_at,
    }
}

fn refused(e: LeaseRuleError) -> StateError {
    match e {
        LeaseRuleError::Invalid(m) => StateError::invalid(m),
        LeaseRuleError::Lost {
            key,
            holder,
            version,
        } => StateError::LeaseLost {
            key,
            holder,
            version,
        },
        LeaseRuleError::Exhausted(_) => StateError::corrupt(e.to_string()),
    }
}

/// An expiry the store can hold (the rules check the ttl, the store its range).
fn storable(expires_at: SystemTime) -> StateResult<SystemTime> {
    time_to_db(expires_at)?;
    Ok(expires_at)
}

/// Decides an acquire of `key` by `holder` given the key's current row.
pub(crate) fn decide_acquire(
    current: Option<Lease>,
    key: &str,
    holder: &str,
    ttl: Duration,
    now: SystemTime,
) -> StateResult<AcquireDecision> {
    match rules::decide_acquire(current.as_ref().map(view), key, holder, ttl, now)
        .map_err(refused)?
    {
        rules::AcquireDecision::Grant {
            version,
            expires_at,
        } => Ok(AcquireDecision::Grant(Lease {
            key: key.to_owned(),
            holder: Some(holder.to_owned()),
            version,
            acquired_at: now,
            expires_at: storable(expires_at)?,
        })),
        rules::AcquireDecision::HeldByOther => current
            .map(AcquireDecision::HeldByOther)
            .ok_or_else(|| StateError::corrupt(format!("lease {key:?} held without a row"))),
    }
}

/// Decides a renew: the new row, or `LeaseLost`.
pub(crate) fn decide_renew(
    current: Option<Lease>,
    key: &str,
    holder: &str,
    version: u64,
    ttl: Duration,
    now: SystemTime,
) -> StateResult<Lease> {
    let expires_at =
        rules::decide_renew(current.as_ref().map(view), key, holder, version, ttl, now)
            .map_err(refused)?;
    let lease = current
        .ok_or_else(|| StateError::corrupt(format!("lease {key:?} renewed without a row")))?;
    Ok(Lease {
        expires_at: storable(expires_at)?,
        ..lease
    })
}

/// Decides a release: the new row (`None`: already released by this
/// holder, nothing to write), or `LeaseLost`.
pub(crate) fn decide_release(
    current: Option<Lease>,
    key: &str,
    holder: &str,
    version: u64,
) -> StateResult<Option<Lease>> {
    let decision =
        rules::decide_release(current.as_ref().map(view), key, holder, version).map_err(refused)?;
    match (decision, current) {
        (ReleaseDecision::Release, Some(lease)) => Ok(Some(Lease {
            holder: None,
            ..lease
        })),
        _ => Ok(None),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    const TTL: Duration = Duration::from_secs(10);

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn granted(decision: AcquireDecision) -> Lease {
        match decision {
            AcquireDecision::Grant(lease) => lease,
            other => panic!("expected a grant, got {other:?}"),
        }
    }

    /// The shared rules' outcomes in rows: their own tests cover the rules.
    #[test]
    fn decisions_become_rows() {
        let first = granted(decide_acquire(None, "k", "a", TTL, at(0)).unwrap());
        assert_eq!(
            (first.version, first.holder.as_deref(), first.expires_at),
            (1, Some("a"), at(10))
        );
        let held = decide_acquire(Some(first.clone()), "k", "b", TTL, at(5)).unwrap();
        assert_eq!(held, AcquireDecision::HeldByOther(first.clone()));
        let renewed = decide_renew(Some(first.clone()), "k", "a", 1, TTL, at(5)).unwrap();
        assert_eq!((renewed.acquired_at, renewed.expires_at), (at(0), at(15)));
        let released = decide_release(Some(renewed), "k", "a", 1).unwrap().unwrap();
        assert_eq!((released.holder.as_deref(), released.version), (None, 1));
        assert_eq!(decide_release(Some(released), "k", "a", 1).unwrap(), None);
        assert!(matches!(
            decide_renew(None, "k", "a", 1, TTL, at(0)),
            Err(StateError::LeaseLost { .. })
        ));
        assert!(matches!(
            decide_acquire(None, "", "a", TTL, at(0)),
            Err(StateError::Invalid(_))
        ));
    }
}
