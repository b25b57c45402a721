//! The lease rules, once, for every lease backend: the agent's `memory` and `sqlite` lease
//! stores and the control plane's state stores (SQLite, PostgreSQL) behind its LeaseService.
//!
//! A backend reads a key's row inside a transaction, shows it to these pure functions as a
//! [`LeaseView`], writes what they decide, and commits. Keeping the decisions here means the
//! fencing argument below holds whichever store a partition's lease lives in.
//!
//! # The rules
//!
//! 1. **Every acquire is a new version.** A key that is free (never granted, released) or
//!    expired, or held by the caller itself, is granted at `last version + 1`. Only renew
//!    extends a holding. A live grant of another holder is reported and left alone.
//! 2. **Renew extends only a live grant**, of the caller, at the caller's version. After its
//!    expiry a grant cannot be renewed, even if nobody took it meanwhile: the holder must
//!    acquire again and gets a new version.
//! 3. **Release** ends the grant of the caller at the caller's version, live or expired, as
//!    long as nobody took it since. Releasing what the caller already released (the key is
//!    free and still at that version) succeeds and changes nothing, so a release can be
//!    retried after an answer was lost.
//! 4. A renew or release that does not match is [`LeaseRuleError::Lost`]; a version that
//!    cannot grow is [`LeaseRuleError::Exhausted`]. Both change nothing.
//!
//! # Why this fences
//!
//! A fencing version must name one holding by one process, so that an outbox that has seen
//! version `v` can refuse everything done under an older one. Rule 1 makes that true even for
//! a holder that restarts under the same id (its previous run's claims are older, so the
//! outbox takes them back at once) and for a holder whose grant lapsed while it was paused
//! (it may still be writing under the old version; the new one fences those writes out).
//! Rule 2 keeps a holder's idea of "I may write until `expires_at`" the same as the store's:
//! once a grant expired, the only way back is a new version. Versions never repeat because a
//! key's row is never deleted (release keeps the version) and rule 1 only ever adds one.

use std::time::{Duration, SystemTime};

/// A key's row as the rules need it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseView<'a> {
    /// The last version granted.
    pub version: u64,
    /// The holder of the current (or lapsed) grant; `None` once released.
    pub holder: Option<&'a str>,
    /// When the current grant lapses unless renewed (meaningless without a holder).
    pub expires_at: SystemTime,
}

impl LeaseView<'_> {
    /// True while `holder` holds it and it has not expired at `now`.
    fn is_live(&self, now: SystemTime) -> bool {
        self.holder.is_some() && self.expires_at > now
    }

    fn is_held_by(&self, holder: &str, version: u64) -> bool {
        self.holder == Some(holder) && self.version == version
    }
}

/// What an acquire does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcquireDecision {
    /// Write a grant to the caller: this version, acquired now, lapsing at `expires_at`.
    Grant {
        /// The new version (always above every earlier one of the key).
        version: u64,
        /// When it lapses unless renewed.
        expires_at: SystemTime,
    },
    /// Another holder's grant is live: change nothing, report it.
    HeldByOther,
}

/// What a release does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseDecision {
    /// Clear the holder; keep the version.
    Release,
    /// Already released at this version: nothing to write.
    AlreadyReleased,
}

/// A lease operation the rules refuse. Nothing was changed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LeaseRuleError {
    /// The request is malformed (empty key or holder, zero or overflowing ttl).
    #[error("invalid lease request: {0}")]
    Invalid(String),
    /// The caller does not hold the key at that version (never held, released, expired, or
    /// taken by another holder).
    #[error("lease {key:?} is not held by {holder:?} at version {version}")]
    Lost {
        /// The lease key.
        key: String,
        /// The holder the caller claimed to be.
        holder: String,
        /// The version the caller claimed to hold.
        version: u64,
    },
    /// The key's version cannot grow any more.
    #[error("lease {0:?}: fencing versions exhausted")]
    Exhausted(String),
}

fn check(key: &str, holder: &str) -> Result<(), LeaseRuleError> {
    if key.is_empty() {
        return Err(LeaseRuleError::Invalid(
            "the lease key must not be empty".into(),
        ));
    }
    if holder.is_empty() {
        return Err(LeaseRuleError::Invalid(
            "the lease holder must not be empty".into(),
        ));
    }
    Ok(())
}

/// When a grant made at `now` for `ttl` lapses.
pub fn expiry(now: SystemTime, ttl: Duration) -> Result<SystemTime, LeaseRuleError> {
    if ttl.is_zero() {
        return Err(LeaseRuleError::Invalid(
            "the lease ttl must be positive".into(),
        ));
    }
    now.checked_add(ttl)
        .ok_or_else(|| LeaseRuleError::Invalid("the lease ttl is too large".into()))
}

fn lost(key: &str, holder: &str, version: u64) -> LeaseRuleError {
    LeaseRuleError::Lost {
        key: key.to_owned(),
        holder: holder.to_owned(),
        version,
    }
}

/// Rule 1: an acquire of `key` by `holder` at `now`, given the key's row (`None`: never
/// granted).
pub fn decide_acquire(
    current: Option<LeaseView<'_>>,
    key: &str,
    holder: &str,
    ttl: Duration,
    now: SystemTime,
) -> Result<AcquireDecision, LeaseRuleError> {
    check(key, holder)?;
    let expires_at = expiry(now, ttl)?;
    let last = match current {
        Some(view) if view.is_live(now) && view.holder != Some(holder) => {
            return Ok(AcquireDecision::HeldByOther);
        }
        Some(view) => view.version,
        None => 0,
    };
    let version = last
        .checked_add(1)
        .ok_or_else(|| LeaseRuleError::Exhausted(key.to_owned()))?;
    Ok(AcquireDecision::Grant {
        version,
        expires_at,
    })
}

