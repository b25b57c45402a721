//! Configurations and their history.

use super::{TestBackend, id};
use crate::state::codec::digest;
use crate::state::{AppliedBy, ApplyConfig, Labels, PageRequest, StateError, StateStore};

fn apply(bridge_id: &str, yaml: &str) -> ApplyConfig {
    ApplyConfig {
        bridge_id: bridge_id.to_owned(),
        yaml: yaml.to_owned(),
        selector: Labels::from([("site".to_owned(), "north".to_owned())]),
        change_note: format!("apply {yaml}"),
        expected_version: None,
        applied_by: author("alice"),
    }
}

fn author(principal: &str) -> AppliedBy {
    AppliedBy {
        principal: principal.to_owned(),
        client_address: "192.0.2.7:53122".to_owned(),
    }
}

pub(crate) async fn config_versions_increase_by_one(backend: &impl TestBackend) {
    let store = backend.open().await;
    let bridge = id("bridge");
    let first = store.apply_config(apply(&bridge, "a: 1")).await.unwrap();
    assert!(first.changed);
    assert_eq!(first.config.version, 1);
    assert_eq!(first.config.digest, digest("a: 1"));
    let second = store.apply_config(apply(&bridge, "a: 2")).await.unwrap();
    assert_eq!((second.config.version, second.changed), (2, true));

    let current = store.get_config(&bridge, None).await.unwrap();
    assert_eq!(current, second.config);
    let old = store.get_config(&bridge, Some(1)).await.unwrap();
    assert_eq!(old, first.config);
    assert_eq!(old.selector.get("site").map(String::as_str), Some("north"));
    assert!(matches!(
        store.get_config(&bridge, Some(3)).await,
        Err(StateError::NotFound { .. })
    ));
    assert!(matches!(
        store.get_config(&id("unknown"), None).await,
        Err(StateError::NotFound { .. })
    ));
}

pub(crate) async fn config_unchanged_apply_keeps_version(backend: &impl TestBackend) {
    let store = backend.open().await;
    let bridge = id("bridge");
    store.apply_config(apply(&bridge, "a: 1")).await.unwrap();
    let mut by_bob = apply(&bridge, "a: 1");
    by_bob.applied_by = author("bob");
    let again = store.apply_config(by_bob).await.unwrap();
    assert!(!again.changed);
    assert_eq!(again.config.version, 1);
    assert_eq!(again.config.change_note, "apply a: 1");
    assert_eq!(
        again.config.applied_by,
        author("alice"),
        "nothing stored, nor its author"
    );

    let mut other_selector = apply(&bridge, "a: 1");
    other_selector.selector.insert("tier".into(), "edge".into());
    let changed = store.apply_config(other_selector).await.unwrap();
    assert_eq!((changed.config.version, changed.changed), (2, true));
    let history = store
        .list_config_versions(&bridge, PageRequest::default())
        .await
        .unwrap();
    assert_eq!(history.items.len(), 2);
}

pub(crate) async fn config_cas_conflict_stores_nothing(backend: &impl TestBackend) {
    let store = backend.open().await;
    let bridge = id("bridge");
    let mut create = apply(&bridge, "a: 1");
    create.expected_version = Some(0);
    assert_eq!(
        store
            .apply_config(create.clone())
            .await
            .unwrap()
            .config
            .version,
        1
    );

    let mut stale = apply(&bridge, "a: 2");
    stale.expected_version = Some(0);
    assert_eq!(
        store.apply_config(stale.clone()).await,
        Err(StateError::Conflict { current: 1 })
    );
    stale.expected_version = Some(5);
    assert_eq!(
        store.apply_config(stale.clone()).await,
        Err(StateError::Conflict { current: 1 })
    );
    // A conflicting apply of the same document is still a conflict.
    create.expected_version = Some(2);
    assert_eq!(
        store.apply_config(create).await,
        Err(StateError::Conflict { current: 1 })
    );
    assert_eq!(store.get_config(&bridge, None).await.unwrap().yaml, "a: 1");

    stale.expected_version = Some(1);
    assert_eq!(store.apply_config(stale).await.unwrap().config.version, 2);

    let missing = id("bridge");
    let mut must_exist = apply(&missing, "a: 1");
    must_exist.expected_version = Some(3);
    assert_eq!(
        store.apply_config(must_exist).await,
        Err(StateError::Conflict { current: 0 })
    );
    assert!(matches!(
        store.get_config(&missing, None).await,
        Err(StateError::NotFound { .. })
    ));
}

