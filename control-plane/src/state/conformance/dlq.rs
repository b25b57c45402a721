//! Dead letters: idempotent writes, filters, paging, purge and stats.

use std::time::Duration;

use super::{TestBackend, at, id};
use crate::state::{DlqEntry, DlqFilter, DlqReason, DlqStat, PageRequest, StateError, StateStore};

fn entry(bridge: &str, route: &str, binding: &str, reason: DlqReason, secs: u64) -> DlqEntry {
    DlqEntry {
        id: id("rec"),
        bridge_id: bridge.to_owned(),
        route_id: route.to_owned(),
        binding_id: binding.to_owned(),
        reason,
        last_error: "broker said no".into(),
        attempts: 3,
        first_attempt_at: Some(at(secs) - Duration::from_secs(1)),
        last_attempt_at: None,
        dead_lettered_at: at(secs),
        agent_id: "agent-1".into(),
        address: "out/topic".into(),
        envelope: vec![0x0a, 0x03, b'm', b's', b'g', 0xff],
    }
}

async fn list_all(store: &impl StateStore, filter: &DlqFilter, size: u32) -> Vec<DlqEntry> {
    let mut request = PageRequest::first(size);
    let mut out = Vec::new();
    loop {
        let page = store.list_dlq(filter, request.clone()).await.unwrap();
        assert!(page.items.len() <= size as usize);
        out.extend(page.items.iter().cloned());
        match request.after(&page) {
            Some(next) => request = next,
            None => return out,
        }
    }
}

fn for_bridge(bridge: &str) -> DlqFilter {
    DlqFilter {
        bridge_id: Some(bridge.to_owned()),
        ..DlqFilter::default()
    }
}

pub(crate) async fn dlq_put_is_idempotent_and_round_trips(backend: &impl TestBackend) {
    let store = backend.open().await;
    let bridge = id("bridge");
    let first = entry(&bridge, "r", "b", DlqReason::PermanentError, 1);
    assert!(store.put_dlq(first.clone()).await.unwrap());
    let mut rewrite = first.clone();
    rewrite.last_error = "second write".into();
    assert!(!store.put_dlq(rewrite).await.unwrap());
    assert_eq!(store.get_dlq(&first.id).await.unwrap(), first);
    assert_eq!(
        list_all(&store, &for_bridge(&bridge), 10).await,
        vec![first.clone()]
    );

    let mut bare = entry(&bridge, "r", "b", DlqReason::Expired, 2);
    bare.first_attempt_at = None;
    bare.attempts = 0;
    bare.envelope = Vec::new();
    assert!(store.put_dlq(bare.clone()).await.unwrap());
    assert_eq!(store.get_dlq(&bare.id).await.unwrap(), bare);

    store.delete_dlq(&first.id).await.unwrap();
    for result in [
        store.get_dlq(&first.id).await.map(drop),
        store.delete_dlq(&first.id).await,
    ] {
        assert!(
            matches!(result, Err(StateError::NotFound { .. })),
            "{result:?}"
        );
    }
    let mut invalid = entry(&bridge, "", "b", DlqReason::Expired, 3);
    assert!(matches!(
        store.put_dlq(invalid.clone()).await,
        Err(StateError::Invalid(_))
    ));
    invalid.route_id = "r".into();
    invalid.id = String::new();
    assert!(matches!(
        store.put_dlq(invalid).await,
        Err(StateError::Invalid(_))
    ));
}

