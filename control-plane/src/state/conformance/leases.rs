//! Leases and their fencing versions.

use std::time::Duration;

use super::{TestBackend, at, id};
use crate::state::{Lease, LeaseAcquisition, PageRequest, StateError, StateStore};

const TTL: Duration = Duration::from_secs(10);

async fn granted(store: &impl StateStore, key: &str, holder: &str, secs: u64) -> Lease {
    match store
        .acquire_lease(key, holder, TTL, at(secs))
        .await
        .unwrap()
    {
        LeaseAcquisition::Granted(lease) => lease,
        other => panic!("{holder} expected a grant of {key}, got {other:?}"),
    }
}

pub(crate) async fn lease_versions_strictly_increase(backend: &impl TestBackend) {
    let store = backend.open().await;
    let key = id("bridge") + "/route";
    let first = granted(&store, &key, "a", 0).await;
    assert_eq!((first.version, first.holder.as_deref()), (1, Some("a")));
    assert_eq!((first.acquired_at, first.expires_at), (at(0), at(10)));

    // The holder itself acquiring again (a restart under the same id): a new version.
    let again = granted(&store, &key, "a", 4).await;
    assert_eq!(
        (again.version, again.acquired_at, again.expires_at),
        (2, at(4), at(14))
    );

    match store.acquire_lease(&key, "b", TTL, at(13)).await.unwrap() {
        LeaseAcquisition::HeldByOther(lease) => assert_eq!(lease, again),
        other => panic!("expected held by a, got {other:?}"),
    }
    let taken = granted(&store, &key, "b", 14).await;
    assert_eq!((taken.version, taken.holder.as_deref()), (3, Some("b")));

    let renewed = store.renew_lease(&key, "b", 3, TTL, at(20)).await.unwrap();
    assert_eq!((renewed.version, renewed.expires_at), (3, at(30)));
    store.release_lease(&key, "b", 3).await.unwrap();
    let after_release = granted(&store, &key, "a", 21).await;
    assert_eq!(after_release.version, 4);
    // The same holder, after its lease expired but before anybody took it,
    // gets a new version too (it cannot renew the expired one).
    let lost = store.renew_lease(&key, "a", 4, TTL, at(100)).await;
    assert!(
        matches!(lost, Err(StateError::LeaseLost { .. })),
        "{lost:?}"
    );
    assert_eq!(granted(&store, &key, "a", 100).await.version, 5);
}

pub(crate) async fn lease_renew_and_release_only_by_holder(backend: &impl TestBackend) {
    let store = backend.open().await;
    let key = id("bridge") + "/route";
    let lost = |r: Result<(), StateError>| matches!(r, Err(StateError::LeaseLost { .. }));
    assert!(lost(
        store.renew_lease(&key, "a", 1, TTL, at(0)).await.map(drop)
    ));
    assert!(lost(store.release_lease(&key, "a", 1).await));

    granted(&store, &key, "a", 0).await;
    assert!(lost(
        store.renew_lease(&key, "b", 1, TTL, at(1)).await.map(drop)
    ));
    assert!(lost(
        store.renew_lease(&key, "a", 2, TTL, at(1)).await.map(drop)
    ));
    assert!(lost(store.release_lease(&key, "b", 1).await));

    // Expired and taken by b: a can neither renew nor release any more.
    granted(&store, &key, "b", 11).await;
    assert!(lost(
        store.renew_lease(&key, "a", 1, TTL, at(12)).await.map(drop)
    ));
    assert!(lost(store.release_lease(&key, "a", 1).await));

    store.release_lease(&key, "b", 2).await.unwrap();
    store.release_lease(&key, "b", 2).await.unwrap();
    assert!(lost(
        store.renew_lease(&key, "b", 2, TTL, at(13)).await.map(drop)
    ));
    let listed = store
        .list_leases(&key, PageRequest::default())
        .await
        .unwrap();
    assert_eq!(listed.items.len(), 1);
    assert_eq!(
        (listed.items[0].holder.as_deref(), listed.items[0].version),
        (None, 2)
    );
}

pub(crate) async fn lease_versions_survive_reopen(backend: &impl TestBackend) {
    let key = id("bridge") + "/route";
    {
        let store = backend.open().await;
        for (n, holder) in ["a", "b", "c"].into_iter().enumerate() {
            let lease = granted(&store, &key, holder, n as u64).await;
            assert_eq!(lease.version, n as u64 + 1);
            store
                .release_lease(&key, holder, lease.version)
                .await
                .unwrap();
        }
        granted(&store, &key, "d", 10).await;
    }
    let reopened = backend.open().await;
    // d's lease (version 4) is still live: durable, not renumbered.
    match reopened
        .acquire_lease(&key, "e", TTL, at(11))
        .await
        .unwrap()
    {
        LeaseAcquisition::HeldByOther(lease) => {
            assert_eq!((lease.holder.as_deref(), lease.version), (Some("d"), 4));
        }
        other => panic!("expected held by d, got {other:?}"),
    }
    assert_eq!(granted(&reopened, &key, "e", 20).await.version, 5);
}

pub(crate) async fn lease_list_by_prefix_paged(backend: &impl TestBackend) {
    let store = backend.open().await;
    let bridge = id("bridge");
    for route in ["e", "a", "c", "b", "d"] {
        granted(&store, &format!("{bridge}/{route}"), "h", 0).await;
    }
    granted(&store, &format!("{bridge}x/a"), "h", 0).await;
    store
        .release_lease(&format!("{bridge}/c"), "h", 1)
        .await
        .unwrap();

    let prefix = format!("{bridge}/");
    let mut request = PageRequest::first(2);
    let mut keys = Vec::new();
    loop {
        let page = store.list_leases(&prefix, request.clone()).await.unwrap();
        keys.extend(page.items.iter().map(|l| (l.key.clone(), l.holder.clone())));
        match request.after(&page) {
            Some(next) => request = next,
            None => break,
        }
    }
    let expected: Vec<(String, Option<String>)> = ["a", "b", "c", "d", "e"]
        .iter()
        .map(|r| {
            let holder = (*r != "c").then(|| "h".to_owned());
            (format!("{bridge}/{r}"), holder)
        })
        .collect();
    assert_eq!(keys, expected);
}

pub(crate) async fn lease_rejects_invalid_requests(backend: &impl TestBackend) {
    let store = backend.open().await;
    for result in [
        store.acquire_lease("", "a", TTL, at(0)).await,
        store.acquire_lease("k", "", TTL, at(0)).await,
        store.acquire_lease("k", "a", Duration::ZERO, at(0)).await,
    ] {
        assert!(matches!(result, Err(StateError::Invalid(_))), "{result:?}");
    }
    let listed = store.list_leases("", PageRequest::default()).await.unwrap();
    assert!(listed.items.iter().all(|l| l.key != "k"));
}
