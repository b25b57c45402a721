//! The `LeaseStore` conformance suite (DESIGN §5.2): the rules of
//! [`ferry_shared::lease`] as every backend must apply them.

use std::time::Duration;

use super::{Harness, t, unique};
use crate::stores::{Acquired, Lease, LeaseStore, StoreError};

/// Instantiates every test of this suite for a backend:
/// `lease_conformance!(backend, make)` makes a module `backend` of
/// `#[tokio::test]`s, each calling `make().await` (an `async fn() -> (S,
/// Guard)` beside the macro call) for a fresh store.
#[macro_export]
macro_rules! lease_conformance {
    ($backend:ident, $make:ident) => {
        $crate::__store_conformance!(
            lease, $backend, $make;
            first_grant_is_exclusive,
            an_acquire_by_the_holder_itself_is_a_new_version,
            expired_lease_goes_to_another_with_higher_version,
            renew_only_by_the_live_holder_at_its_version,
            release_frees_at_once_and_versions_keep_rising,
            versions_survive_reopen,
            list_shows_every_key,
            invalid_arguments_are_refused,
        );
    };
}

const TTL: Duration = Duration::from_secs(15);

async fn granted<S: LeaseStore>(s: &S, key: &str, holder: &str, secs: u64) -> Lease {
    match s.acquire(key, holder, TTL, t(secs)).await {
        Ok(Acquired::Granted(l)) => l,
        other => panic!("{holder} did not get {key}: {other:?}"),
    }
}

fn assert_stale<T: std::fmt::Debug>(r: Result<T, StoreError>) {
    assert!(
        matches!(r, Err(StoreError::Stale(_))),
        "expected Stale, got {r:?}"
    );
}

pub async fn first_grant_is_exclusive<S: Harness + LeaseStore>(s: S) {
    let k = unique("k");
    let a = granted(&s, &k, "A", 0).await;
    assert_eq!(
        (a.version, a.acquired_at, a.expires_at),
        (1, t(0), t(0) + TTL)
    );
    assert_eq!((a.key.as_str(), a.holder.as_str()), (k.as_str(), "A"));
    assert_eq!(
        s.acquire(&k, "B", TTL, t(1)).await,
        Ok(Acquired::HeldByOther(a.clone()))
    );
}

/// A restart under the same holder id must fence out the previous run.
pub async fn an_acquire_by_the_holder_itself_is_a_new_version<S: Harness + LeaseStore>(s: S) {
    let k = unique("k");
    let a = granted(&s, &k, "A", 0).await;
    let again = granted(&s, &k, "A", 10).await;
    assert_eq!(
        (again.version, again.acquired_at, again.expires_at),
        (a.version + 1, t(10), t(10) + TTL)
    );
    assert_stale(s.renew(&k, "A", a.version, TTL, t(11)).await);
}

pub async fn expired_lease_goes_to_another_with_higher_version<S: Harness + LeaseStore>(s: S) {
    let k = unique("k");
    let a = granted(&s, &k, "A", 0).await;
    // Still A's one nanosecond before expiry; free at expiry.
    let before = t(0) + TTL - Duration::from_nanos(1);
    assert!(matches!(
        s.acquire(&k, "B", TTL, before).await,
        Ok(Acquired::HeldByOther(_))
    ));
    let b = granted(&s, &k, "B", 15).await;
    assert!(b.version > a.version);
    assert_stale(s.renew(&k, "A", a.version, TTL, t(16)).await);
    assert_stale(s.release(&k, "A", a.version).await);
    // A comes back after B expired: a version above B's.
    let a2 = granted(&s, &k, "A", 40).await;
    assert!(a2.version > b.version);
    // The same holder after its own expiry also gets a new version.
    let a3 = granted(&s, &k, "A", 100).await;
    assert!(a3.version > a2.version);
}

