//! Lease decisions, shared by every backend. A backend reads the key's row
//! under a write lock, asks these functions what the row becomes, writes it
//! and commits; the rules live here once.
//!
//! Rules: a free (never held or released) or expired lease goes to a new
//! holder at `last version + 1`; the same holder re-acquiring keeps its
//! version and gets a new expiry (also after its expiry, as long as nobody
//! took it meanwhile: no other holder ever had a version in between); a live
//! lease of another holder is reported, not changed. Renew and release need
//! the holder and version of the row.

use std::time::{Duration, SystemTime};

use super::codec::{expiry, require_id};
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

/// Decides an acquire of `key` by `holder` given the key's current row.
pub(crate) fn decide_acquire(
    current: Option<Lease>,
    key: &str,
    holder: &str,
    ttl: Duration,
    now: SystemTime,
) -> StateResult<AcquireDecision> {
    require_id("lease key", key)?;
    require_id("lease holder", holder)?;
    let expires_at = expiry(now, ttl)?;
    let Some(current) = current else {
        return Ok(AcquireDecision::Grant(Lease {
            key: key.to_owned(),
            holder: Some(holder.to_owned()),
            version: 1,
            acquired_at: now,
            expires_at,
        }));
    };
    match current.holder.as_deref() {
        Some(h) if h == holder => Ok(AcquireDecision::Grant(Lease {
            expires_at,
            ..current
        })),
        Some(_) if now < current.expires_at => Ok(AcquireDecision::HeldByOther(current)),
        _ => {
            let version = current
                .version
                .checked_add(1)
                .ok_or_else(|| StateError::corrupt(format!("lease {key:?} version overflow")))?;
            Ok(AcquireDecision::Grant(Lease {
                key: key.to_owned(),
                holder: Some(holder.to_owned()),
                version,
                acquired_at: now,
                expires_at,
            }))
        }
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
    require_id("lease key", key)?;
    require_id("lease holder", holder)?;
    let expires_at = expiry(now, ttl)?;
    match current {
        Some(lease) if is_held_by(&lease, holder, version) => Ok(Lease {
            expires_at,
            ..lease
        }),
        _ => Err(lost(key, holder, version)),
    }
}

/// Decides a release: the new row (`None`: already released by this
/// holder, nothing to write), or `LeaseLost`.
pub(crate) fn decide_release(
    current: Option<Lease>,
    key: &str,
    holder: &str,
    version: u64,
) -> StateResult<Option<Lease>> {
    require_id("lease key", key)?;
    require_id("lease holder", holder)?;
    match current {
        Some(lease) if is_held_by(&lease, holder, version) => Ok(Some(Lease {
            holder: None,
            ..lease
        })),
        Some(lease) if lease.holder.is_none() && lease.version == version => Ok(None),
        _ => Err(lost(key, holder, version)),
    }
}

fn is_held_by(lease: &Lease, holder: &str, version: u64) -> bool {
    lease.holder.as_deref() == Some(holder) && lease.version == version
}

fn lost(key: &str, holder: &str, version: u64) -> StateError {
    StateError::LeaseLost {
        key: key.to_owned(),
        holder: holder.to_owned(),
        version,
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

    #[test]
    fn acquire_rules() {
        let first = granted(decide_acquire(None, "k", "a", TTL, at(0)).unwrap());
        assert_eq!(first.version, 1);
        let again = granted(decide_acquire(Some(first.clone()), "k", "a", TTL, at(5)).unwrap());
        assert_eq!((again.version, again.expires_at), (1, at(15)));
        assert!(matches!(
            decide_acquire(Some(again.clone()), "k", "b", TTL, at(14)).unwrap(),
            AcquireDecision::HeldByOther(_)
        ));
        let taken = granted(decide_acquire(Some(again), "k", "b", TTL, at(15)).unwrap());
        assert_eq!((taken.version, taken.holder.as_deref()), (2, Some("b")));
        let released = decide_release(Some(taken), "k", "b", 2).unwrap().unwrap();
        let next = granted(decide_acquire(Some(released), "k", "a", TTL, at(16)).unwrap());
        assert_eq!(next.version, 3);
    }

    #[test]
    fn renew_and_release_need_holder_and_version() {
        let lease = granted(decide_acquire(None, "k", "a", TTL, at(0)).unwrap());
        assert!(decide_renew(Some(lease.clone()), "k", "b", 1, TTL, at(1)).is_err());
        assert!(decide_renew(Some(lease.clone()), "k", "a", 2, TTL, at(1)).is_err());
        assert_eq!(
            decide_renew(Some(lease.clone()), "k", "a", 1, TTL, at(1))
                .unwrap()
                .expires_at,
            at(11)
        );
        assert!(decide_release(Some(lease.clone()), "k", "b", 1).is_err());
        let released = decide_release(Some(lease), "k", "a", 1).unwrap().unwrap();
        assert_eq!(
            decide_release(Some(released.clone()), "k", "a", 1).unwrap(),
            None
        );
        assert!(decide_renew(Some(released), "k", "a", 1, TTL, at(2)).is_err());
    }

    #[test]
    fn invalid_requests() {
        assert!(matches!(
            decide_acquire(None, "", "a", TTL, at(0)),
            Err(StateError::Invalid(_))
        ));
        assert!(matches!(
            decide_acquire(None, "k", "a", Duration::ZERO, at(0)),
            Err(StateError::Invalid(_))
        ));
    }
}
