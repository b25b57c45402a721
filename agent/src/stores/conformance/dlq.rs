//! The `DlqStore` conformance suite (DESIGN §5.3).

use std::time::SystemTime;

use super::{Harness, envelope, t, unique};
use crate::stores::{DlqEntry, DlqFilter, DlqReason, DlqStore, PageRequest, StoreError};

/// Instantiates every test of this suite for a backend:
/// `dlq_conformance!(backend, make)` makes a module `backend` of
/// `#[tokio::test]`s, each calling `make().await` (an `async fn() -> (S,
/// Guard)` beside the macro call) for a fresh store.
#[macro_export]
macro_rules! dlq_conformance {
    ($backend:ident, $make:ident) => {
        $crate::__store_conformance!(
            dlq, $backend, $make;
            put_is_idempotent_by_id_and_durable,
            get_and_delete,
            list_filters_oldest_first,
            list_pages_through_everything,
            purge_deletes_what_matches,
            stats_count_per_route_binding_reason,
            invalid_entries_are_refused,
        );
    };
}

fn entry(bridge: &str, route: &str, binding: &str, reason: DlqReason, at: SystemTime) -> DlqEntry {
    DlqEntry {
        id: unique("rec"),
        bridge_id: bridge.into(),
        route_id: route.into(),
        binding_id: binding.into(),
        address: format!("{binding}/topic"),
        envelope: envelope(binding),
        reason,
        last_error: "refused".into(),
        attempts: 3,
        first_attempt_at: Some(t(1)),
        last_attempt_at: Some(t(2)),
        dead_lettered_at: at,
        agent_id: "agent-1".into(),
    }
}

fn ids(entries: &[DlqEntry]) -> Vec<&str> {
    entries.iter().map(|e| e.id.as_str()).collect()
}

fn only_bridge(bridge: &str) -> DlqFilter {
    DlqFilter {
        bridge_id: Some(bridge.into()),
        ..DlqFilter::default()
    }
}

pub async fn put_is_idempotent_by_id_and_durable<S: Harness + DlqStore>(s: S) {
    let e = entry(&unique("br"), "r", "b", DlqReason::PermanentError, t(5));
    assert_eq!(s.put(e.clone()).await, Ok(true));
    let mut again = e.clone();
    again.last_error = "a second writer".into();
    assert_eq!(s.put(again).await, Ok(false));
    let s = s.reopen().await;
    assert_eq!(s.get(&e.id).await, Ok(e.clone()));
    let page = s
        .list(&only_bridge(&e.bridge_id), PageRequest::default())
        .await;
    assert_eq!(page.expect("list").entries, vec![e]);
}

pub async fn get_and_delete<S: Harness + DlqStore>(s: S) {
    let e = entry(&unique("br"), "r", "b", DlqReason::Expired, t(5));
    assert!(matches!(s.get(&e.id).await, Err(StoreError::NotFound(_))));
    assert!(matches!(
        s.delete(&e.id).await,
        Err(StoreError::NotFound(_))
    ));
    s.put(e.clone()).await.expect("put");
    s.delete(&e.id).await.expect("delete");
    let s = s.reopen().await;
    assert!(matches!(s.get(&e.id).await, Err(StoreError::NotFound(_))));
    // Deleted ids can be written again (a redrive that failed once more).
    assert_eq!(s.put(e).await, Ok(true));
}

pub async fn list_filters_oldest_first<S: Harness + DlqStore>(s: S) {
    let br = unique("br");
    let e = [
        entry(&br, "r1", "b1", DlqReason::PermanentError, t(30)),
        entry(&br, "r1", "b2", DlqReason::ReplayExhausted, t(10)),
        entry(&br, "r2", "b1", DlqReason::Expired, t(20)),
        entry(&br, "r1", "b1", DlqReason::Expired, t(40)),
    ];
    for x in &e {
        s.put(x.clone()).await.expect("put");
    }
    s.put(entry(
        &unique("other"),
        "r1",
        "b1",
        DlqReason::Expired,
        t(1),
    ))
    .await
    .expect("put");
    let s = s.reopen().await;
    let list = |f: DlqFilter| {
        let s = &s;
        async move {
            s.list(&f, PageRequest::default())
                .await
                .expect("list")
                .entries
        }
    };
    let all = list(only_bridge(&br)).await;
    assert_eq!(ids(&all), [&e[1].id, &e[2].id, &e[0].id, &e[3].id]);
    let by_route = list(DlqFilter {
        route_id: Some("r1".into()),
        ..only_bridge(&br)
    })
    .await;
    assert_eq!(ids(&by_route), [&e[1].id, &e[0].id, &e[3].id]);
    let by_binding_reason = list(DlqFilter {
        binding_id: Some("b1".into()),
        reason: Some(DlqReason::Expired),
        ..only_bridge(&br)
    })
    .await;
    assert_eq!(ids(&by_binding_reason), [&e[2].id, &e[3].id]);
    let window = list(DlqFilter {
        since: Some(t(20)),
        until: Some(t(40)),
        ..only_bridge(&br)
    })
    .await;
    assert_eq!(ids(&window), [&e[2].id, &e[0].id]);
}