pub async fn renew_only_by_the_live_holder_at_its_version<S: Harness + LeaseStore>(s: S) {
    let k = unique("k");
    let a = granted(&s, &k, "A", 0).await;
    assert_stale(s.renew(&k, "B", a.version, TTL, t(1)).await);
    assert_stale(s.renew(&k, "A", a.version + 1, TTL, t(1)).await);
    let r = s
        .renew(&k, "A", a.version, TTL, t(10))
        .await
        .expect("renew");
    assert_eq!(
        (r.version, r.acquired_at, r.expires_at),
        (a.version, t(0), t(10) + TTL)
    );
    let s = s.reopen().await;
    // Renewed: B cannot take it at the old expiry.
    assert!(matches!(
        s.acquire(&k, "B", TTL, t(20)).await,
        Ok(Acquired::HeldByOther(_))
    ));
    // Too late: an expired lease is lost even if nobody took it.
    assert_stale(s.renew(&k, "A", a.version, TTL, t(25)).await);
    assert_stale(s.renew(&unique("none"), "A", 1, TTL, t(0)).await);
}

pub async fn release_frees_at_once_and_versions_keep_rising<S: Harness + LeaseStore>(s: S) {
    let k = unique("k");
    let a = granted(&s, &k, "A", 0).await;
    assert_stale(s.release(&k, "B", a.version).await);
    s.release(&k, "A", a.version).await.expect("release");
    // Repeatable, e.g. after the answer to the first one was lost.
    s.release(&k, "A", a.version).await.expect("release again");
    let b = granted(&s, &k, "B", 1).await;
    assert_stale(s.release(&k, "A", a.version).await);
    assert!(b.version > a.version);
    s.release(&k, "B", b.version).await.expect("release");
    let a2 = granted(&s, &k, "A", 2).await;
    assert!(a2.version > b.version);
    assert_stale(s.release(&unique("none"), "A", 1).await);
}

pub async fn versions_survive_reopen<S: Harness + LeaseStore>(s: S) {
    let k = unique("k");
    let mut last = 0;
    let mut s = s;
    for round in 0..3 {
        let l = granted(&s, &k, &format!("H{round}"), round * 100).await;
        assert!(l.version > last, "{} after {last}", l.version);
        last = l.version;
        s.release(&k, &l.holder, l.version).await.expect("release");
        s = s.reopen().await;
        if !S::DURABLE {
            break;
        }
    }
    if S::DURABLE {
        assert_eq!(last, 3);
    }
}

pub async fn list_shows_every_key<S: Harness + LeaseStore>(s: S) {
    let (k1, k2) = (unique("a"), unique("b"));
    let l1 = granted(&s, &k1, "A", 0).await;
    let l2 = granted(&s, &k2, "B", 0).await;
    s.release(&k2, "B", l2.version).await.expect("release");
    let s = s.reopen().await;
    let listed = s.list().await.expect("list");
    let mine: Vec<_> = listed
        .iter()
        .filter(|l| l.key == k1 || l.key == k2)
        .collect();
    assert_eq!(mine.len(), 2);
    assert_eq!(mine[0].key, k1);
    let g = mine[0].grant.as_ref().expect("held");
    assert_eq!(
        (mine[0].version, g.holder.as_str(), g.expires_at),
        (l1.version, "A", l1.expires_at)
    );
    assert_eq!((mine[1].version, &mine[1].grant), (l2.version, &None));
    let keys: Vec<&str> = listed.iter().map(|l| l.key.as_str()).collect();
    assert!(keys.windows(2).all(|w| w[0] < w[1]), "ordered by key");
}

pub async fn invalid_arguments_are_refused<S: Harness + LeaseStore>(s: S) {
    let invalid = |r: Result<Acquired, StoreError>| matches!(r, Err(StoreError::Invalid(_)));
    assert!(invalid(s.acquire("", "A", TTL, t(0)).await));
    assert!(invalid(s.acquire("k", "", TTL, t(0)).await));
    assert!(invalid(s.acquire("k", "A", Duration::ZERO, t(0)).await));
    assert!(s.list().await.expect("list").iter().all(|l| l.key != "k"));
}