pub(crate) async fn dlq_filters(backend: &impl TestBackend) {
    let store = backend.open().await;
    let (b1, b2) = (id("b1"), id("b2"));
    let entries = [
        entry(&b1, "r1", "x", DlqReason::PermanentError, 10),
        entry(&b1, "r1", "y", DlqReason::ReplayExhausted, 20),
        entry(&b1, "r2", "x", DlqReason::Expired, 30),
        entry(&b2, "r1", "x", DlqReason::PermanentError, 40),
    ];
    for e in &entries {
        store.put_dlq(e.clone()).await.unwrap();
    }
    let ids = |found: Vec<DlqEntry>| found.into_iter().map(|e| e.id).collect::<Vec<_>>();
    let want = |indexes: &[usize]| {
        indexes
            .iter()
            .map(|&i| entries[i].id.clone())
            .collect::<Vec<_>>()
    };

    assert_eq!(
        ids(list_all(&store, &for_bridge(&b1), 10).await),
        want(&[0, 1, 2])
    );
    let cases = [
        (
            DlqFilter {
                route_id: Some("r1".into()),
                ..for_bridge(&b1)
            },
            vec![0, 1],
        ),
        (
            DlqFilter {
                binding_id: Some("x".into()),
                ..for_bridge(&b1)
            },
            vec![0, 2],
        ),
        (
            DlqFilter {
                reason: Some(DlqReason::ReplayExhausted),
                ..for_bridge(&b1)
            },
            vec![1],
        ),
        (
            DlqFilter {
                since: Some(at(20)),
                ..for_bridge(&b1)
            },
            vec![1, 2],
        ),
        (
            DlqFilter {
                until: Some(at(20)),
                ..for_bridge(&b1)
            },
            vec![0],
        ),
        (
            DlqFilter {
                since: Some(at(15)),
                until: Some(at(31)),
                ..for_bridge(&b1)
            },
            vec![1, 2],
        ),
        (
            DlqFilter {
                route_id: Some("r1".into()),
                binding_id: Some("x".into()),
                ..for_bridge(&b2)
            },
            vec![3],
        ),
        (
            DlqFilter {
                reason: Some(DlqReason::Expired),
                ..for_bridge(&b2)
            },
            vec![],
        ),
    ];
    for (filter, expected) in cases {
        assert_eq!(
            ids(list_all(&store, &filter, 10).await),
            want(&expected),
            "{filter:?}"
        );
    }
}

pub(crate) async fn dlq_paging_oldest_first(backend: &impl TestBackend) {
    let store = backend.open().await;
    let bridge = id("bridge");
    // Out of order, with ties on the time (then ordered by id).
    let mut entries: Vec<DlqEntry> = [5, 1, 3, 3, 3, 9, 2]
        .into_iter()
        .map(|secs| entry(&bridge, "r", "b", DlqReason::PermanentError, secs))
        .collect();
    for e in &entries {
        store.put_dlq(e.clone()).await.unwrap();
    }
    entries.sort_by(|a, b| (a.dead_lettered_at, &a.id).cmp(&(b.dead_lettered_at, &b.id)));
    for size in [1, 3, 7, 100] {
        assert_eq!(
            list_all(&store, &for_bridge(&bridge), size).await,
            entries,
            "page size {size}"
        );
    }
    let first = store
        .list_dlq(&for_bridge(&bridge), PageRequest::first(7))
        .await
        .unwrap();
    assert_eq!((first.items.len(), first.next_token), (7, None));
}

pub(crate) async fn dlq_purge_and_stats(backend: &impl TestBackend) {
    let store = backend.open().await;
    let bridge = id("bridge");
    let put = [
        ("r1", "x", DlqReason::PermanentError, 30),
        ("r1", "x", DlqReason::PermanentError, 10),
        ("r1", "x", DlqReason::Expired, 20),
        ("r1", "y", DlqReason::PermanentError, 40),
        ("r2", "x", DlqReason::ReplayExhausted, 50),
    ];
    for (route, binding, reason, secs) in put {
        store
            .put_dlq(entry(&bridge, route, binding, reason, secs))
            .await
            .unwrap();
    }
    let stat = |route: &str, binding: &str, reason, count, oldest| DlqStat {
        bridge_id: bridge.clone(),
        route_id: route.into(),
        binding_id: binding.into(),
        reason,
        count,
        oldest: at(oldest),
    };
    let mut expected = vec![
        stat("r1", "x", DlqReason::PermanentError, 2, 10),
        stat("r1", "x", DlqReason::Expired, 1, 20),
        stat("r1", "y", DlqReason::PermanentError, 1, 40),
        stat("r2", "x", DlqReason::ReplayExhausted, 1, 50),
    ];
    let mut stats = store.dlq_stats(&for_bridge(&bridge)).await.unwrap();
    let key = |s: &DlqStat| (s.route_id.clone(), s.binding_id.clone(), s.reason.as_str());
    stats.sort_by_key(key);
    expected.sort_by_key(key);
    assert_eq!(stats, expected);

    let r1x = DlqFilter {
        route_id: Some("r1".into()),
        binding_id: Some("x".into()),
        ..for_bridge(&bridge)
    };
    assert_eq!(store.purge_dlq(&r1x).await.unwrap(), 3);
    assert_eq!(store.purge_dlq(&r1x).await.unwrap(), 0);
    let left = store.dlq_stats(&for_bridge(&bridge)).await.unwrap();
    assert_eq!(left.iter().map(|s| s.count).sum::<u64>(), 2);
    assert_eq!(store.purge_dlq(&for_bridge(&bridge)).await.unwrap(), 2);
    assert!(
        store
            .dlq_stats(&for_bridge(&bridge))
            .await
            .unwrap()
            .is_empty()
    );
}
