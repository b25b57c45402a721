//! Stateless agents (issue 19): two agents run one bridge on one shared outbox and lease.
//!
//! [`Pair`] is the shared set-up (two brokers, a collector, two agents on the same `stores:`
//! block, a paced publisher, the conservation check); each test is one scenario on it, with the
//! stores it is about: the drainer SIGKILLed mid-run ([`killed_drainer_is_replaced`]) on
//! PostgreSQL, on DynamoDB (moto) or with a control plane's lease, and the drainer paused with
//! SIGSTOP past its lease and resumed.

use std::ops::Range;
use std::time::{Duration, Instant};

use ferry_tests::agent::Agent;
use ferry_tests::ids;
use ferry_tests::moto::{self, Moto};
use ferry_tests::mqtt::QoS;
use ferry_tests::postgres::TestDatabase;
use ferry_tests::{Collector, Counts, Mosquitto, publish_seq, wait};
use tokio::task::JoinHandle;

use crate::agent_support::Bridge;
use crate::control_plane::ControlPlane;

const DELIVERY: Duration = Duration::from_secs(120);

/// The session's `lease_ttl` ([`Bridge::new`]'s `3s`), for the printed figures.
const LEASE_TTL: Duration = Duration::from_secs(3);

/// The DynamoDB test's `lease_ttl`. moto serves one DynamoDB request at a time and copies a
/// table for every transaction: while the new holder's first claim voids the old claims, its
/// lease renewals wait behind those requests, and on a slow machine a 3 s lease lapsed before
/// its renewal came back, again and again (first send 23–110 s after the kill). DynamoDB
/// itself serves requests concurrently in milliseconds.
const MOTO_LEASE_TTL: Duration = Duration::from_secs(10);

/// The session's `drain_batch_size` ([`Bridge::new`]'s `100`).
const DRAIN_BATCH: u64 = 100;

/// A `stores:` block with the outbox and the DLQ on PostgreSQL at `url` and the lease `lease`
/// (its `type:` and `options:` lines, indented for the block).
pub fn postgres_stores(url: &str, lease: &str) -> String {
    format!(
        "stores:\n\
         \x20 outbox:\n    type: postgres\n    options:\n      url: {url}\n      schema: ferry\n\
         \x20 lease:\n{lease}\
         \x20 dlq:\n    type: postgres\n    options:\n      dsn: {url}\n      schema: ferry\n"
    )
}

/// The lease lines of a PostgreSQL lease at `url`.
pub fn postgres_lease(url: &str) -> String {
    format!("    type: postgres\n    options:\n      url: {url}\n      schema: ferry\n")
}

/// Two agents running one bridge (broker A's `{run}/in` → broker B, fan-out to `x`, `y`, `z`)
/// on one `stores:` block. Both subscribe to the source with plain subscriptions, so each
/// message is appended once by each: a destination sees it at least twice, counted distinct.
pub struct Pair {
    pub bridge: Bridge,
    pub collector: Collector,
    pub agents: [Agent; 2],
    source: Mosquitto,
    pub destination: Mosquitto,
    _dirs: [tempfile::TempDir; 2],
}

impl Pair {
    /// Starts the brokers, the collector and both agents (with `env`, e.g. a moto's) on
    /// `stores`; `adjust` edits the bridge (its receiver, session lines) before they start.
    /// The second agent has its own MQTT client ids, so the two do not take each other's
    /// sessions.
    pub async fn start(
        stores: String,
        env: Vec<(String, String)>,
        adjust: impl FnOnce(&mut Bridge),
    ) -> anyhow::Result<Self> {
        let source = Mosquitto::start().await?;
        // Publishes logged with their client id: which agent sent what (the SIGSTOP test).
        let destination = Mosquitto::builder()
            .config_line("log_type debug")
            .start()
            .await?;
        let dirs = [tempfile::tempdir()?, tempfile::tempdir()?];
        let mut bridge = Bridge::new(
            &source.url(),
            &destination.url(),
            dirs[0].path(),
            &["x", "y", "z"],
        );
        bridge.stores = Some(stores);
        adjust(&mut bridge);
        let collector = bridge.collector().await?;
        let run = &bridge.run;
        let second_yaml = bridge.yaml().replace(
            &format!("client_id: {run}-"),
            &format!("client_id: {run}-second-"),
        );
        let mut agents = [
            Agent::start_with_env(dirs[0].path(), &bridge.yaml(), env.clone())?,
            Agent::start_with_env(dirs[1].path(), &second_yaml, env)?,
        ];
        for agent in &mut agents {
            agent.wait_ready(Duration::from_secs(20)).await?;
        }
        Ok(Self {
            bridge,
            collector,
            agents,
            source,
            destination,
            _dirs: dirs,
        })
    }

