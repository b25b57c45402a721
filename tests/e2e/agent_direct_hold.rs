//! `direct_hold` under faults: a destination outage longer than the send retry budget, and a
//! dead-letter queue that cannot be written. In both the source keeps the messages (nothing
//! lost), the retry budget is spent only while the destination could be tried, and nothing is
//! sent again and again.

use std::time::{Duration, Instant};

use anyhow::Context;

use ferry_shared::api::v1 as pb;
use ferry_tests::agent::Agent;
use ferry_tests::mqtt::QoS;
use ferry_tests::{Mosquitto, PublishOptions, publish_seq, publish_seq_with, wait};

use crate::agent_support::{Bridge, dlq_client};

const DELIVERY: Duration = Duration::from_secs(60);

/// `sent`, `dead_lettered` and the law, for the one binding `x` of route `r`.
async fn settled(agent: &Agent, sent: u64, dead_lettered: u64) -> anyhow::Result<()> {
    wait::until_ok(
        DELIVERY,
        &format!("{sent} sent and {dead_lettered} dead-lettered"),
        || {
            let r = agent.metrics().and_then(|m| {
                let c = m.binding("r", "x");
                anyhow::ensure!(
                    (c.sent, c.dead_lettered, c.dropped, c.expired, c.in_flight)
                        == (sent, dead_lettered, 0, 0, 0)
                        && c.received == sent + dead_lettered
                        && c.is_conserved(),
                    "{c:?}"
                );
                Ok(())
            });
            std::future::ready(r)
        },
    )
    .await
}

/// The destination is down for twice the route's `send_retry_budget` while deliveries are
/// held: none is dead-lettered (time spent disconnected does not count), and once the
/// destination is back every held delivery is sent within a few seconds, not after each one's
/// backoff runs out.
#[tokio::test]
async fn an_outage_longer_than_the_retry_budget_dead_letters_nothing() -> anyhow::Result<()> {
    const N: u64 = 30;
    let a = Mosquitto::start().await?;
    let mut b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let mut bridge = Bridge::new(&a.url(), &b.url(), dir.path(), &["x"]);
    bridge.shared_outbox = false;
    bridge.policy = vec![
        "send_retry_budget: 3s".into(),
        // A long backoff ceiling: a delivery must not sleep through the reconnect.
        "retry_backoff:\n        initial_interval: 100ms\n        max_interval: 30s".into(),
    ];
    let collector = bridge.collector().await?;
    let agent = bridge.start_agent().await?;
    publish_seq(&a.url(), &bridge.input(), 0..N / 3, QoS::AtLeastOnce).await?;
    collector
        .wait_for(&bridge.output("x"), 0..N / 3, DELIVERY)
        .await?;

    b.stop().await?;
    publish_seq(&a.url(), &bridge.input(), N / 3..N, QoS::AtLeastOnce).await?;
    // The outage itself: twice the retry budget.
    tokio::time::sleep(Duration::from_secs(6)).await;
    b.restart().await?;
    let restarted = Instant::now();
    wait::until(DELIVERY, "the agent reconnected to the destination", || {
        std::future::ready(
            agent
                .metrics()
                .is_ok_and(|m| m.session("ferry_session_connected", "dst") == 1.0),
        )
    })
    .await?;
    let reconnected = Instant::now();
    collector
        .wait_for(&bridge.output("x"), 0..N, DELIVERY)
        .await?;
    let resumed = reconnected.elapsed();
    eprintln!(
        "session reconnected {:?} after the destination restarted; held deliveries sent {resumed:?} after that",
        reconnected - restarted
    );
    // Each delivery used to sleep out its own backoff (up to 30 s here) after the reconnect.
    assert!(
        resumed < Duration::from_secs(3),
        "held deliveries waited {resumed:?} after the session reconnected"
    );
    settled(&agent, N, 0).await?;
    Ok(())
}

