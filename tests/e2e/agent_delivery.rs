//! The agent's data path end to end: two real Mosquitto brokers, `ferry-agent run` between
//! them with SQLite stores, and MQTT clients publishing to A and counting on B.

use std::ops::Range;
use std::time::Duration;

use anyhow::Context;

use ferry_tests::mqtt::QoS;
use ferry_tests::{Agent, Collector, Mosquitto, publish_seq, wait};

use crate::agent_support::{Bridge, quiesced};

const DELIVERY: Duration = Duration::from_secs(60);

/// Every binding's topic on B received `seqs`.
async fn arrived(bridge: &Bridge, collector: &Collector, seqs: Range<u64>) -> anyhow::Result<()> {
    for binding in &bridge.bindings {
        collector
            .wait_for(&bridge.output(binding), seqs.clone(), DELIVERY)
            .await?;
    }
    Ok(())
}

/// `0..n` arrived on every binding, and the agent settled: each binding received and sent
/// `n`, dropped and dead-lettered none, nothing in flight, the law kept.
async fn all_delivered(
    bridge: &Bridge,
    collector: &Collector,
    agent: &Agent,
    n: u64,
) -> anyhow::Result<()> {
    arrived(bridge, collector, 0..n).await?;
    for c in quiesced(agent, &bridge.bindings, DELIVERY).await? {
        assert_eq!(
            (c.received, c.sent, c.dropped, c.dead_lettered),
            (n, n, 0, 0),
            "{c:?}\n{}",
            agent.tail()
        );
    }
    Ok(())
}

#[tokio::test]
async fn fan_out_reaches_every_destination_and_counts_add_up() -> anyhow::Result<()> {
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let bridge = Bridge::new(&a.url(), &b.url(), dir.path(), &["x", "y", "z"]);
    let collector = bridge.collector().await?;
    let mut agent = bridge.start_agent().await?;

    const N: u64 = 500;
    publish_seq(&a.url(), &bridge.input(), 0..N, QoS::AtLeastOnce).await?;
    all_delivered(&bridge, &collector, &agent, N).await?;
    assert!(
        collector.counts().duplicates().is_empty(),
        "no crash, no duplicate"
    );

    let status = agent.terminate(Duration::from_secs(15)).await?;
    assert!(status.success(), "graceful shutdown exits 0: {status}");
    Ok(())
}

/// An agent beside its brokers reads and sends through their Unix sockets (`unix://`): the
/// messages arrive as over TCP, and when the source broker restarts (and makes its socket
/// anew) the source session connects to it again and loses nothing.
#[tokio::test]
async fn unix_sockets_deliver_across_a_broker_restart() -> anyhow::Result<()> {
    const N: u64 = 200;
    let mut a = Mosquitto::builder().unix_socket().start().await?;
    let b = Mosquitto::builder().unix_socket().start().await?;
    let dir = tempfile::tempdir()?;
    let socket = |broker: &Mosquitto| broker.unix_url().context("a broker's Unix socket");
    let mut bridge = Bridge::new(&socket(&a)?, &b.url(), dir.path(), &["x", "y"]);
    // The test's own clients speak TCP: the collector subscribes on B's port, the agent
    // sends through B's socket.
    let collector = bridge.collector().await?;
    bridge.destination = socket(&b)?;
    let agent = bridge.start_agent().await?;
    let source_connected = |up: bool| {
        let agent = &agent;
        wait::until(DELIVERY, "the source session's state", move || {
            let m = agent.metrics();
            std::future::ready(m.is_ok_and(|m| {
                m.session("ferry_session_connected", "src") == f64::from(u8::from(up))
            }))
        })
    };

    publish_seq(&a.url(), &bridge.input(), 0..N / 2, QoS::AtLeastOnce).await?;
    arrived(&bridge, &collector, 0..N / 2).await?;
    a.stop().await?;
    source_connected(false).await?;
    a.restart().await?;
    source_connected(true).await?;
    publish_seq(&a.url(), &bridge.input(), N / 2..N, QoS::AtLeastOnce).await?;
    all_delivered(&bridge, &collector, &agent, N).await
}

