//! Issue 13's fleet acceptance, with processes (a control plane, managed agents, real
//! Mosquitto brokers, `ferryctl`):
//! - a live change pushed with `ferryctl apply` while 5 000 messages flow: a route added, one
//!   changed (a binding added), one removed; nothing lost on the unchanged and changed routes,
//!   the unchanged route's sessions never reconnect, the conservation law holds exactly per
//!   binding, and `ferryctl get agents` shows the new ACKed version;
//! - two managed agents run one bridge with a `control_plane` lease: only the holder drains
//!   (the other's copies wait in its own outbox, and nothing reaches the destination twice);
//!   SIGKILL the holder and the other takes the lease at a higher fencing version and drains.
//!   The failover time (kill → first send by the survivor) is printed.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use ferry_tests::mqtt::QoS;
use ferry_tests::{Mosquitto, ids, publish_seq, wait};
use serde_json::Value;

use crate::agent_managed::{ManagedAgent, agent_info, apply, ferryctl, running};
use crate::agent_reload::{R, Setup, reconnects, stream};
use crate::agent_support::Bridge;
use crate::control_plane::ControlPlane;

const DELIVERY: Duration = Duration::from_secs(60);

#[tokio::test]
async fn ferryctl_apply_adds_changes_and_removes_routes_while_messages_flow() -> anyhow::Result<()>
{
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let cp = ControlPlane::start(None).await?;
    let dir = tempfile::tempdir()?;
    let s = Setup {
        run: ids::unique("fleet"),
        a: a.url(),
        b: b.url(),
        dir: dir.path().join("stores"),
    };
    std::fs::create_dir_all(&s.dir)?;
    let keep = || R {
        id: "keep",
        shared_outbox: true,
        bindings: &["k1"],
        ..R::default()
    };
    let v1 = s.yaml(&[
        keep(),
        R {
            id: "grow",
            shared_outbox: true,
            bindings: &["g1"],
            ..R::default()
        },
        R {
            id: "gone",
            shared_outbox: false,
            bindings: &["d1"],
            ..R::default()
        },
    ]);
    let v2 = s.yaml(&[
        keep(),
        R {
            id: "grow",
            shared_outbox: true,
            bindings: &["g1", "g2"],
            ..R::default()
        },
        R {
            id: "new",
            shared_outbox: false,
            bindings: &["n1"],
            ..R::default()
        },
    ]);
    let collector = ferry_tests::Collector::start(
        &s.b,
        &ids::unique("collector"),
        &format!("{}/out/#", s.run),
        QoS::AtLeastOnce,
    )
    .await?;
    let id = ids::unique("fleet");
    let agent = ManagedAgent::start(&cp.endpoint(), &dir.path().join("agent"), &id)?;
    apply(&cp, dir.path(), "v1.yaml", &v1).await?;
    running(&cp, &agent, &id, "e2e", 1).await?;

    // `gone` carries a first batch before it is removed.
    const D: u64 = 200;
    publish_seq(&s.a, &s.input("gone"), 0..D, QoS::AtLeastOnce).await?;
    collector.wait_for(&s.output("d1"), 0..D, DELIVERY).await?;

    // 5 000 messages on `keep` and `grow`, streaming across the change.
    const N: u64 = 2500;
    let keep_stream = tokio::spawn(stream(s.a.clone(), s.input("keep"), 0..N));
    let grow_stream = tokio::spawn(stream(s.a.clone(), s.input("grow"), 0..N));
    collector
        .wait_for(&s.output("g1"), 0..100, DELIVERY)
        .await?;
    let applied = Instant::now();
    apply(&cp, dir.path(), "v2.yaml", &v2).await?;
    running(&cp, &agent, &id, "e2e", 2).await?;
    let streaming = !keep_stream.is_finished() && !grow_stream.is_finished();
    eprintln!("ferryctl apply → version 2 ACKed: {:?}", applied.elapsed());
    keep_stream.await??;
    grow_stream.await??;
    let log = agent.process.stderr();
    assert!(
        streaming,
        "messages were still flowing when the change was ACKed\n{log}"
    );
    assert!(!log.contains("aborted"), "{log}");

    // After the change: `grow` fans out to g2 too, `new` runs, `gone` takes nothing.
    const M: u64 = 300;
    publish_seq(&s.a, &s.input("grow"), N..N + M, QoS::AtLeastOnce).await?;
    publish_seq(&s.a, &s.input("new"), 0..M, QoS::AtLeastOnce).await?;
    publish_seq(&s.a, &s.input("gone"), D..D + M, QoS::AtLeastOnce).await?;
    collector.wait_for(&s.output("k1"), 0..N, DELIVERY).await?;
    collector
        .wait_for(&s.output("g1"), 0..N + M, DELIVERY)
        .await?;
    collector
        .wait_for(&s.output("g2"), N..N + M, DELIVERY)
        .await?;
    collector.wait_for(&s.output("n1"), 0..M, DELIVERY).await?;
    // The added binding: no gap from the first message it carried on.
    let counts = collector.counts();
    let started = (0..N)
        .find(|seq| counts.count(&s.output("g2"), *seq) > 0)
        .unwrap_or(N);
    let gaps = counts.missing(&s.output("g2"), started..N + M);
    assert!(gaps.is_empty(), "g2 from {started}: missing {gaps:?}");
    eprintln!("g2 carried the stream from sequence {started} of {N}");

    let bindings = [
        ("keep", "k1"),
        ("grow", "g1"),
        ("grow", "g2"),
        ("gone", "d1"),
        ("new", "n1"),
    ];
    let m = wait::until_ok(DELIVERY, "the conservation law, nothing in flight", || {
        let outcome = agent.metrics().and_then(|m| {
            for (route, b) in bindings {
                let c = m.binding(route, b);
                anyhow::ensure!(c.in_flight == 0, "{route}/{b}: {c:?}");
                anyhow::ensure!(c.is_conserved(), "{route}/{b}: not conserved: {c:?}");
            }
            Ok(m)
        });
        std::future::ready(outcome)
    })
    .await?;
    let tail = agent.process.output_tail();
    let k1 = m.binding("keep", "k1");
    assert_eq!((k1.received, k1.sent), (N, N), "{k1:?}\n{tail}");
    // A delivery the old `grow` had not finished is delivered again (at least once).
    let g1 = m.binding("grow", "g1");
    assert_eq!(g1.received, g1.sent, "{g1:?}\n{tail}");
    assert!(g1.sent >= N + M, "{g1:?}");
    let g2 = m.binding("grow", "g2");
    assert_eq!(g2.received, g2.sent, "{g2:?}\n{tail}");
    assert!(g2.sent >= M, "{g2:?}");
    let d1 = m.binding("gone", "d1");
    assert_eq!((d1.received, d1.sent), (D, D), "removed: {d1:?}");
    assert_eq!(
        collector.counts().distinct(&s.output("d1")) as u64,
        D,
        "nothing reaches the removed route's destination"
    );
    let n1 = m.binding("new", "n1");
    assert_eq!((n1.received, n1.sent), (M, M), "{n1:?}\n{tail}");
    for b in bindings.iter().map(|(route, b)| m.binding(route, b)) {
        assert_eq!(b.dead_lettered + b.dropped, 0, "{b:?}");
    }

    // The unchanged route's sessions never reconnected, nor saw a redelivery.
    assert_eq!(reconnects(&m, "keep-in"), 0.0, "{tail}");
    assert_eq!(reconnects(&m, "keep-out"), 0.0, "{tail}");
    assert!(
        collector
            .counts()
            .duplicates()
            .iter()
            .all(|(topic, _, _)| !topic.ends_with("/k1")),
        "the unchanged route saw no redelivery"
    );

    // The control plane shows the new version ACKed.
    let listed = ferryctl(&cp, &["get", "agents"]).await?;
    assert!(listed.contains(&id) && listed.contains("e2e@2"), "{listed}");
    let info = agent_info(&cp, &id).await?;
    let status = info.configs.first().context("no config status")?;
    assert_eq!(
        (status.acked_version, status.nacked_version),
        (2, 0),
        "{status:?}"
    );
    Ok(())
}