    /// Agent `i`'s `ferry_messages_sent_total` for binding `x` (0 while it cannot answer, e.g.
    /// stopped).
    pub fn sent(&self, i: usize) -> u64 {
        self.agents[i]
            .metrics()
            .map_or(0, |m| m.binding("r", "x").sent)
    }

    /// Whether agent `i` holds the route's lease (`ferry_lease_held`; false while it cannot
    /// answer).
    pub fn holds_lease(&self, i: usize) -> bool {
        self.agents[i].metrics_text().is_ok_and(|text| {
            text.lines()
                .any(|l| l.starts_with("ferry_lease_held{") && l.ends_with(" 1"))
        })
    }

    /// Publishes `seqs` (QoS 1) in chunks of `chunk`, `pause` apart, in a task.
    pub fn publish(
        &self,
        seqs: Range<u64>,
        chunk: u64,
        pause: Duration,
    ) -> JoinHandle<anyhow::Result<()>> {
        let (source, topic) = (self.source.url(), self.bridge.input());
        tokio::spawn(async move {
            for start in seqs.clone().step_by(usize::try_from(chunk)?) {
                let end = (start + chunk).min(seqs.end);
                publish_seq(&source, &topic, start..end, QoS::AtLeastOnce).await?;
                tokio::time::sleep(pause).await;
            }
            anyhow::Ok(())
        })
    }

    /// Waits for every message `0..n` on every binding's topic (the conservation law: these
    /// bridges have no DLQ outcome, so every message must be delivered), and returns the
    /// counts.
    pub async fn conserved(&self, n: u64) -> anyhow::Result<Counts> {
        let mut counts = self.collector.counts();
        for binding in &self.bridge.bindings {
            counts = self
                .collector
                .wait_for(&self.bridge.output(binding), 0..n, DELIVERY)
                .await?;
        }
        for binding in &self.bridge.bindings {
            let topic = self.bridge.output(binding);
            assert_eq!(counts.distinct(&topic), n as usize, "{topic}");
            println!(
                "{topic}: {} distinct of {n}, {} deliveries",
                counts.distinct(&topic),
                deliveries(&counts, &topic, n)
            );
        }
        for agent in &self.agents {
            let tail = agent.tail();
            assert!(!tail.contains("panicked"), "{tail}");
        }
        Ok(counts)
    }
}

/// Deliveries of `0..n` on `topic`, duplicates included.
fn deliveries(counts: &Counts, topic: &str, n: u64) -> u64 {
    (0..n).map(|s| u64::from(counts.count(topic, s))).sum()
}

/// The drainer (the agent that has sent) once a third of the deliveries arrived; asserts
/// that the other has sent nothing (one drainer at a time).
async fn drainer(pair: &Pair, n: u64) -> anyhow::Result<usize> {
    let bindings = pair.bridge.bindings.len() as u64;
    pair.collector
        .wait_for_total(n * bindings / 3, DELIVERY)
        .await?;
    let drainer = usize::from(pair.sent(1) > pair.sent(0));
    assert_eq!(pair.sent(1 - drainer), 0, "two agents drained at once");
    Ok(drainer)
}