/// A flat-out burst into a small receive window. Mosquitto 2.0.11 does not keep to the
/// receive maximum: once the window is full it queues, and the next PUBACK releases the whole
/// queue at once, far past the 16 windows the delivery channel holds. The receiver must
/// absorb that without leaving deliveries unacknowledged: no reconnect of the source
/// session, hence no redelivery and no duplicate.
#[tokio::test]
async fn a_burst_past_the_receive_window_costs_no_reconnect_and_no_duplicate() -> anyhow::Result<()>
{
    const N: u64 = 5000;
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let mut bridge = Bridge::new(&a.url(), &b.url(), dir.path(), &["x"]);
    bridge.policy.push("max_in_flight: 20".into());
    let collector = bridge.collector().await?;
    let agent = bridge.start_agent().await?;

    publish_seq(&a.url(), &bridge.input(), 0..N, QoS::AtLeastOnce).await?;
    collector
        .wait_for(&bridge.output("x"), 0..N, DELIVERY)
        .await?;
    let quiet = quiesced(&agent, &bridge.bindings, DELIVERY).await?;
    assert_eq!(
        (
            quiet[0].received,
            quiet[0].sent,
            quiet[0].dropped,
            quiet[0].dead_lettered
        ),
        (N, N, 0, 0),
        "{:?}\n{}",
        quiet[0],
        agent.tail()
    );
    let reconnects = agent
        .metrics()?
        .session("ferry_session_reconnects_total", "src");
    assert_eq!(
        reconnects,
        0.0,
        "the source session reconnected\n{}",
        agent.tail()
    );
    let duplicates = collector.counts().duplicates();
    assert!(
        duplicates.is_empty(),
        "no reconnect, no duplicate: {} messages arrived more than once",
        duplicates.len()
    );
    Ok(())
}

