//! A store outage is a known outcome (issue 19, item 5): the agent's PostgreSQL outbox, lease
//! and DLQ are reached through a [`TcpProxy`] that the test cuts for 10 s mid-run while the
//! source keeps publishing. The agent must stop acknowledging its source (nothing is appended,
//! so nothing is settled), say so (`/readyz`, the held delivery's log line), take nothing more
//! while the store is away, and finish the run by itself once it is back, with every message
//! at every destination.

use std::net::ToSocketAddrs;
use std::time::{Duration, Instant};

use anyhow::Context;
use ferry_tests::mqtt::QoS;
use ferry_tests::postgres::TestDatabase;
use ferry_tests::proxy::TcpProxy;
use ferry_tests::{Mosquitto, publish_seq, wait};

use crate::agent_failover::{postgres_lease, postgres_stores};
use crate::agent_support::Bridge;

const DELIVERY: Duration = Duration::from_secs(120);
const OUTAGE: Duration = Duration::from_secs(10);
/// Once every message arrived, how long the agent may take to settle its counters and be ready.
const SETTLE: Duration = Duration::from_secs(30);

// Multi-threaded: the proxy forwards on the test's runtime, which the harness's blocking
// `/readyz` and `/metrics` requests would otherwise stall.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_outage_pauses_intake_and_the_run_completes_after_it() -> anyhow::Result<()> {
    const N: u64 = 600;
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let database = TestDatabase::create().await?;
    let (host, port) = database.server_address()?;
    let target = (host.as_str(), port)
        .to_socket_addrs()?
        .next()
        .context("no address for the PostgreSQL server")?;
    let proxy = TcpProxy::start(target).await?;
    let url = database.url_via(&proxy.addr().to_string())?;
    let dir = tempfile::tempdir()?;
    let mut bridge = Bridge::new(&a.url(), &b.url(), dir.path(), &["x", "y", "z"]);
    bridge.stores = Some(postgres_stores(&url, &postgres_lease(&url)));
    let collector = bridge.collector().await?;
    let mut agent = bridge.start_agent().await?;

    // About 15 s of publishing, so that messages keep arriving through the whole outage.
    let (source, topic) = (a.url(), bridge.input());
    let publisher = tokio::spawn(async move {
        for start in (0..N).step_by(20) {
            publish_seq(&source, &topic, start..start + 20, QoS::AtLeastOnce).await?;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        anyhow::Ok(())
    });
    collector.wait_for_total(60, DELIVERY).await?;

    proxy.cut().await;
    let cut = Instant::now();
    let unready = wait::until_ok(DELIVERY, "/readyz to name the failing outbox", || {
        let r = agent.readyz().and_then(|(status, body)| {
            anyhow::ensure!(status == 503, "{status} {body}");
            anyhow::ensure!(body.contains("store outbox: unavailable"), "{body}");
            Ok(body)
        });
        std::future::ready(r)
    })
    .await?;
    println!("during the outage /readyz says: {}", unready.trim());
    // No append can commit while every connection is refused, and a delivery is settled
    // only after its append committed: what the agent counts as received (appended)
    // must not move until the store is back.
    let received = |agent: &ferry_tests::Agent| -> anyhow::Result<u64> {
        Ok(agent.metrics()?.binding("r", "x").received)
    };
    let at_failure = received(&agent)?;
    tokio::time::sleep(OUTAGE.saturating_sub(cut.elapsed())).await;
    let before_restore = received(&agent)?;
    let delivered_in_outage = collector.counts().total();
    assert_eq!(
        before_restore, at_failure,
        "messages were appended (and acknowledged) while the outbox was unreachable"
    );
    let output = agent.output();
    assert!(output.contains("pausing intake"), "{output}");
    proxy.restore().await?;
    let restored = Instant::now();

    publisher.await??;
    let mut counts = collector.counts();
    for binding in &bridge.bindings {
        counts = collector
            .wait_for(&bridge.output(binding), 0..N, DELIVERY)
            .await?;
    }
    println!(
        "outage {} s: {at_failure} appended per binding before it, {delivered_in_outage} \
         deliveries by its end; all {N} delivered {} ms after the restore",
        OUTAGE.as_secs(),
        restored.elapsed().as_millis()
    );
    for binding in &bridge.bindings {
        let topic = bridge.output(binding);
        assert_eq!(counts.distinct(&topic), N as usize, "{topic}");
    }
    // The agent's own counters: every message sent on every binding, nothing dropped,
    // dead-lettered or expired. (Not `in_flight == 0`: an append whose COMMIT answer was lost
    // in the cut may have committed, and its retry stores the message twice; the copy counts
    // as sent but was never counted received: the agent cannot tell.) A completion whose
    // COMMIT answer was lost in the cut is counted when the drainer writes it again under
    // the same lease version; if the grant lapsed in the outage (renewals failed for
    // 10 s of a 15 s TTL), that write is void and its records stay in `in_flight` though
    // the outbox holds nothing for the binding any more (its depth, read from the store,
    // is 0): only those may make up for `sent`.
    let delivered = Instant::now();
    let settled = wait::until_ok(SETTLE, "every binding's sends counted", || {
        let outcome = agent.metrics().and_then(|m| {
            let counts: Vec<_> = bridge.bindings.iter().map(|b| m.binding("r", b)).collect();
            for (c, b) in counts.iter().zip(&bridge.bindings) {
                let emptied = m.get("ferry_outbox_depth", "r", b) == 0.0
                    && c.sent + u64::try_from(c.in_flight).unwrap_or(0) >= N;
                anyhow::ensure!(c.sent >= N || emptied, "{b}: {c:?}");
            }
            Ok(counts)
        });
        std::future::ready(outcome)
    })
    .await
    .with_context(|| format!("the agent's log ends:\n{}", agent.tail()))?;
    println!(
        "counters settled {} ms after the last delivery: {settled:?}",
        delivered.elapsed().as_millis()
    );
    for c in &settled {
        assert_eq!(c.dropped + c.dead_lettered + c.expired, 0, "{c:?}");
    }
    // Ready again once every kind of operation that failed succeeded since.
    agent.wait_ready(SETTLE).await?;
    println!(
        "ready again {} ms after the last delivery",
        delivered.elapsed().as_millis()
    );
    assert!(!agent.tail().contains("panicked"), "{}", agent.tail());
    Ok(())
}