/// The lease of route `r` of bridge `e2e` as `ferryctl -o json get leases` shows it: (holder,
/// version).
async fn route_lease(cp: &ControlPlane) -> anyhow::Result<(String, u64)> {
    let leases: Value =
        serde_json::from_str(&ferryctl(cp, &["-o", "json", "get", "leases"]).await?)?;
    let lease = leases
        .as_array()
        .and_then(|all| all.iter().find(|l| l["key"] == "e2e/r"))
        .with_context(|| format!("no lease e2e/r in {leases}"))?;
    let holder = lease["holder"].as_str().unwrap_or_default().to_owned();
    let version = lease["version"].as_u64().context("lease version")?;
    Ok((holder, version))
}

/// A managed agent `id` whose stores are under `dir` (`${STORE_DIR}` in the document) and
/// whose MQTT client ids carry `id` (`${AGENT}`), so two agents can run one document.
fn fleet_agent(cp: &ControlPlane, dir: &Path, id: &str) -> anyhow::Result<ManagedAgent> {
    let stores = dir.join(id).join("stores");
    std::fs::create_dir_all(&stores)?;
    ManagedAgent::start_with_env(
        &cp.endpoint(),
        &dir.join(id).join("data"),
        id,
        vec![
            ("STORE_DIR".to_owned(), stores.display().to_string()),
            ("AGENT".to_owned(), id.to_owned()),
        ],
    )
}