pub(crate) async fn config_history_newest_first_and_paged(backend: &impl TestBackend) {
    let store = backend.open().await;
    let bridge = id("bridge");
    for n in 1..=5 {
        store
            .apply_config(apply(&bridge, &format!("n: {n}")))
            .await
            .unwrap();
    }
    let mut request = PageRequest::first(2);
    let mut seen = Vec::new();
    let mut pages = 0;
    loop {
        let page = store
            .list_config_versions(&bridge, request.clone())
            .await
            .unwrap();
        pages += 1;
        seen.extend(page.items.iter().cloned());
        match request.after(&page) {
            Some(next) => request = next,
            None => break,
        }
    }
    assert_eq!(pages, 3);
    let versions: Vec<u64> = seen.iter().map(|v| v.version).collect();
    assert_eq!(versions, vec![5, 4, 3, 2, 1]);
    for entry in &seen {
        assert_eq!(entry.digest, digest(&format!("n: {}", entry.version)));
        assert_eq!(entry.change_note, format!("apply n: {}", entry.version));
        assert_eq!(entry.applied_by, author("alice"));
    }
    assert!(matches!(
        store
            .list_config_versions(&id("unknown"), PageRequest::default())
            .await,
        Err(StateError::NotFound { .. })
    ));
}

pub(crate) async fn config_rollback_by_reapply(backend: &impl TestBackend) {
    let store = backend.open().await;
    let bridge = id("bridge");
    let v1 = store
        .apply_config(apply(&bridge, "a: 1"))
        .await
        .unwrap()
        .config;
    store.apply_config(apply(&bridge, "a: 2")).await.unwrap();

    let old = store.get_config(&bridge, Some(1)).await.unwrap();
    let rollback = ApplyConfig {
        bridge_id: bridge.clone(),
        yaml: old.yaml,
        selector: old.selector,
        change_note: "rollback to 1".into(),
        expected_version: Some(2),
        applied_by: author("carol"),
    };
    let v3 = store.apply_config(rollback).await.unwrap();
    assert!(v3.changed);
    assert_eq!(v3.config.version, 3);
    assert_eq!(v3.config.applied_by, author("carol"));
    assert_eq!(
        store.get_config(&bridge, Some(1)).await.unwrap().applied_by,
        author("alice"),
        "a rollback names its own author, the old version keeps its"
    );
    assert_eq!(
        (v3.config.yaml.as_str(), &v3.config.digest),
        ("a: 1", &v1.digest)
    );
    assert_eq!(store.get_config(&bridge, None).await.unwrap(), v3.config);
}

pub(crate) async fn config_delete_removes_history(backend: &impl TestBackend) {
    let store = backend.open().await;
    let bridge = id("bridge");
    store.apply_config(apply(&bridge, "a: 1")).await.unwrap();
    store.apply_config(apply(&bridge, "a: 2")).await.unwrap();
    assert_eq!(
        store.delete_config(&bridge, Some(1)).await,
        Err(StateError::Conflict { current: 2 })
    );
    assert_eq!(store.get_config(&bridge, None).await.unwrap().version, 2);

    store.delete_config(&bridge, Some(2)).await.unwrap();
    assert!(matches!(
        store.get_config(&bridge, None).await,
        Err(StateError::NotFound { .. })
    ));
    assert!(matches!(
        store.get_config(&bridge, Some(1)).await,
        Err(StateError::NotFound { .. })
    ));
    assert!(matches!(
        store
            .list_config_versions(&bridge, PageRequest::default())
            .await,
        Err(StateError::NotFound { .. })
    ));
    assert!(matches!(
        store.delete_config(&bridge, None).await,
        Err(StateError::NotFound { .. })
    ));
    assert_eq!(
        store.delete_config(&bridge, Some(4)).await,
        Err(StateError::Conflict { current: 0 })
    );
    let again = store.apply_config(apply(&bridge, "a: 3")).await.unwrap();
    assert_eq!(again.config.version, 1);
}

