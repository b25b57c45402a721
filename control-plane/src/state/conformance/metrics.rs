//! The latest metrics snapshot per agent.

use super::{TestBackend, at, id};
use crate::state::{MetricsRecord, StateError, StateStore};

fn record(agent_id: &str, secs: u64) -> MetricsRecord {
    MetricsRecord {
        agent_id: agent_id.to_owned(),
        captured_at: at(secs),
        snapshot: format!("snapshot at {secs}").into_bytes(),
    }
}

pub(crate) async fn metrics_latest_wins(backend: &impl TestBackend) {
    let store = backend.open().await;
    let (a, b) = (id("agent-a"), id("agent-b"));
    store.put_metrics(record(&a, 1)).await.unwrap();
    store.put_metrics(record(&a, 2)).await.unwrap();
    assert_eq!(store.get_metrics(&a).await.unwrap(), record(&a, 2));
    // A snapshot older than the stored one arrives late: ignored.
    store.put_metrics(record(&a, 0)).await.unwrap();
    assert_eq!(store.get_metrics(&a).await.unwrap(), record(&a, 2));

    store.put_metrics(record(&b, 5)).await.unwrap();
    let listed: Vec<MetricsRecord> = store
        .list_metrics()
        .await
        .unwrap()
        .into_iter()
        .filter(|r| r.agent_id == a || r.agent_id == b)
        .collect();
    assert_eq!(listed, vec![record(&a, 2), record(&b, 5)]);
    assert!(matches!(
        store.get_metrics(&id("agent")).await,
        Err(StateError::NotFound { .. })
    ));
}