/// The kill scenario on `stores`: the drainer holding the lease is SIGKILLed once a third of
/// the deliveries arrived; the other takes its lease over and delivers the rest, and every
/// message reaches every destination (`n` messages). Returns the time from the kill to the
/// survivor's first send (its own `ferry_messages_sent_total`, not the collector: deliveries
/// the killed agent had sent may still arrive after the kill), which it also prints, labelled
/// `lease`, with the time to the takeover itself (the survivor's `ferry_lease_held`).
pub async fn killed_drainer_is_replaced(
    stores: String,
    env: Vec<(String, String)>,
    lease: &str,
    lease_ttl: Duration,
    n: u64,
) -> anyhow::Result<Duration> {
    let mut pair = Pair::start(stores, env, |bridge| {
        for option in &mut bridge.session {
            if option.starts_with("lease_ttl:") {
                *option = format!("lease_ttl: {}s", lease_ttl.as_secs());
            }
        }
    })
    .await?;
    let publisher = pair.publish(0..n, 150, Duration::from_millis(100));
    let drainer = drainer(&pair, n).await?;
    pair.agents[drainer].kill()?;
    let killed = Instant::now();
    let at_kill = pair.collector.counts().total();
    let survivor = 1 - drainer;
    wait::until(DELIVERY, "the survivor's lease", || {
        std::future::ready(pair.holds_lease(survivor))
    })
    .await?;
    let takeover = killed.elapsed();
    wait::until(DELIVERY, "a send by the survivor", || {
        std::future::ready(pair.sent(survivor) > 0)
    })
    .await
    .map_err(|e| e.context(pair.agents[survivor].tail()))?;
    let failover = killed.elapsed();
    println!(
        "failover ({lease} lease): kill of agent {drainer} -> lease held by the survivor: {} ms, \
         -> its first send: {} ms (lease_ttl {} s; {at_kill} deliveries before)",
        takeover.as_millis(),
        failover.as_millis(),
        lease_ttl.as_secs()
    );
    publisher.await??;
    pair.conserved(n).await?;
    Ok(failover)
}

#[tokio::test]
async fn a_killed_drainer_is_replaced_by_the_other_agent_and_nothing_is_lost() -> anyhow::Result<()>
{
    let database = TestDatabase::create().await?;
    let url = database.url()?;
    killed_drainer_is_replaced(
        postgres_stores(&url, &postgres_lease(&url)),
        Vec::new(),
        "postgres",
        LEASE_TTL,
        1500,
    )
    .await?;
    Ok(())
}

/// The same on DynamoDB (moto), with fewer messages: every store call is an HTTP round trip
/// to moto, which serves DynamoDB requests one at a time (`tests/moto_server.py`) and copies a
/// whole table for every transaction, so the run is slower than on PostgreSQL and the
/// failover figure printed is moto's, not DynamoDB's. A moto of its own: on the suite's shared
/// one, this test's requests queued behind every other DynamoDB test's (51 of 150 messages in
/// 120 s once in CI).
#[tokio::test]
async fn a_killed_drainer_is_replaced_by_the_other_agent_on_dynamodb() -> anyhow::Result<()> {
    let moto = Moto::start_private().await?;
    let table = |store: &str| {
        format!(
            "\x20 {store}:\n    type: dynamodb\n    options:\n      table_name: {}\n      \
             region: {}\n      endpoint_url: {}\n      create_tables: true\n",
            ids::unique(store),
            moto::REGION,
            moto.endpoint()
        )
    };
    let env = moto
        .env()
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    let stores = format!(
        "stores:\n{}{}{}",
        table("outbox"),
        table("lease"),
        table("dlq")
    );
    killed_drainer_is_replaced(stores, env, "dynamodb", MOTO_LEASE_TTL, 90).await?;
    Ok(())
}

