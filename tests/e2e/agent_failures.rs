//! The agent when things go wrong: a destination that refuses one binding (poison, DLQ,
//! redrive over the agent's gRPC DlqService), messages that expire while the destination is
//! down, an oversized payload, an invalid configuration and a store that cannot be opened.

use std::time::Duration;

use ferry_shared::api::v1 as pb;
use ferry_tests::mqtt::QoS;
use ferry_tests::process::{ChildProcess, project_bin};
use ferry_tests::{Mosquitto, PublishOptions, ids, publish_seq, publish_seq_with, wait};

use crate::agent_support::{Bridge, dlq_client, quiesced};

const DELIVERY: Duration = Duration::from_secs(60);

fn binding_filter(binding: &str) -> pb::DlqFilter {
    pb::DlqFilter {
        binding_id: binding.to_owned(),
        ..Default::default()
    }
}

/// One binding publishes to a topic so long that its packets exceed broker B's maximum
/// packet size (announced in CONNACK), so its sender refuses them as permanent failures. Its
/// records go to the DLQ with the error while the other binding gets everything; once B
/// accepts larger packets, a redrive over the agent's DlqService delivers them.
///
/// (An ACL deny is the obvious poison, but Mosquitto 2.0.11 drops the connection after the
/// "not authorized" PUBACK, which would stall every binding on it.)
#[tokio::test]
async fn poison_binding_fills_the_dlq_and_redrive_delivers_after_the_fix() -> anyhow::Result<()> {
    const N: u64 = 100;
    let a = Mosquitto::start().await?;
    let mut b = Mosquitto::builder()
        .config_line("max_packet_size 1000")
        .start()
        .await?;
    let dir = tempfile::tempdir()?;
    let mut bridge = Bridge::new(&a.url(), &b.url(), dir.path(), &["good", "poison"]);
    bridge
        .address_suffix
        .insert("poison".into(), format!("/{}", "p".repeat(1200)));
    let collector = bridge.collector().await?;
    let agent = bridge.start_agent().await?;

    publish_seq(&a.url(), &bridge.input(), 0..N, QoS::AtLeastOnce).await?;
    collector
        .wait_for(&bridge.output("good"), 0..N, DELIVERY)
        .await?;
    let mut client = dlq_client(&agent).await?;
    wait::until_ok(DELIVERY, "the poison binding's DLQ entries", || {
        let mut client = client.clone();
        async move {
            let stats = client
                .get_dlq_stats(pb::GetDlqStatsRequest {
                    filter: Some(binding_filter("poison")),
                })
                .await?
                .into_inner();
            anyhow::ensure!(stats.total == N, "{} so far", stats.total);
            Ok(())
        }
    })
    .await?;
    let listed = client
        .list_dlq_entries(pb::ListDlqEntriesRequest {
            filter: Some(binding_filter("poison")),
            page_size: 1,
            ..Default::default()
        })
        .await?
        .into_inner();
    let entry = &listed.entries[0];
    assert_eq!(entry.reason, pb::DlqReason::Oversized as i32);
    assert!(
        entry.last_error.contains("maximum packet size"),
        "{entry:?}"
    );
    assert_eq!(collector.counts().distinct(&bridge.output("poison")), 0);
    let counts = quiesced(&agent, &bridge.bindings, DELIVERY).await?;
    assert_eq!(
        (counts[0].sent, counts[0].dead_lettered),
        (N, 0),
        "{counts:?}"
    );
    assert_eq!(
        (counts[1].sent, counts[1].dead_lettered),
        (0, N),
        "{counts:?}"
    );

    // The fault is fixed: B accepts larger packets.
    let conf = b.dir().join("mosquitto.conf");
    let fixed = std::fs::read_to_string(&conf)?.replace("max_packet_size 1000\n", "");
    std::fs::write(&conf, fixed)?;
    b.restart().await?;
    // A redrive on a shared_outbox route is a new outbox record: durable at once, sent
    // once the agent is connected to B again.
    let redriven = client
        .redrive_dlq_entries(pb::RedriveDlqEntriesRequest {
            filter: Some(binding_filter("poison")),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(redriven.outcomes.len() as u64, N);
    assert!(redriven.outcomes.iter().all(|o| o.ok), "{redriven:?}");
    collector
        .wait_for(&bridge.output("poison"), 0..N, DELIVERY)
        .await?;
    let stats = client
        .get_dlq_stats(pb::GetDlqStatsRequest { filter: None })
        .await?
        .into_inner();
    assert_eq!(stats.total, 0, "redriven entries are deleted");
    let counts = quiesced(&agent, &bridge.bindings, DELIVERY).await?;
    assert_eq!(counts[1].sent, N, "{counts:?}");
    Ok(())
}

/// Messages with a 2 s MQTT message expiry reach the outbox while the destination is down;
/// they end in `on_expired` (DLQ entries with reason expired), counted as expired.
#[tokio::test]
async fn expired_messages_end_in_on_expired_and_are_counted() -> anyhow::Result<()> {
    const N: u64 = 20;
    let a = Mosquitto::start().await?;
    let mut b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let bridge = Bridge::new(&a.url(), &b.url(), dir.path(), &["x", "y"]);
    let agent = bridge.start_agent().await?;
    b.stop().await?;
    let options = PublishOptions {
        expiry_secs: Some(2),
        ..Default::default()
    };
    publish_seq_with(&a.url(), &bridge.input(), 0..N, QoS::AtLeastOnce, options).await?;
    wait::until_ok(DELIVERY, "every message expired", || {
        let r = agent.metrics().and_then(|m| {
            for b in &bridge.bindings {
                let c = m.binding("r", b);
                anyhow::ensure!(c.expired == N, "{b}: {c:?}");
            }
            Ok(())
        });
        std::future::ready(r)
    })
    .await?;
    let counts = quiesced(&agent, &bridge.bindings, DELIVERY).await?;
    for c in &counts {
        assert_eq!(
            (c.received, c.expired, c.sent, c.dead_lettered),
            (N, N, 0, 0),
            "{c:?}"
        );
    }
    let stats = dlq_client(&agent)
        .await?
        .get_dlq_stats(pb::GetDlqStatsRequest {
            filter: Some(pb::DlqFilter {
                reason: pb::DlqReason::Expired as i32,
                ..Default::default()
            }),
        })
        .await?
        .into_inner();
    assert_eq!(stats.total, 2 * N, "one DLQ entry per message and binding");
    Ok(())
}

/// A direct_hold route with `max_payload_bytes: 1024`: an oversized message is dead-lettered
/// (policy) and counted; the others are delivered; SIGTERM exits 0.
#[tokio::test]
async fn oversized_payload_is_dead_lettered_on_direct_hold() -> anyhow::Result<()> {
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let mut bridge = Bridge::new(&a.url(), &b.url(), dir.path(), &["x"]);
    bridge.shared_outbox = false;
    bridge.policy = vec!["max_payload_bytes: 1024".into()];
    let collector = bridge.collector().await?;
    let mut agent = bridge.start_agent().await?;
    publish_seq(&a.url(), &bridge.input(), 0..5, QoS::AtLeastOnce).await?;
    let big = PublishOptions {
        payload_size: 2000,
        ..Default::default()
    };
    publish_seq_with(&a.url(), &bridge.input(), 100..102, QoS::AtLeastOnce, big).await?;
    publish_seq(&a.url(), &bridge.input(), 5..10, QoS::AtLeastOnce).await?;
    collector
        .wait_for(&bridge.output("x"), 0..10, DELIVERY)
        .await?;
    // direct_hold counts a message when it is terminal, so "nothing in flight" says nothing
    // about the two DLQ writes: wait for the figures themselves.
    wait::until_ok(DELIVERY, "10 sent and 2 dead-lettered", || {
        let r = agent.metrics().and_then(|m| {
            let c = m.binding("r", "x");
            anyhow::ensure!(
                (c.received, c.sent, c.dead_lettered, c.dropped) == (12, 10, 2, 0)
                    && c.is_conserved(),
                "{c:?}"
            );
            Ok(())
        });
        std::future::ready(r)
    })
    .await?;
    assert_eq!(collector.counts().count(&bridge.output("x"), 100), 0);
    let listed = dlq_client(&agent)
        .await?
        .list_dlq_entries(pb::ListDlqEntriesRequest::default())
        .await?
        .into_inner();
    assert_eq!(listed.entries.len(), 2);
    assert!(
        listed.entries[0].last_error.contains("exceeds"),
        "{listed:?}"
    );
    let status = agent.terminate(Duration::from_secs(15)).await?;
    assert!(status.success(), "{status}");
    Ok(())
}

/// An invalid configuration exits 2, listing the problem, without connecting to the broker;
/// a store that cannot be opened exits 1 with a clear message. (A data directory that cannot
/// be created: `first_run`.)
#[tokio::test]
async fn bad_configurations_fail_before_connecting() -> anyhow::Result<()> {
    let broker = std::net::TcpListener::bind("127.0.0.1:0")?;
    broker.set_nonblocking(true)?;
    let url = format!("tcp://{}", broker.local_addr()?);
    let dir = tempfile::tempdir()?;
    let mut bridge = Bridge::new(&url, &url, dir.path(), &["x"]);

    let run = |yaml: String| -> anyhow::Result<ChildProcess> {
        let path = dir.path().join(format!("{}.yaml", ids::unique("config")));
        std::fs::write(&path, yaml)?;
        ChildProcess::spawn(
            project_bin("ferry-agent")?,
            ["run", "--config", &path.display().to_string()],
            [("RUST_LOG", "info")],
        )
    };

    let invalid = bridge
        .yaml()
        .replace("bindings: [x]", "bindings: [to-nowhere]");
    let mut agent = run(invalid)?;
    let status = agent.wait_exit(Duration::from_secs(15)).await?;
    assert_eq!(status.code(), Some(2), "{}", agent.output_tail());
    assert!(
        agent.stderr().contains("unknown binding"),
        "{}",
        agent.output_tail()
    );
    assert!(
        matches!(broker.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "no connection before the configuration is known to be valid"
    );

    // The stores' directory is created when missing; a store path that is a directory is not
    // a database.
    let stores = dir.path().join("stores");
    std::fs::create_dir_all(stores.join("outbox.db"))?;
    bridge.dir = stores;
    let mut agent = run(bridge.yaml())?;
    let status = agent.wait_exit(Duration::from_secs(15)).await?;
    assert_eq!(status.code(), Some(1), "{}", agent.output_tail());
    assert!(
        agent.stderr().contains("cannot open"),
        "{}",
        agent.output_tail()
    );
    Ok(())
}

/// SIGTERM while direct_hold deliveries wait for a destination that is down: the agent exits 0
/// within the grace period, leaving them unacknowledged; broker A redelivers them to the next
/// run, which delivers them once the destination is back. Nothing is dead-lettered.
#[tokio::test]
async fn shutdown_leaves_held_deliveries_to_the_source() -> anyhow::Result<()> {
    let a = Mosquitto::start().await?;
    let mut b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let mut bridge = Bridge::new(&a.url(), &b.url(), dir.path(), &["x"]);
    bridge.shared_outbox = false;
    let collector = bridge.collector().await?;
    let mut agent = bridge.start_agent().await?;
    b.stop().await?;
    publish_seq(&a.url(), &bridge.input(), 0..5, QoS::AtLeastOnce).await?;
    let started = std::time::Instant::now();
    let status = agent.terminate(Duration::from_secs(20)).await?;
    assert!(status.success(), "{status}\n{}", agent.tail());
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "within the grace period"
    );

    b.restart().await?;
    agent.restart()?;
    agent.wait_ready(Duration::from_secs(20)).await?;
    collector
        .wait_for(&bridge.output("x"), 0..5, DELIVERY)
        .await?;
    wait::until_ok(DELIVERY, "5 sent by the second run", || {
        let r = agent.metrics().and_then(|m| {
            let c = m.binding("r", "x");
            anyhow::ensure!((c.sent, c.dead_lettered, c.dropped) == (5, 0, 0), "{c:?}");
            Ok(())
        });
        std::future::ready(r)
    })
    .await?;
    Ok(())
}