/// A poison message (larger than `max_payload_bytes`) must be dead-lettered, but the DLQ
/// cannot take it (its `max_size_bytes` is smaller than the entry: a full disk). The route
/// keeps the poison and stops taking more instead of settling it unacknowledged, which made
/// the source reconnect and send everything again and again: nothing is sent twice, the
/// source session never reconnects. Once the DLQ has room (a restart with a larger limit) the
/// poison is dead-lettered, everything else delivered, and the redelivered messages are
/// counted as such.
#[tokio::test]
async fn a_dlq_that_cannot_be_written_pauses_intake_without_resending() -> anyhow::Result<()> {
    const N: u64 = 40;
    const WINDOW: u64 = 10;
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let mut bridge = Bridge::new(&a.url(), &b.url(), dir.path(), &["x"]);
    bridge.shared_outbox = false;
    bridge.policy = vec![
        "max_payload_bytes: 1024".into(),
        format!("max_in_flight: {WINDOW}"),
    ];
    bridge.dlq_options = vec!["max_size_bytes: 65536".into()];
    let collector = bridge.collector().await?;
    let mut agent = bridge.start_agent().await?;
    let output = bridge.output("x");

    publish_seq(&a.url(), &bridge.input(), 0..5, QoS::AtLeastOnce).await?;
    collector.wait_for(&output, 0..5, DELIVERY).await?;
    let poison = PublishOptions {
        payload_size: 200 * 1024,
        ..Default::default()
    };
    publish_seq_with(
        &a.url(),
        &bridge.input(),
        1000..1001,
        QoS::AtLeastOnce,
        poison,
    )
    .await?;
    publish_seq(&a.url(), &bridge.input(), 5..N, QoS::AtLeastOnce).await?;

    // While the DLQ is full: the poison is held and nothing more is taken, nothing is sent
    // twice and the source is not reconnected to force redelivery.
    agent
        .process()
        .context("the agent runs")?
        .wait_for_output("pausing intake", DELIVERY)
        .await?;
    // Long enough for the old behaviour (settle unacknowledged → reconnect → resend) to
    // have gone round several times.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let counts = collector.counts();
    assert!(
        counts.duplicates().is_empty(),
        "sent again while the DLQ was full: {:?}",
        counts.duplicates()
    );
    assert!(
        counts.distinct(&output) as u64 <= 5 + WINDOW,
        "intake went on past the in-flight window: {} delivered",
        counts.distinct(&output)
    );
    let m = agent.metrics()?;
    assert_eq!(
        m.session("ferry_session_reconnects_total", "src"),
        0.0,
        "the source session reconnected"
    );
    let c = m.binding("r", "x");
    assert_eq!((c.dead_lettered, c.dropped), (0, 0), "{c:?}");

    // The fault is fixed: room in the DLQ. The held deliveries were never acknowledged, so
    // the source redelivers them to the next run.
    let status = agent.terminate(Duration::from_secs(20)).await?;
    assert!(status.success(), "{status}\n{}", agent.tail());
    bridge.dlq_options = vec!["max_size_bytes: 16777216".into()];
    std::fs::write(dir.path().join("bridge.yaml"), bridge.yaml())?;
    agent.restart()?;
    agent.wait_ready(Duration::from_secs(20)).await?;
    collector.wait_for(&output, 0..N, DELIVERY).await?;
    let stats = dlq_client(&agent)
        .await?
        .get_dlq_stats(pb::GetDlqStatsRequest { filter: None })
        .await?
        .into_inner();
    assert_eq!(stats.total, 1, "the poison is in the DLQ");
    assert_eq!(collector.counts().count(&output, 1000), 0);
    // Sent by the second run: what the first had not acknowledged.
    let m = agent.metrics()?;
    let c = m.binding("r", "x");
    let second_run_sent = c.sent;
    settled(&agent, second_run_sent, 1).await?;
    let counts = collector.counts();
    let duplicates: u32 = counts.duplicates().iter().map(|(_, _, n)| n - 1).sum();
    assert!(
        u64::from(duplicates) <= WINDOW,
        "{duplicates} duplicates for an in-flight window of {WINDOW}"
    );
    let redelivered = m.route("ferry_messages_redelivered_total", "r");
    assert!(
        redelivered >= 1.0,
        "the redelivered poison is counted as a redelivery ({redelivered})"
    );
    Ok(())
}