pub async fn list_pages_through_everything<S: Harness + DlqStore>(s: S) {
    let br = unique("br");
    let mut want = Vec::new();
    for i in 0..25 {
        // Pairs share a timestamp: the id breaks the tie.
        let e = entry(&br, "r", "b", DlqReason::PermanentError, t(i / 2));
        want.push((e.dead_lettered_at, e.id.clone()));
        s.put(e).await.expect("put");
    }
    want.sort();
    let s = s.reopen().await;
    let filter = only_bridge(&br);
    let mut got = Vec::new();
    let mut token = None;
    let mut pages = 0;
    loop {
        let page = s
            .list(&filter, PageRequest { size: 10, token })
            .await
            .expect("list");
        pages += 1;
        assert!(page.entries.len() <= 10);
        got.extend(page.entries.into_iter().map(|e| (e.dead_lettered_at, e.id)));
        match page.next_page_token {
            Some(next) => token = Some(next),
            None => break,
        }
    }
    assert_eq!(pages, 3);
    assert_eq!(got, want);
    let bad = PageRequest {
        size: 10,
        token: Some("not a token".into()),
    };
    assert!(matches!(
        s.list(&filter, bad).await,
        Err(StoreError::Invalid(_))
    ));
}

pub async fn purge_deletes_what_matches<S: Harness + DlqStore>(s: S) {
    let br = unique("br");
    for (route, at) in [("r1", 1), ("r1", 2), ("r2", 3)] {
        s.put(entry(&br, route, "b", DlqReason::Expired, t(at)))
            .await
            .expect("put");
    }
    let r1 = DlqFilter {
        route_id: Some("r1".into()),
        ..only_bridge(&br)
    };
    assert_eq!(s.purge(&r1).await, Ok(2));
    assert_eq!(s.purge(&r1).await, Ok(0));
    let s = s.reopen().await;
    let left = s.list(&only_bridge(&br), PageRequest::default()).await;
    assert_eq!(left.expect("list").entries.len(), 1);
}

pub async fn stats_count_per_route_binding_reason<S: Harness + DlqStore>(s: S) {
    let br = unique("br");
    for (route, binding, reason, at) in [
        ("r1", "b1", DlqReason::Expired, 5),
        ("r1", "b1", DlqReason::Expired, 3),
        ("r1", "b1", DlqReason::PermanentError, 4),
        ("r2", "b2", DlqReason::Expired, 9),
    ] {
        s.put(entry(&br, route, binding, reason, t(at)))
            .await
            .expect("put");
    }
    let s = s.reopen().await;
    let st = s.stats(&only_bridge(&br)).await.expect("stats");
    assert_eq!(st.total, 4);
    let rows: Vec<_> = st
        .rows
        .iter()
        .map(|r| {
            (
                r.route_id.as_str(),
                r.binding_id.as_str(),
                r.reason,
                r.count,
                r.oldest,
            )
        })
        .collect();
    assert_eq!(
        rows,
        [
            ("r1", "b1", DlqReason::PermanentError, 1, t(4)),
            ("r1", "b1", DlqReason::Expired, 2, t(3)),
            ("r2", "b2", DlqReason::Expired, 1, t(9)),
        ]
    );
    let expired = DlqFilter {
        reason: Some(DlqReason::Expired),
        ..only_bridge(&br)
    };
    assert_eq!(s.stats(&expired).await.expect("stats").total, 3);
}

pub async fn invalid_entries_are_refused<S: Harness + DlqStore>(s: S) {
    let mut e = entry(&unique("br"), "r", "b", DlqReason::Expired, t(1));
    e.route_id.clear();
    assert!(matches!(
        s.put(e.clone()).await,
        Err(StoreError::Invalid(_))
    ));
    assert!(matches!(s.get(&e.id).await, Err(StoreError::NotFound(_))));
}