/// Rule 2: a renew; returns the new expiry.
pub fn decide_renew(
    current: Option<LeaseView<'_>>,
    key: &str,
    holder: &str,
    version: u64,
    ttl: Duration,
    now: SystemTime,
) -> Result<SystemTime, LeaseRuleError> {
    check(key, holder)?;
    let expires_at = expiry(now, ttl)?;
    match current {
        Some(view) if view.is_held_by(holder, version) && view.is_live(now) => Ok(expires_at),
        _ => Err(lost(key, holder, version)),
    }
}

/// Rule 3: a release.
pub fn decide_release(
    current: Option<LeaseView<'_>>,
    key: &str,
    holder: &str,
    version: u64,
) -> Result<ReleaseDecision, LeaseRuleError> {
    check(key, holder)?;
    match current {
        Some(view) if view.is_held_by(holder, version) => Ok(ReleaseDecision::Release),
        Some(view) if view.holder.is_none() && view.version == version => {
            Ok(ReleaseDecision::AlreadyReleased)
        }
        _ => Err(lost(key, holder, version)),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::UNIX_EPOCH;

    use super::*;

    const TTL: Duration = Duration::from_secs(10);

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn view(version: u64, holder: Option<&str>, expires: u64) -> Option<LeaseView<'_>> {
        Some(LeaseView {
            version,
            holder,
            expires_at: at(expires),
        })
    }

    fn granted(decision: AcquireDecision) -> u64 {
        match decision {
            AcquireDecision::Grant { version, .. } => version,
            AcquireDecision::HeldByOther => panic!("expected a grant"),
        }
    }

    #[test]
    fn every_acquire_is_a_new_version() {
        assert_eq!(
            decide_acquire(None, "k", "a", TTL, at(0)).unwrap(),
            AcquireDecision::Grant {
                version: 1,
                expires_at: at(10)
            }
        );
        // The holder itself, live (a restart under the same id): a new version.
        assert_eq!(
            granted(decide_acquire(view(1, Some("a"), 10), "k", "a", TTL, at(5)).unwrap()),
            2
        );
        // The holder itself after expiry, nobody took it: a new version.
        assert_eq!(
            granted(decide_acquire(view(2, Some("a"), 15), "k", "a", TTL, at(20)).unwrap()),
            3
        );
        // Another holder: live → refused, expired → taken, released → taken.
        assert_eq!(
            decide_acquire(view(3, Some("a"), 30), "k", "b", TTL, at(29)).unwrap(),
            AcquireDecision::HeldByOther
        );
        assert_eq!(
            granted(decide_acquire(view(3, Some("a"), 30), "k", "b", TTL, at(30)).unwrap()),
            4
        );
        assert_eq!(
            granted(decide_acquire(view(4, None, 30), "k", "b", TTL, at(31)).unwrap()),
            5
        );
    }

    #[test]
    fn renew_needs_a_live_grant_of_the_caller_at_its_version() {
        let live = view(1, Some("a"), 10);
        assert_eq!(decide_renew(live, "k", "a", 1, TTL, at(5)), Ok(at(15)));
        assert!(matches!(
            decide_renew(live, "k", "b", 1, TTL, at(5)),
            Err(LeaseRuleError::Lost { .. })
        ));
        assert!(decide_renew(live, "k", "a", 2, TTL, at(5)).is_err());
        assert!(
            decide_renew(live, "k", "a", 1, TTL, at(10)).is_err(),
            "expired, even though nobody took it"
        );
        assert!(decide_renew(view(1, None, 10), "k", "a", 1, TTL, at(5)).is_err());
        assert!(decide_renew(None, "k", "a", 1, TTL, at(5)).is_err());
    }

    #[test]
    fn release_is_for_the_holder_and_can_be_repeated() {
        assert_eq!(
            decide_release(view(1, Some("a"), 10), "k", "a", 1),
            Ok(ReleaseDecision::Release)
        );
        assert_eq!(
            decide_release(view(1, Some("a"), 10), "k", "a", 1),
            decide_release(view(1, Some("a"), 5), "k", "a", 1),
            "live or expired alike"
        );
        assert_eq!(
            decide_release(view(1, None, 10), "k", "a", 1),
            Ok(ReleaseDecision::AlreadyReleased)
        );
        assert!(decide_release(view(2, None, 10), "k", "a", 1).is_err());
        assert!(decide_release(view(2, Some("b"), 20), "k", "a", 1).is_err());
        assert!(decide_release(None, "k", "a", 1).is_err());
    }

    #[test]
    fn refusals() {
        assert!(matches!(
            decide_acquire(None, "", "a", TTL, at(0)),
            Err(LeaseRuleError::Invalid(_))
        ));
        assert!(matches!(
            decide_acquire(None, "k", "", TTL, at(0)),
            Err(LeaseRuleError::Invalid(_))
        ));
        assert!(matches!(
            decide_acquire(None, "k", "a", Duration::ZERO, at(0)),
            Err(LeaseRuleError::Invalid(_))
        ));
        assert!(matches!(
            decide_acquire(None, "k", "a", Duration::MAX, at(0)),
            Err(LeaseRuleError::Invalid(_))
        ));
        assert_eq!(
            decide_acquire(view(u64::MAX, None, 0), "k", "a", TTL, at(1)),
            Err(LeaseRuleError::Exhausted("k".into()))
        );
    }
}
