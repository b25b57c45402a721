//! Stateless agents (issue 19): two agents run one bridge on one shared outbox and lease
//! (PostgreSQL, DynamoDB). The one draining is SIGKILLed mid-run; the other takes its lease
//! over and delivers what is left, and every message reaches every destination.

use std::time::{Duration, Instant};

use ferry_tests::agent::Agent;
use ferry_tests::ids;
use ferry_tests::moto::{self, Moto};
use ferry_tests::mqtt::QoS;
use ferry_tests::postgres::TestDatabase;
use ferry_tests::{Mosquitto, publish_seq, wait};

use crate::agent_support::Bridge;

const DELIVERY: Duration = Duration::from_secs(120);

/// The shared stores of one run: their `stores:` section, the environment the agents need for
/// them, and how many messages to publish.
struct Stores {
    yaml: String,
    env: Vec<(String, String)>,
    messages: u64,
    // Dropped (the database with it) when the test ends.
    _database: Option<TestDatabase>,
}

#[tokio::test]
async fn a_killed_drainer_is_replaced_by_the_other_agent_and_nothing_is_lost() -> anyhow::Result<()>
{
    let database = TestDatabase::create().await?;
    let url = database.url()?;
    failover(Stores {
        yaml: format!(
            "stores:\n\
             \x20 outbox:\n    type: postgres\n    options:\n      url: {url}\n      schema: ferry\n\
             \x20 lease:\n    type: postgres\n    options:\n      url: {url}\n      schema: ferry\n\
             \x20 dlq:\n    type: postgres\n    options:\n      dsn: {url}\n      schema: ferry\n"
        ),
        env: Vec::new(),
        messages: 3000,
        _database: Some(database),
    })
    .await
}

/// The same on DynamoDB (moto), with fewer messages: every store call is an HTTP round trip
/// to moto, and moto copies a whole table for every transaction (to roll it back), so a
/// transaction costs the table's size; concurrent writes to the table sometimes make that
/// copy fail with an HTTP 500, which the agents take as an unavailable store and retry (so
/// the run also shows that nothing is lost when writes fail). The failover figure printed is
/// moto's, slowed by those retries, not DynamoDB's.
#[tokio::test]
async fn a_killed_drainer_is_replaced_by_the_other_agent_on_dynamodb() -> anyhow::Result<()> {
    let moto = Moto::shared().await?;
    let table = |store: &str| {
        format!(
            "\x20 {store}:\n    type: dynamodb\n    options:\n      table_name: {}\n      \
             region: {}\n      endpoint_url: {}\n      create_tables: true\n",
            ids::unique(store),
            moto::REGION,
            moto.endpoint()
        )
    };
    failover(Stores {
        yaml: format!(
            "stores:\n{}{}{}",
            table("outbox"),
            table("lease"),
            table("dlq")
        ),
        env: moto
            .env()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect(),
        messages: 60,
        _database: None,
    })
    .await
}

/// Both agents subscribe to the source (plain subscriptions, so each message is appended once
/// by each: a destination sees it at least once, counted distinct). The drainer holding the
/// lease is killed once a third of the deliveries arrived; prints the time from the kill to
/// the survivor's first send (its `ferry_messages_sent_total`; lease TTL 3 s).
async fn failover(stores: Stores) -> anyhow::Result<()> {
    let n = stores.messages;
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let (first_dir, second_dir) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let mut bridge = Bridge::new(&a.url(), &b.url(), first_dir.path(), &["x", "y", "z"]);
    bridge.stores = Some(stores.yaml.clone());
    let collector = bridge.collector().await?;
    let mut first = Agent::start_with_env(first_dir.path(), &bridge.yaml(), stores.env.clone())?;
    first.wait_ready(Duration::from_secs(20)).await?;
    // The second agent's own MQTT client ids, so the two do not take each other's sessions.
    let run = &bridge.run;
    let second_yaml = bridge.yaml().replace(
        &format!("client_id: {run}-"),
        &format!("client_id: {run}-second-"),
    );
    let mut second = Agent::start_with_env(second_dir.path(), &second_yaml, stores.env.clone())?;
    second.wait_ready(Duration::from_secs(20)).await?;
    let mut agents = [first, second];

    let (source, topic) = (a.url(), bridge.input());
    let publisher = tokio::spawn(async move {
        for start in (0..n).step_by(250) {
            publish_seq(
                &source,
                &topic,
                start..(start + 250).min(n),
                QoS::AtLeastOnce,
            )
            .await?;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::Ok(())
    });
    let bindings = bridge.bindings.len() as u64;
    collector.wait_for_total(n * bindings / 3, DELIVERY).await?;
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
            .wait_for(&bridge.output(binding), 0..n, DELIVERY)
            .await?;
    }
    for binding in &bridge.bindings {
        let topic = bridge.output(binding);
        assert_eq!(counts.distinct(&topic), n as usize, "{topic}");
        println!(
            "{topic}: {} distinct of {n}, {} deliveries",
            counts.distinct(&topic),
            (0..n)
                .map(|s| u64::from(counts.count(&topic, s)))
                .sum::<u64>()
        );
    }
    assert!(!survivor.tail().contains("panicked"), "{}", survivor.tail());
    Ok(())
}