#[tokio::test]
async fn two_agents_one_bridge_only_the_lease_holder_drains_and_the_other_takes_over()
-> anyhow::Result<()> {
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let cp = ControlPlane::start(None).await?;
    let dir = tempfile::tempdir()?;
    // Each agent: its own SQLite outbox and DLQ (under `${STORE_DIR}`), its own client ids; the
    // lease in the control plane (its endpoint defaults to the agent's), TTL 3 s. The control
    // plane checks the document in its own environment, hence the defaults.
    let bridge = Bridge::new(
        &a.url(),
        &b.url(),
        Path::new("${STORE_DIR:-/nonexistent}"),
        &["x"],
    );
    let sqlite_lease = "  lease:\n    type: sqlite\n    options:\n      path: ${STORE_DIR:-/nonexistent}/lease.db\n";
    let mut yaml = bridge.yaml();
    anyhow::ensure!(yaml.contains(sqlite_lease), "{yaml}");
    yaml = yaml
        .replace(
            sqlite_lease,
            "  lease:\n    type: control_plane\n    options: {}\n",
        )
        .replace(
            &format!("client_id: {}-", bridge.run),
            &format!("client_id: {}-${{AGENT:-none}}-", bridge.run),
        );
    let ttl = Duration::from_secs(3);
    anyhow::ensure!(yaml.contains("lease_ttl: 3s"), "{yaml}");
    let collector = bridge.collector().await?;
    let (first, second) = (ids::unique("one"), ids::unique("two"));
    let mut agents = [
        fleet_agent(&cp, dir.path(), &first)?,
        fleet_agent(&cp, dir.path(), &second)?,
    ];
    apply(&cp, dir.path(), "v1.yaml", &yaml).await?;
    running(&cp, &agents[0], &first, "e2e", 1).await?;
    running(&cp, &agents[1], &second, "e2e", 1).await?;

    // Both agents take every message (each subscribes); only the holder's copies are sent.
    const N: u64 = 200;
    publish_seq(&a.url(), &bridge.input(), 0..N, QoS::AtLeastOnce).await?;
    collector
        .wait_for(&bridge.output("x"), 0..N, DELIVERY)
        .await?;
    let (holder_id, fence) = route_lease(&cp).await?;
    let held: Vec<f64> = agents
        .iter()
        .map(|agent| Ok(agent.metrics()?.route("ferry_lease_held", "r")))
        .collect::<anyhow::Result<_>>()?;
    let holder = held
        .iter()
        .position(|h| *h == 1.0)
        .with_context(|| format!("nobody holds the lease: {held:?}"))?;
    assert_eq!(
        held.iter().filter(|h| **h == 1.0).count(),
        1,
        "exactly one holder: {held:?}"
    );
    let ids = [&first, &second];
    let other = 1 - holder;
    assert!(
        holder_id.contains(ids[holder].as_str()),
        "ferryctl get leases shows {holder_id:?}, the agents' gauges {held:?}"
    );
    // What a user notices: every message reached the destination once, and the other agent's
    // copies wait in its outbox, none sent.
    wait::until_ok(DELIVERY, "the standby's copies in its outbox", || {
        let outcome = agents[other].metrics().and_then(|m| {
            let c = m.binding("r", "x");
            anyhow::ensure!(c.received == N && c.sent == 0, "{c:?}");
            anyhow::ensure!(c.is_conserved(), "{c:?}");
            let depth = m.get("ferry_outbox_depth", "r", "x");
            anyhow::ensure!(depth == N as f64, "depth {depth}");
            Ok(())
        });
        std::future::ready(outcome)
    })
    .await?;
    // The holder completes its last delivered records a few milliseconds after they went out.
    wait::until_ok(DELIVERY, "the holder's sends counted", || {
        let outcome = agents[holder].metrics().and_then(|m| {
            let c = m.binding("r", "x");
            anyhow::ensure!((c.received, c.sent, c.in_flight) == (N, N, 0), "{c:?}");
            Ok(())
        });
        std::future::ready(outcome)
    })
    .await?;
    assert!(collector.counts().duplicates().is_empty());

    // The holder dies; messages keep coming.
    agents[holder].process.sigkill()?;
    let killed = Instant::now();
    let more = tokio::spawn(stream(a.url(), bridge.input(), N..2 * N));
    let failover = wait::until_ok(DELIVERY, "the survivor's first send", || {
        let outcome = agents[other].metrics().and_then(|m| {
            let sent = m.binding("r", "x").sent;
            anyhow::ensure!(sent > 0, "nothing sent yet");
            Ok(killed.elapsed())
        });
        std::future::ready(outcome)
    })
    .await?;
    eprintln!("failover (SIGKILL of the holder → first send by the survivor): {failover:?}");
    assert!(
        failover <= ttl + Duration::from_secs(3),
        "{failover:?}\n{}",
        agents[other].process.output_tail()
    );
    more.await??;

    // The survivor holds the lease at a higher fencing version and delivers everything it
    // received: its backlog (a second copy of what the holder sent) and the new messages.
    collector
        .wait_for(&bridge.output("x"), 0..2 * N, DELIVERY)
        .await?;
    let (new_holder, new_fence) = route_lease(&cp).await?;
    assert!(
        new_holder.contains(ids[other].as_str()),
        "{new_holder:?} after {holder_id:?}"
    );
    assert!(new_fence > fence, "version {new_fence} after {fence}");
    let c = wait::until_ok(DELIVERY, "the survivor's law, nothing in flight", || {
        let outcome = agents[other].metrics().and_then(|m| {
            anyhow::ensure!(m.route("ferry_lease_held", "r") == 1.0, "lease not held");
            let c = m.binding("r", "x");
            anyhow::ensure!(c.in_flight == 0 && c.is_conserved(), "{c:?}");
            Ok(c)
        });
        std::future::ready(outcome)
    })
    .await?;
    assert_eq!(
        (c.received, c.sent, c.dead_lettered, c.dropped),
        (2 * N, 2 * N, 0, 0),
        "{c:?}"
    );
    assert!(
        collector
            .counts()
            .missing(&bridge.output("x"), 0..2 * N)
            .is_empty()
    );
    Ok(())
}
