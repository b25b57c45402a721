//! AgentService over both transports: Connect (hello, pushes, ACK / NACK,
//! stale nonces, withdrawals, heartbeats, id conflicts, metrics), ListAgents
//! and GetAgent.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{FakeAgent, TRANSPORTS, TestServer, apply, document, eventually};
use ferry_shared::api::v1 as pb;
use pb::agent_message::Message as Up;
use pb::control_message::Message as Down;
use tonic::Code;

async fn agent_info(server: &TestServer, id: &str) -> pb::AgentInfo {
    server
        .agents()
        .get_agent(pb::GetAgentRequest {
            agent_id: id.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .agent
        .unwrap()
}

#[tokio::test]
async fn push_nack_then_ack_of_the_fixed_version() {
    for transport in TRANSPORTS {
        let server = TestServer::start(transport).await;
        let mut config = server.config();
        config
            .apply_config(apply(&document("b1", 10), &[("site", "a")], None))
            .await
            .unwrap();
        config
            .apply_config(apply(&document("other", 10), &[("site", "b")], None))
            .await
            .unwrap();

        let mut agent =
            FakeAgent::connect(server.channel.clone(), "agent-1", &[("site", "a")], &[])
                .await
                .unwrap();
        let push = agent.next_push().await;
        assert_eq!(
            (push.bridge_id.as_str(), push.version),
            ("b1", 1),
            "only the matching config"
        );
        assert!(push.yaml.contains("max_in_flight: 10"));
        agent
            .nack(
                &push,
                "stores.dlq: cannot open /tmp/x",
                &["stores.dlq.options.path: permission denied"],
            )
            .await;
        eventually("the nack is recorded", || async {
            agent_info(&server, "agent-1")
                .await
                .configs
                .first()
                .is_some_and(|c| c.nacked_version == 1)
        })
        .await;
        let info = agent_info(&server, "agent-1").await;
        assert!(info.connected);
        let status = &info.configs[0];
        assert_eq!(status.nack_error, "stores.dlq: cannot open /tmp/x");
        assert_eq!(
            status.nack_details,
            ["stores.dlq.options.path: permission denied"]
        );
        assert_eq!(status.acked_version, 0);

        config
            .apply_config(apply(&document("b1", 20), &[("site", "a")], None))
            .await
            .unwrap();
        let fixed = agent.next_push().await;
        assert_eq!(fixed.version, 2);
        assert_ne!(fixed.nonce, push.nonce, "a fresh nonce per push");
        // An answer to the old nonce is stale and ignored. (The stream is
        // handled in order: once the metrics snapshot sent after it is
        // stored, the stale ACK has been processed.)
        agent.ack(&push).await;
        agent
            .send(Up::Metrics(pb::MetricsSnapshot {
                captured_at: Some(std::time::SystemTime::now().into()),
                ..Default::default()
            }))
            .await;
        eventually("the sync snapshot is stored", || async {
            server
                .metrics()
                .get_agent_metrics(pb::GetAgentMetricsRequest {
                    agent_id: "agent-1".into(),
                })
                .await
                .is_ok()
        })
        .await;
        let status = &agent_info(&server, "agent-1").await.configs[0];
        assert_eq!(status.acked_version, 0, "the stale ack was ignored");
        agent.ack(&fixed).await;
        eventually("the ack is recorded", || async {
            agent_info(&server, "agent-1").await.configs[0].acked_version == 2
        })
        .await;
        let status = &agent_info(&server, "agent-1").await.configs[0];
        assert_eq!((status.pushed_version, status.nacked_version), (2, 0));
        assert!(
            status.nack_error.is_empty(),
            "the nack is cleared by a later ack"
        );

        // Deleting the configuration withdraws it.
        config
            .delete_config(pb::DeleteConfigRequest {
                bridge_id: "b1".into(),
                expected_version: None,
            })
            .await
            .unwrap();
        match agent.next().await.unwrap() {
            Some(Down::Withdraw(withdraw)) => assert_eq!(withdraw.bridge_id, "b1"),
            other => panic!("expected a withdrawal, got {other:?}"),
        }
        server.stop().await;
    }
}

#[tokio::test]
async fn selector_changes_withdraw_and_hello_running_versions_are_not_pushed_again() {
    let server = TestServer::start(common::Transport::Memory).await;
    let mut config = server.config();
    config
        .apply_config(apply(&document("b1", 10), &[("site", "a")], None))
        .await
        .unwrap();
    config
        .apply_config(apply(&document("b2", 10), &[], None))
        .await
        .unwrap();

    // Already runs b1 v1: only b2 is pushed.
    let mut agent = FakeAgent::connect(
        server.channel.clone(),
        "agent-r",
        &[("site", "a")],
        &[("b1", 1)],
    )
    .await
    .unwrap();
    let push = agent.next_push().await;
    assert_eq!(push.bridge_id, "b2");
    agent.ack(&push).await;

    // b1 stops matching: withdrawn.
    config
        .apply_config(apply(&document("b1", 10), &[("site", "z")], None))
        .await
        .unwrap();
    match agent.next().await.unwrap() {
        Some(Down::Withdraw(w)) => assert_eq!(w.bridge_id, "b1"),
        other => panic!("expected a withdrawal, got {other:?}"),
    }
    server.stop().await;
}

#[tokio::test]
async fn connect_errors() {
    for transport in TRANSPORTS {
        let server = TestServer::start(transport).await;
        // First message not a hello.
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tx.send(pb::AgentMessage {
            message: Some(Up::Heartbeat(pb::Heartbeat::default())),
        })
        .await
        .unwrap();
        let status = server
            .agents()
            .connect(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(status.message().contains("hello"), "{}", status.message());

        // Empty id.
        let status = FakeAgent::connect(server.channel.clone(), "", &[], &[])
            .await
            .err()
            .unwrap();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(
            status.message().contains("agent_id"),
            "{}",
            status.message()
        );

        // A second stream with a connected id is refused; the first keeps going.
        let mut first = FakeAgent::connect(server.channel.clone(), "dup", &[], &[])
            .await
            .unwrap();
        let status = FakeAgent::connect(server.channel.clone(), "dup", &[], &[])
            .await
            .err()
            .unwrap();
        assert_eq!(status.code(), Code::AlreadyExists);
        first.next_heartbeat().await;

        // A second hello on a stream ends it with INVALID_ARGUMENT.
        first
            .send(common::hello("dup", &[], &[]).message.unwrap())
            .await;
        let error = loop {
            match first.next().await {
                Err(status) => break status,
                Ok(None) => panic!("the stream ended without an error"),
                Ok(Some(_)) => {}
            }
        };
        assert_eq!(error.code(), Code::InvalidArgument);

        // Unknown agent, empty id.
        let status = server
            .agents()
            .get_agent(pb::GetAgentRequest {
                agent_id: "nobody".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::NotFound);
        let status = server
            .agents()
            .get_agent(pb::GetAgentRequest {
                agent_id: String::new(),
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument);
        server.stop().await;
    }
}

#[tokio::test]
async fn heartbeats_both_ways_and_silence_disconnects() {
    let server = TestServer::start(common::Transport::Memory).await;
    let mut agent = FakeAgent::connect(server.channel.clone(), "quiet", &[], &[])
        .await
        .unwrap();
    let heartbeat = agent.next_heartbeat().await;
    assert_eq!(heartbeat.interval_ms, 200);
    assert!(agent_info(&server, "quiet").await.connected);
    // The agent says nothing: after three intervals the stream ends.
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match agent.next().await {
                Err(status) => return status,
                Ok(None) => panic!("ended without a status"),
                Ok(Some(_)) => {}
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(ended.code(), Code::DeadlineExceeded);
    eventually("the agent is marked disconnected", || async {
        !agent_info(&server, "quiet").await.connected
    })
    .await;
    let info = agent_info(&server, "quiet").await;
    assert!(info.disconnected_at.is_some());

    // An agent that keeps sending heartbeats stays connected, and can
    // reconnect under the same id once its old stream is gone.
    // (The old stream releases the id right after recording its end; a real
    // agent retries ALREADY_EXISTS with backoff, and so does this one.)
    let agent = loop {
        match FakeAgent::connect(server.channel.clone(), "quiet", &[], &[]).await {
            Ok(agent) => break agent,
            Err(status) if status.code() == Code::AlreadyExists => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(status) => panic!("{status:?}"),
        }
    };
    for _ in 0..8 {
        agent.send(Up::Heartbeat(pb::Heartbeat::default())).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(agent_info(&server, "quiet").await.connected);

    // Closing the stream marks it disconnected.
    drop(agent);
    eventually("the closed agent is marked disconnected", || async {
        !agent_info(&server, "quiet").await.connected
    })
    .await;
    server.stop().await;
}

#[tokio::test]
async fn list_agents_pages_and_shutdown_ends_streams_cleanly() {
    for transport in TRANSPORTS {
        let server = TestServer::start(transport).await;
        let mut agents = Vec::new();
        for id in ["a1", "a2", "a3"] {
            agents.push(
                FakeAgent::connect(server.channel.clone(), id, &[("n", id)], &[])
                    .await
                    .unwrap(),
            );
        }
        let mut client = server.agents();
        let page = client
            .list_agents(pb::ListAgentsRequest {
                page_size: 2,
                page_token: String::new(),
            })
            .await
            .unwrap()
            .into_inner();
        let ids: Vec<_> = page.agents.iter().map(|a| a.agent_id.as_str()).collect();
        assert_eq!(ids, ["a1", "a2"]);
        assert_eq!(page.agents[0].labels["n"], "a1");
        let rest = client
            .list_agents(pb::ListAgentsRequest {
                page_size: 2,
                page_token: page.next_page_token,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(rest.agents.len(), 1);
        assert!(rest.next_page_token.is_empty());

        let store = server.store.clone();
        server.stop().await;
        for mut agent in agents {
            loop {
                match agent.next().await {
                    Ok(None) => break,
                    Ok(Some(_)) => {}
                    Err(status) => panic!("shutdown should end the stream cleanly: {status:?}"),
                }
            }
        }
        let recorded = store.list_agents().await.unwrap();
        assert!(
            recorded.iter().all(|a| !a.connected),
            "every agent marked disconnected at shutdown"
        );
    }
}

#[tokio::test]
async fn metrics_snapshots_reach_metrics_service_and_prometheus() {
    for transport in TRANSPORTS {
        metrics_round_trip(TestServer::start(transport).await).await;
    }
}

async fn metrics_round_trip(server: TestServer) {
    let agent = FakeAgent::connect(server.channel.clone(), "m1", &[], &[])
        .await
        .unwrap();
    let snapshot = pb::MetricsSnapshot {
        agent_id: "ignored".into(),
        captured_at: Some(std::time::SystemTime::now().into()),
        started_at: None,
        routes: vec![pb::RouteMetrics {
            bridge_id: "b1".into(),
            route_id: "main".into(),
            delivery_mode: "direct_hold".into(),
            lease_held: false,
            bindings: vec![pb::BindingMetrics {
                binding_id: "to-out".into(),
                counters: Some(pb::DeliveryCounters {
                    received: 10,
                    sent: 9,
                    in_flight: 1,
                    ..Default::default()
                }),
                outbox_depth: 0,
                oldest_pending_age_ms: 0,
            }],
        }],
        sessions: vec![],
    };
    agent.send(Up::Metrics(snapshot)).await;
    let mut metrics = server.metrics();
    eventually("the snapshot is stored", || {
        let mut metrics = metrics.clone();
        async move {
            metrics
                .get_agent_metrics(pb::GetAgentMetricsRequest {
                    agent_id: "m1".into(),
                })
                .await
                .is_ok()
        }
    })
    .await;
    let stored = metrics
        .get_agent_metrics(pb::GetAgentMetricsRequest {
            agent_id: "m1".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(stored.agent_id, "m1", "the stream's agent id wins");
    let listed = metrics
        .list_metrics(pb::ListMetricsRequest {
            bridge_id: "b1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.snapshots.len(), 1);
    let other = metrics
        .list_metrics(pb::ListMetricsRequest {
            bridge_id: "zz".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(other.snapshots[0].routes.is_empty());
    let totals = metrics
        .get_totals(pb::GetTotalsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(totals.fleet.unwrap().received, 10);
    assert_eq!((totals.agents, totals.agents_connected), (1, 1));
    assert_eq!(totals.bindings[0].counters.unwrap().sent, 9);

    let text = ferry_control_plane::http::render(server.store.as_ref())
        .await
        .unwrap();
    assert!(
        text.contains(
            r#"ferry_fleet_received_total{bridge="b1",route="main",binding="to-out"} 10"#
        ),
        "{text}"
    );
    assert!(text.contains("ferry_agents_connected 1"), "{text}");

    let status = metrics
        .get_agent_metrics(pb::GetAgentMetricsRequest {
            agent_id: "none".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    let status = metrics
        .get_agent_metrics(pb::GetAgentMetricsRequest {
            agent_id: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    server.stop().await;
}
