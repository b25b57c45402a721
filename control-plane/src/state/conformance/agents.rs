//! Agents, heartbeats and per-bridge status.

use super::{TestBackend, at, id};
use crate::state::{AgentBridgeEvent, AgentHello, Labels, StateError, StateStore};

fn hello(agent_id: &str, secs: u64) -> AgentHello {
    AgentHello {
        agent_id: agent_id.to_owned(),
        labels: Labels::from([("site".to_owned(), "north".to_owned())]),
        build_version: "0.1.0".into(),
        capabilities: vec!["mqtt".into(), "redrive".into()],
        connected_at: at(secs),
    }
}

pub(crate) async fn agent_hello_heartbeat_disconnect(backend: &impl TestBackend) {
    let store = backend.open().await;
    let agent = id("agent");
    store.upsert_agent(hello(&agent, 0)).await.unwrap();
    let record = store.get_agent(&agent).await.unwrap();
    assert!(record.connected);
    assert_eq!(record.labels.get("site").map(String::as_str), Some("north"));
    assert_eq!(record.capabilities, vec!["mqtt", "redrive"]);
    assert_eq!((record.connected_at, record.last_seen), (at(0), at(0)));
    assert_eq!(record.disconnected_at, None);

    store.mark_agent_seen(&agent, at(5)).await.unwrap();
    assert_eq!(store.get_agent(&agent).await.unwrap().last_seen, at(5));
    store.mark_agent_disconnected(&agent, at(9)).await.unwrap();
    let gone = store.get_agent(&agent).await.unwrap();
    assert!(!gone.connected);
    assert_eq!(gone.disconnected_at, Some(at(9)));

    let mut back = hello(&agent, 20);
    back.build_version = "0.2.0".into();
    store.upsert_agent(back).await.unwrap();
    let again = store.get_agent(&agent).await.unwrap();
    assert!(again.connected);
    assert_eq!(
        (again.build_version.as_str(), again.connected_at),
        ("0.2.0", at(20))
    );
    assert_eq!(again.disconnected_at, None);

    let unknown = id("agent");
    for result in [
        store.mark_agent_seen(&unknown, at(1)).await,
        store.mark_agent_disconnected(&unknown, at(1)).await,
        store.get_agent(&unknown).await.map(drop),
    ] {
        assert!(
            matches!(result, Err(StateError::NotFound { .. })),
            "{result:?}"
        );
    }
    assert!(matches!(
        store.upsert_agent(hello("", 0)).await,
        Err(StateError::Invalid(_))
    ));
}

pub(crate) async fn agent_bridge_status(backend: &impl TestBackend) {
    let store = backend.open().await;
    let agent = id("agent");
    let (b1, b2) = (id("b1"), id("b2"));
    store.upsert_agent(hello(&agent, 0)).await.unwrap();
    let events = [
        (
            &b1,
            AgentBridgeEvent::Pushed {
                version: 1,
                nonce: "n1".into(),
            },
            1,
        ),
        (
            &b1,
            AgentBridgeEvent::Nacked {
                version: 1,
                error: "invalid config".into(),
                details: vec!["routes[0]: unknown binding \"x\"".into()],
            },
            2,
        ),
        (
            &b1,
            AgentBridgeEvent::Pushed {
                version: 2,
                nonce: "n2".into(),
            },
            3,
        ),
        (&b1, AgentBridgeEvent::Acked { version: 2 }, 4),
        (
            &b2,
            AgentBridgeEvent::Pushed {
                version: 7,
                nonce: "n3".into(),
            },
            5,
        ),
    ];
    for (bridge, event, secs) in events {
        store
            .record_agent_bridge(&agent, bridge, event, at(secs))
            .await
            .unwrap();
    }
    let record = store.get_agent(&agent).await.unwrap();
    assert_eq!(record.bridges.len(), 2);
    let s1 = &record.bridges[0];
    assert_eq!(s1.bridge_id, b1);
    let pushed = s1.pushed.as_ref().unwrap();
    assert_eq!(
        (pushed.version, pushed.nonce.as_str(), pushed.at),
        (2, "n2", at(3))
    );
    let acked = s1.acked.as_ref().unwrap();
    assert_eq!((acked.version, acked.at), (2, at(4)));
    let nack = s1.last_nack.as_ref().unwrap();
    assert_eq!(
        (nack.version, nack.error.as_str(), nack.at),
        (1, "invalid config", at(2))
    );
    assert_eq!(nack.details, vec!["routes[0]: unknown binding \"x\""]);
    let s2 = &record.bridges[1];
    assert_eq!(
        (s2.bridge_id.as_str(), s2.acked.is_none()),
        (b2.as_str(), true)
    );

    // A new hello keeps the status; the agent will report what it runs.
    store.upsert_agent(hello(&agent, 10)).await.unwrap();
    let listed = store.list_agents().await.unwrap();
    let mine = listed.iter().find(|a| a.agent_id == agent).unwrap();
    assert_eq!(mine.bridges, record.bridges);

    store
        .record_agent_bridge(&agent, &b2, AgentBridgeEvent::Withdrawn, at(11))
        .await
        .unwrap();
    let record = store.get_agent(&agent).await.unwrap();
    assert_eq!(record.bridges.len(), 1);

    let unknown = store
        .record_agent_bridge(
            &id("agent"),
            &b1,
            AgentBridgeEvent::Acked { version: 1 },
            at(1),
        )
        .await;
    assert!(matches!(unknown, Err(StateError::NotFound { .. })));
}
