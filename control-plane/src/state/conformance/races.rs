//! Concurrency: one holder at a time, versions never repeated, exactly one
//! compare-and-swap winner, also across two stores on the same storage (two
//! control-plane replicas).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use super::{TestBackend, id};
use crate::state::{ApplyConfig, LeaseAcquisition, StateError, StateStore};

/// How long a racing task may wait for its turn before the test fails.
const DEADLINE: Duration = Duration::from_secs(60);

/// The last grant the test saw, to check that no two holders overlap.
#[derive(Debug, Clone, Copy)]
struct Grant {
    version: u64,
    now: SystemTime,
    expires_at: SystemTime,
    released: bool,
}

/// Acquires `key` as `holder`, retrying while somebody else holds it.
async fn acquire_eventually(
    store: &impl StateStore,
    key: &str,
    holder: &str,
    ttl: Duration,
) -> (SystemTime, crate::state::Lease) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let now = SystemTime::now();
        match store.acquire_lease(key, holder, ttl, now).await.unwrap() {
            LeaseAcquisition::Granted(lease) => return (now, lease),
            LeaseAcquisition::HeldByOther(_) => {
                assert!(Instant::now() < deadline, "{holder} never got {key}");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    }
}

pub(crate) async fn race_fifty_acquirers_one_holder_at_a_time(backend: &impl TestBackend) {
    const TASKS: u64 = 50;
    let store = Arc::new(backend.open().await);
    let key = Arc::new(id("bridge") + "/route");
    let last: Arc<Mutex<Option<Grant>>> = Arc::default();
    let mut tasks = Vec::new();
    for n in 0..TASKS {
        let (store, key, last) = (store.clone(), key.clone(), last.clone());
        tasks.push(tokio::spawn(async move {
            let holder = format!("holder-{n}");
            let ttl = Duration::from_millis(300);
            let (now, lease) = acquire_eventually(&*store, &key, &holder, ttl).await;
            let mine = Grant {
                version: lease.version,
                now,
                expires_at: lease.expires_at,
                released: false,
            };
            {
                let mut last = last.lock().unwrap();
                match *last {
                    Some(prev) if prev.version < mine.version => {
                        assert!(
                            prev.released || mine.now >= prev.expires_at,
                            "two holders at once: {prev:?} and {mine:?}"
                        );
                        *last = Some(mine);
                    }
                    // Our grant is older than one already recorded: ours must
                    // have expired before that one was granted.
                    Some(next) if next.version > mine.version => {
                        assert!(next.now >= mine.expires_at, "overlap: {mine:?} {next:?}");
                    }
                    Some(same) => panic!("version handed out twice: {same:?} {mine:?}"),
                    None => *last = Some(mine),
                }
            }
            tokio::task::yield_now().await;
            // Every 17th holder crashes while holding: the next one waits for
            // the expiry.
            if n % 17 != 0 {
                if let Some(grant) = last.lock().unwrap().as_mut()
                    && grant.version == mine.version
                {
                    grant.released = true;
                }
                match store.release_lease(&key, &holder, lease.version).await {
                    // Lost only if our lease expired and was taken meanwhile.
                    Ok(()) | Err(StateError::LeaseLost { .. }) => {}
                    Err(e) => panic!("release: {e}"),
                }
            }
            lease.version
        }));
    }
    let mut versions = Vec::new();
    for task in tasks {
        versions.push(task.await.unwrap());
    }
    versions.sort_unstable();
    assert_eq!(versions, (1..=TASKS).collect::<Vec<_>>());
}

pub(crate) async fn race_same_expected_version_exactly_one_wins(backend: &impl TestBackend) {
    let store = Arc::new(backend.open().await);
    let other = Arc::new(backend.open().await);
    for round in 0..5 {
        let bridge = id("bridge");
        let base = ApplyConfig {
            bridge_id: bridge.clone(),
            yaml: "a: 0".into(),
            selector: Default::default(),
            change_note: String::new(),
            expected_version: None,
            applied_by: Default::default(),
        };
        // Round 0 races the creation itself (expected 0).
        let expected = if round == 0 {
            0
        } else {
            store
                .apply_config(base.clone())
                .await
                .unwrap()
                .config
                .version
        };
        let contenders = [(store.clone(), "a: 1"), (other.clone(), "a: 2")];
        let tasks: Vec<_> = contenders
            .into_iter()
            .map(|(store, yaml)| {
                let apply = ApplyConfig {
                    yaml: yaml.into(),
                    expected_version: Some(expected),
                    ..base.clone()
                };
                tokio::spawn(async move { store.apply_config(apply).await })
            })
            .collect();
        let mut wins = Vec::new();
        for task in tasks {
            match task.await.unwrap() {
                Ok(applied) => wins.push(applied.config),
                Err(StateError::Conflict { current }) => assert_eq!(current, expected + 1),
                Err(e) => panic!("unexpected error: {e}"),
            }
        }
        assert_eq!(wins.len(), 1, "round {round}: {wins:?}");
        let current = store.get_config(&bridge, None).await.unwrap();
        assert_eq!(current, wins[0]);
        assert_eq!(current.version, expected + 1);
    }
}

pub(crate) async fn race_two_stores_never_repeat_a_lease_version(backend: &impl TestBackend) {
    const TASKS: u64 = 20;
    let stores = [
        Arc::new(backend.open().await),
        Arc::new(backend.open().await),
    ];
    let key = Arc::new(id("bridge") + "/route");
    let mut tasks = Vec::new();
    for n in 0..TASKS {
        let (store, key) = (stores[n as usize % 2].clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            let holder = format!("replica-{}-holder-{n}", n % 2);
            let ttl = Duration::from_secs(30);
            let (_, lease) = acquire_eventually(&*store, &key, &holder, ttl).await;
            store
                .release_lease(&key, &holder, lease.version)
                .await
                .unwrap();
            lease.version
        }));
    }
    let mut versions = BTreeSet::new();
    for task in tasks {
        let version = task.await.unwrap();
        assert!(
            versions.insert(version),
            "version {version} handed out twice"
        );
    }
    assert_eq!(versions, (1..=TASKS).collect());
}

pub(crate) async fn race_two_stores_never_repeat_a_config_version(backend: &impl TestBackend) {
    const TASKS: u64 = 20;
    let stores = [
        Arc::new(backend.open().await),
        Arc::new(backend.open().await),
    ];
    let bridge = id("bridge");
    let mut tasks = Vec::new();
    for n in 0..TASKS {
        let store = stores[n as usize % 2].clone();
        let apply = ApplyConfig {
            bridge_id: bridge.clone(),
            yaml: format!("n: {n}"),
            selector: Default::default(),
            change_note: format!("replica {}", n % 2),
            expected_version: None,
            applied_by: Default::default(),
        };
        tasks.push(tokio::spawn(async move { store.apply_config(apply).await }));
    }
    let mut versions = BTreeSet::new();
    for task in tasks {
        let applied = task.await.unwrap().unwrap();
        assert!(applied.changed);
        assert!(versions.insert(applied.config.version), "version repeated");
    }
    assert_eq!(versions, (1..=TASKS).collect());
    let history = stores[0]
        .list_config_versions(&bridge, crate::state::PageRequest::first(100))
        .await
        .unwrap();
    assert_eq!(history.items.len(), TASKS as usize);
}