/// SIGKILL the agent five times while it drains 10 000 messages fanned out to three topics,
/// restarting it each time: nothing is missing anywhere, and duplicates stay within the
/// in-flight window.
///
/// The bound: a crash can repeat, per destination, (a) the records the drainer had sent but
/// whose outcome was not yet written — a batch's records start only while at most two batches
/// are unsettled, so at most `3 × drain_batch_size` records — and (b) the messages already
/// appended to the outbox whose PUBACK had not reached broker A — at most `max_in_flight`,
/// since the writer holds no more unsettled deliveries. So each destination sees at most
/// `crashes × (3 × drain_batch_size + max_in_flight)` duplicates.
#[tokio::test]
async fn sigkill_during_drain_loses_nothing_and_bounds_duplicates() -> anyhow::Result<()> {
    const N: u64 = 10_000;
    const CRASHES: u64 = 5;
    const BATCH: u64 = 100;
    const IN_FLIGHT: u64 = 200;
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let mut bridge = Bridge::new(&a.url(), &b.url(), dir.path(), &["x", "y", "z"]);
    bridge.policy.push(format!("max_in_flight: {IN_FLIGHT}"));
    bridge.session = vec![
        "drain_interval: 200ms".into(),
        format!("drain_batch_size: {BATCH}"),
        "lease_ttl: 3s".into(),
    ];
    let collector = bridge.collector().await?;
    let mut agent = bridge.start_agent().await?;

    let (url, topic) = (a.url(), bridge.input());
    // A steady upstream of about 2 500 messages a second rather than one burst: Mosquitto
    // 2.0.11 ignores the receive maximum and pushes a restart's whole backlog at once (the
    // receiver absorbs it, see `a_burst_past_the_receive_window_…`).
    let publisher = tokio::spawn(async move {
        for start in (0..N).step_by(250) {
            publish_seq(&url, &topic, start..start + 250, QoS::AtLeastOnce).await?;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::Ok(())
    });
    let bindings = bridge.bindings.len() as u64;
    for crash in 1..=CRASHES {
        // Spread the crashes over the run: after each fifth-or-so of the deliveries.
        let at = crash * N * bindings / (CRASHES + 2);
        collector.wait_for_total(at, DELIVERY).await?;
        agent.kill()?;
        agent.restart()?;
        agent.wait_ready(Duration::from_secs(20)).await?;
    }
    publisher.await??;
    let mut counts = collector.counts();
    for binding in &bridge.bindings {
        counts = collector
            .wait_for(&bridge.output(binding), 0..N, Duration::from_secs(120))
            .await?;
    }
    let bound = CRASHES * (3 * BATCH + IN_FLIGHT);
    for binding in &bridge.bindings {
        let topic = bridge.output(binding);
        let extra: u64 = (0..N)
            .map(|seq| u64::from(counts.count(&topic, seq).saturating_sub(1)))
            .sum();
        println!("{topic}: {extra} duplicates after {CRASHES} crashes (bound {bound})");
        assert!(extra <= bound, "{topic}: {extra} duplicates > {bound}");
    }
    assert!(!agent.tail().contains("panicked"), "{}", agent.tail());
    let counts = quiesced(&agent, &bridge.bindings, DELIVERY).await?;
    assert!(
        counts
            .iter()
            .all(|c| c.dropped == 0 && c.dead_lettered == 0),
        "{counts:?}"
    );
    Ok(())
}

/// The destination broker goes away for 10 s mid-run: the outbox absorbs the backlog,
/// nothing is dead-lettered, and everything arrives once it is back.
#[tokio::test]
async fn destination_outage_is_absorbed_by_the_outbox() -> anyhow::Result<()> {
    const N: u64 = 1000;
    let a = Mosquitto::start().await?;
    let mut b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let bridge = Bridge::new(&a.url(), &b.url(), dir.path(), &["x", "y"]);
    let collector = bridge.collector().await?;
    let agent = bridge.start_agent().await?;

    publish_seq(&a.url(), &bridge.input(), 0..N / 2, QoS::AtLeastOnce).await?;
    arrived(&bridge, &collector, 0..N / 2).await?;
    b.stop().await?;
    publish_seq(&a.url(), &bridge.input(), N / 2..N, QoS::AtLeastOnce).await?;
    // The source is drained into the outbox while the destination is away.
    wait::until(DELIVERY, "the backlog in the outbox", || {
        let m = agent.metrics();
        std::future::ready(m.is_ok_and(|m| {
            bridge
                .bindings
                .iter()
                .all(|b| m.binding("r", b).received == N)
        }))
    })
    .await?;
    // The outage itself: ten seconds, as the scenario says.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let m = agent.metrics()?;
    for binding in &bridge.bindings {
        let c = m.binding("r", binding);
        assert_eq!(c.dead_lettered, 0, "{c:?}");
        assert!(c.in_flight > 0, "the backlog waits in the outbox: {c:?}");
    }
    b.restart().await?;
    all_delivered(&bridge, &collector, &agent, N).await
}

/// A small `max_outbox_depth` with the destination down: intake stops at the limit (the
/// broker keeps the rest), and everything arrives after the destination returns.
#[tokio::test]
async fn a_full_outbox_stops_intake_and_loses_nothing() -> anyhow::Result<()> {
    const N: u64 = 300;
    const DEPTH: u64 = 50;
    // The receiver's channel (16 receive windows = 320) holds the whole backlog: Mosquitto
    // 2.0.11 was seen sending past the v5 receive maximum.
    const IN_FLIGHT: u64 = 20;
    let a = Mosquitto::start().await?;
    let mut b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let mut bridge = Bridge::new(&a.url(), &b.url(), dir.path(), &["x"]);
    bridge.policy = vec![
        format!("max_outbox_depth: {DEPTH}"),
        format!("max_in_flight: {IN_FLIGHT}"),
    ];
    let collector = bridge.collector().await?;
    let agent = bridge.start_agent().await?;
    b.stop().await?;
    publish_seq(&a.url(), &bridge.input(), 0..N, QoS::AtLeastOnce).await?;
    wait::until(DELIVERY, "the outbox to fill up", || {
        let m = agent.metrics();
        std::future::ready(m.is_ok_and(|m| m.binding("r", "x").received >= DEPTH))
    })
    .await?;
    // Stopping is an absence of progress: give intake time to run past the limit if it would.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let c = agent.metrics()?.binding("r", "x");
    assert!(
        c.received <= DEPTH + IN_FLIGHT,
        "intake stops at max_outbox_depth (+ appends in flight): {c:?}"
    );
    assert_eq!((c.sent, c.dropped, c.dead_lettered), (0, 0, 0), "{c:?}");

    b.restart().await?;
    collector
        .wait_for(&bridge.output("x"), 0..N, DELIVERY)
        .await?;
    let counts = quiesced(&agent, &bridge.bindings, DELIVERY).await?;
    assert_eq!(
        (counts[0].received, counts[0].sent),
        (N, N),
        "{counts:?}\n{}",
        agent.tail()
    );
    Ok(())
}