pub(crate) async fn config_list_is_paged_by_bridge_id(backend: &impl TestBackend) {
    let store = backend.open().await;
    let prefix = id("list");
    let mut expected = Vec::new();
    for n in [3, 1, 4, 5, 2] {
        let bridge = format!("{prefix}-{n}");
        store.apply_config(apply(&bridge, "a: 1")).await.unwrap();
        if n == 4 {
            store.apply_config(apply(&bridge, "a: 2")).await.unwrap();
        }
        expected.push(bridge);
    }
    expected.sort();

    let mut request = PageRequest::first(2);
    let mut listed = Vec::new();
    loop {
        let page = store.list_configs(request.clone()).await.unwrap();
        assert!(page.items.len() <= 2);
        listed.extend(
            page.items
                .iter()
                .filter(|c| c.bridge_id.starts_with(&prefix))
                .cloned(),
        );
        match request.after(&page) {
            Some(next) => request = next,
            None => break,
        }
    }
    let ids: Vec<&str> = listed.iter().map(|c| c.bridge_id.as_str()).collect();
    assert_eq!(ids, expected.iter().map(String::as_str).collect::<Vec<_>>());
    let four = listed.iter().find(|c| c.bridge_id.ends_with("-4")).unwrap();
    assert_eq!((four.version, four.yaml.as_str()), (2, "a: 2"));

    let foreign = PageRequest {
        size: 2,
        token: Some("00".into()),
    };
    assert!(matches!(
        store.list_configs(foreign).await,
        Err(StateError::Invalid(_))
    ));
}

pub(crate) async fn config_rejects_invalid_requests(backend: &impl TestBackend) {
    let store = backend.open().await;
    assert!(matches!(
        store.apply_config(apply("", "a: 1")).await,
        Err(StateError::Invalid(_))
    ));
}

/// A database written by a build before the audit record (schema v1) is
/// migrated when opened: its versions read back with no author, and new
/// versions record theirs.
pub(crate) async fn config_versions_from_schema_v1_migrate(backend: &impl TestBackend) {
    let bridge = id("bridge");
    backend
        .execute_raw(&format!(
            "{schema}\n\
             CREATE TABLE ferry_schema (version BIGINT NOT NULL);\n\
             INSERT INTO ferry_schema (version) VALUES (1);\n\
             INSERT INTO config_versions \
             (bridge_id, version, yaml, selector, change_note, digest, created_at) \
             VALUES ('{bridge}', 1, 'a: 1', '{{}}', 'old', '{digest}', 1700000000000);\n\
             INSERT INTO configs (bridge_id, version) VALUES ('{bridge}', 1);",
            schema = <_ as TestBackend>::schema_v1(backend),
            digest = digest("a: 1"),
        ))
        .await;
    let store = backend.open().await;
    let old = store.get_config(&bridge, None).await.unwrap();
    assert_eq!((old.version, old.yaml.as_str()), (1, "a: 1"));
    assert_eq!(old.applied_by, AppliedBy::default());
    let applied = store.apply_config(apply(&bridge, "a: 2")).await.unwrap();
    assert_eq!(applied.config.version, 2);
    let history = store
        .list_config_versions(&bridge, PageRequest::default())
        .await
        .unwrap();
    let authors: Vec<&str> = history
        .items
        .iter()
        .map(|v| v.applied_by.principal.as_str())
        .collect();
    assert_eq!(authors, ["alice", ""]);
}
