//! Stateless agents (issue 19): two agents run one bridge on one PostgreSQL outbox and lease.
//! The one draining is SIGKILLed mid-run; the other takes its lease over and delivers what is
//! left, and every message reaches every destination.

use std::time::{Duration, Instant};

use ferry_tests::agent::Agent;
use ferry_tests::mqtt::QoS;
use ferry_tests::postgres::TestDatabase;
use ferry_tests::{Mosquitto, publish_seq, wait};

use crate::agent_support::Bridge;

const DELIVERY: Duration = Duration::from_secs(120);

/// Both agents subscribe to the source (plain subscriptions, so each message is appended once
/// by each: a destination sees it at least once, counted distinct). The drainer holding the
/// lease is killed once a third of the deliveries arrived; prints the time from the kill to
/// the survivor's first send (its `ferry_messages_sent_total`; lease TTL 3 s).
#[tokio::test]
async fn a_killed_drainer_is_replaced_by_the_other_agent_and_nothing_is_lost() -> anyhow::Result<()>
{
    const N: u64 = 3000;
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let database = TestDatabase::create().await?;
    let url = database.url()?;
    let (first_dir, second_dir) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let mut bridge = Bridge::new(&a.url(), &b.url(), first_dir.path(), &["x", "y", "z"]);
    bridge.stores = Some(format!(
        "stores:\n\
         \x20 outbox:\n    type: postgres\n    options:\n      url: {url}\n      schema: ferry\n\
         \x20 lease:\n    type: postgres\n    options:\n      url: {url}\n      schema: ferry\n\
         \x20 dlq:\n    type: postgres\n    options:\n      dsn: {url}\n      schema: ferry\n"
    ));
    let collector = bridge.collector().await?;
    let first = bridge.start_agent().await?;
    // The second agent's own MQTT client ids, so the two do not take each other's sessions.
    let run = &bridge.run;
    let second_yaml = bridge.yaml().replace(
        &format!("client_id: {run}-"),
        &format!("client_id: {run}-second-"),
    );
    let mut second = Agent::start(second_dir.path(), &second_yaml)?;
    second.wait_ready(Duration::from_secs(20)).await?;
    let mut agents = [first, second];

    let (source, topic) = (a.url(), bridge.input());
    let publisher = tokio::spawn(async move {
        for start in (0..N).step_by(250) {
            publish_seq(&source, &topic, start..start + 250, QoS::AtLeastOnce).await?;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::Ok(())
    });
    let bindings = bridge.bindings.len() as u64;
    collector.wait_for_total(N * bindings / 3, DELIVERY).await?;
    let sent = |agent: &Agent| agent.metrics().map_or(0, |m| m.binding("r", "x").sent);
    let drainer = usize::from(sent(&agents[1]) > sent(&agents[0]));
    // Only the lease holder sends: the other agent has sent nothing yet.
    assert_eq!(sent(&agents[1 - drainer]), 0, "two agents drained at once");
    agents[drainer].kill()?;
    let killed = Instant::now();
    let at_kill = collector.counts().total();
    // The survivor's own counter, not the collector: deliveries the killed agent had sent
    // may still arrive after the kill.
    let survivor = &agents[1 - drainer];
    wait::until(DELIVERY, "a send by the survivor", || {
        std::future::ready(sent(survivor) > 0)
    })
    .await?;
    let failover = killed.elapsed();
    println!(
        "failover: kill of agent {drainer} -> first send by the survivor: {} ms \
         (lease_ttl 3s; {at_kill} deliveries before)",
        failover.as_millis()
    );
    publisher.await??;
    let mut counts = collector.counts();
    for binding in &bridge.bindings {
        counts = collector
            .wait_for(&bridge.output(binding), 0..N, DELIVERY)
            .await?;
    }
    for binding in &bridge.bindings {
        let topic = bridge.output(binding);
        assert_eq!(counts.distinct(&topic), N as usize, "{topic}");
        println!(
            "{topic}: {} distinct of {N}, {} deliveries",
            counts.distinct(&topic),
            (0..N)
                .map(|s| u64::from(counts.count(&topic, s)))
                .sum::<u64>()
        );
    }
    assert!(!survivor.tail().contains("panicked"), "{}", survivor.tail());
    Ok(())
}