/// The same with the lease kept by a control plane process (its own SQLite state): the
/// survivor is granted the lease once the control plane's grant to the killed agent expired.
#[tokio::test]
async fn a_killed_drainer_is_replaced_under_a_control_plane_lease() -> anyhow::Result<()> {
    let database = TestDatabase::create().await?;
    let url = database.url()?;
    let cp = ControlPlane::start(None).await?;
    let lease = format!(
        "    type: control_plane\n    options:\n      endpoint: {}\n",
        cp.endpoint()
    );
    killed_drainer_is_replaced(
        postgres_stores(&url, &lease),
        Vec::new(),
        "control_plane",
        LEASE_TTL,
        1500,
    )
    .await?;
    Ok(())
}

/// The drainer is paused with SIGSTOP while it drains, past its lease: the other agent takes
/// the lease over (a higher version) and drains. Then SIGCONT. What the test can assert, and
/// why no more:
///
/// - The resumed agent stops draining on its own: its clock says its grant expired (it logs
///   `lease lost; stopped draining`), and when it asks for the lease again it is held by the
///   survivor (if the survivor, on an overloaded machine, lost it meanwhile, the test says so
///   and fails: the scenario did not happen).
/// - A completion, claim or release it still issued under the old version is refused by the
///   store as stale and counted in its `ferry_store_fenced_total`; whether there is one depends
///   on where the pause fell (a cycle whose sends answered before its lease keeper noticed the
///   expiry gives its queued records back, refused as stale), so the count is printed, not
///   asserted. The stores' conformance suites check the fence itself, deterministically.
/// - It sends nothing the new holder already sent beyond what it had in flight at the pause:
///   a cycle starts no send and no claim past the grant's expiry on the agent's own clock,
///   even when it runs before the lease keeper noticed the loss, and gives its queued records
///   back. The destination hangs for a second before the pause, so that the paused agent has
///   publishes in flight; the broker takes them when it resumes, while the agent is still
///   stopped (a second after the hang the agent has written them to its socket). The
///   destination's log names each publish's client id: the resumed agent publishes nothing
///   between its SIGCONT and the moment it learns the lease is held (before the fix it
///   published its queued records, up to `SEND_WINDOW` (32) per binding).
/// - The new holder sends again what the paused agent had claimed and not completed (the
///   at-least-once duplicate): the deliveries beyond the two per message and binding that the
///   two plain subscriptions give (each agent appends every message once) are more than zero
///   (or the scenario did not happen) and at most its unsettled window, `3 ×
///   drain_batch_size` records, plus the source's window if its source session was dropped
///   during the pause (the broker redelivers up to `max_in_flight` unacknowledged messages,
///   appended again).
/// - Every message reaches every destination (the conservation law).
#[tokio::test]
async fn a_drainer_paused_past_its_lease_is_fenced_out_when_it_resumes() -> anyhow::Result<()> {
    const N: u64 = 1500;
    // The route's default `max_in_flight`: the source's redelivery window.
    const MAX_IN_FLIGHT: u64 = 100;
    let database = TestDatabase::create().await?;
    let url = database.url()?;
    let mut pair = Pair::start(
        postgres_stores(&url, &postgres_lease(&url)),
        Vec::new(),
        |_| {},
    )
    .await?;
    // About 8 s of publishing: the pause (a lease TTL and the takeover) falls inside it.
    let publisher = pair.publish(0..N, 50, Duration::from_millis(200));
    let paused = drainer(&pair, N / 2).await?;
    let other = 1 - paused;
    let lease_lost = |agent: &Agent| agent.output().matches("stopped draining").count();
    let lost_before = lease_lost(&pair.agents[paused]);
    // The destination hangs for a second first, so that the drainer is paused with sends in
    // flight (published, not yet acknowledged) and records claimed: the destination takes
    // those publishes once it resumes, and the new holder sends the same records again.
    pair.destination.stop_signal()?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    pair.agents[paused].stop()?;
    let stopped = Instant::now();
    pair.destination.cont()?;
    wait::until(DELIVERY, "the other agent to take over and send", || {
        std::future::ready(pair.sent(other) > 0)
    })
    .await?;
    println!(
        "takeover while agent {paused} is stopped: {} ms after SIGSTOP (lease_ttl {} s)",
        stopped.elapsed().as_millis(),
        LEASE_TTL.as_secs()
    );
    // The destination has taken (and logged) what the paused agent had written before the
    // pause; from now on its log shows what the agent publishes after it resumed.
    let publisher_id = format!(
        "{}-{}out",
        pair.bridge.run,
        if paused == 0 { "" } else { "second-" }
    );
    let published = |pair: &Pair| {
        pair.destination
            .log()
            .matches(&format!("Received PUBLISH from {publisher_id} ("))
            .count()
    };
    let published_before_resume = published(&pair);
    anyhow::ensure!(
        published_before_resume > 0,
        "the destination logged no publish from {publisher_id}"
    );
    let count = |agent: &Agent, line: &str| agent.output().matches(line).count();
    let (acquired, refused) = ("lease acquired", "lease held by another agent");
    let acquired_before = count(&pair.agents[paused], acquired);
    let refused_before = count(&pair.agents[paused], refused);
    pair.agents[paused].cont()?;
    let resumed = &pair.agents[paused];
    // The checkpoint: the resumed agent stopped draining and then asked for the lease again
    // (its cycle was dropped by then, and what it published meanwhile reached the broker).
    wait::until(
        DELIVERY,
        "the resumed agent to stop draining and ask again",
        || {
            std::future::ready(
                lease_lost(resumed) > lost_before
                    && (count(resumed, refused) > refused_before
                        || count(resumed, acquired) > acquired_before),
            )
        },
    )
    .await?;
    anyhow::ensure!(
        count(resumed, acquired) == acquired_before,
        "the survivor did not keep the lease (its renewals failed?), so the resumed agent took \
         it back at once: the scenario did not happen\n{}",
        pair.agents[other].tail()
    );
    let published_after_resume = published(&pair) - published_before_resume;
    println!(
        "publishes by the paused agent: {published_before_resume} before it resumed, \
         {published_after_resume} after (until it learned that the lease is held)"
    );
    assert_eq!(
        published_after_resume, 0,
        "the resumed agent published after its lease expired"
    );
    publisher.await??;
    pair.conserved(N).await?;
    // Each agent appended every message: wait for both copies before counting the extra ones.
    let counts = wait::until_ok(DELIVERY, "two copies of every message", || {
        let counts = pair.collector.counts();
        let short: usize = pair
            .bridge
            .bindings
            .iter()
            .map(|b| {
                let topic = pair.bridge.output(b);
                (0..N).filter(|&s| counts.count(&topic, s) < 2).count()
            })
            .sum();
        std::future::ready(if short == 0 {
            Ok(counts)
        } else {
            Err(anyhow::anyhow!("{short} delivered fewer than twice"))
        })
    })
    .await?;

    let resumed = pair.agents[paused].metrics()?;
    let fenced = fenced(&pair.agents[paused].metrics_text()?);
    println!("the resumed agent's operations refused as stale: {fenced}");

    let source_reconnected = resumed.session("ferry_session_reconnects_total", "src") > 0.0;
    let bindings = pair.bridge.bindings.len() as u64;
    let window = 3 * DRAIN_BATCH
        + if source_reconnected {
            MAX_IN_FLIGHT * bindings
        } else {
            0
        };
    let extra: u64 = pair
        .bridge
        .bindings
        .iter()
        .map(|b| deliveries(&counts, &pair.bridge.output(b), N) - 2 * N)
        .sum();
    println!(
        "deliveries beyond two per message and binding: {extra} (window {window}, source \
         session reconnected: {source_reconnected})"
    );
    assert!(
        extra <= window,
        "{extra} extra deliveries: more than the paused agent had claimed"
    );
    assert!(
        extra > 0,
        "the paused agent had nothing in flight: the scenario did not happen"
    );
    Ok(())
}

/// The sum of `ferry_store_fenced_total` over every store and operation in a `/metrics` text.
fn fenced(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("ferry_store_fenced_total"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<u64>().ok())
        .sum()
}
