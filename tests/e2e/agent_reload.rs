//! Live configuration changes (ADR 0005): `ferry-agent run --config FILE` re-reads the file on
//! SIGHUP and applies it as a diff while messages flow. Two real Mosquitto brokers (A in,
//! B out), a collector on B counting by sequence number.
//!
//! The bridge has independent routes, each on sessions of its own:
//! - `keep` (shared_outbox, binding `k1`): unchanged by the reload;
//! - `grow` (shared_outbox, `g1`): changed, binding `g2` added;
//! - `gone` (direct_hold, `d1`): removed;
//! - `new` (direct_hold, `n1`): added.

use std::fmt::Write as _;
use std::time::Duration;

use ferry_tests::agent::{Agent, Metrics};
use ferry_tests::mqtt::QoS;
use ferry_tests::{Mosquitto, ids, publish_seq, wait};

const DELIVERY: Duration = Duration::from_secs(60);

/// A route of the test bridge: id, delivery mode, bindings, and where its egress session
/// connects when not to B.
#[derive(Default)]
pub(crate) struct R {
    pub(crate) id: &'static str,
    pub(crate) shared_outbox: bool,
    pub(crate) bindings: &'static [&'static str],
    pub(crate) egress: Option<String>,
}

pub(crate) struct Setup {
    pub(crate) run: String,
    pub(crate) a: String,
    pub(crate) b: String,
    pub(crate) dir: std::path::PathBuf,
}

impl Setup {
    pub(crate) fn input(&self, route: &str) -> String {
        format!("{}/{route}/in", self.run)
    }

    pub(crate) fn output(&self, binding: &str) -> String {
        format!("{}/out/{binding}", self.run)
    }

    /// The configuration with `routes`, each on an ingress session `{id}-in` (A) and an egress
    /// session `{id}-out` (B) of its own.
    pub(crate) fn yaml(&self, routes: &[R]) -> String {
        let dir = self.dir.display();
        let y = format!(
            "bridge:\n  id: e2e\n\
             stores:\n\
             \x20 outbox: {{ type: sqlite, options: {{ path: {dir}/outbox.db }} }}\n\
             \x20 lease: {{ type: sqlite, options: {{ path: {dir}/lease.db }} }}\n\
             \x20 dlq: {{ type: sqlite, options: {{ path: {dir}/dlq.db }} }}\n"
        );
        let (mut sessions, mut receivers, mut senders, mut bindings, mut out) = (
            String::from("sessions:\n"),
            String::from("receivers:\n"),
            String::from("senders:\n"),
            String::from("bindings:\n"),
            String::from("routes:\n"),
        );
        for r in routes {
            let egress = r.egress.as_ref().unwrap_or(&self.b);
            for (side, url) in [("in", &self.a), ("out", egress)] {
                let _ = writeln!(
                    sessions,
                    "  - {{ id: {id}-{side}, transport: mqtt, options: {{ session: {{ broker_url: \"{url}\", client_id: {run}-{id}-{side}, keep_alive: 5 }} }} }}",
                    id = r.id,
                    run = self.run,
                );
            }
            let _ = writeln!(
                receivers,
                "  - {{ id: {id}-rx, session_id: {id}-in, topics: [{{ topic: \"{input}\", qos: 1 }}] }}",
                id = r.id,
                input = self.input(r.id),
            );
            let _ = writeln!(
                senders,
                "  - {{ id: {id}-tx, session_id: {id}-out, options: {{ sender: {{ qos: 1 }} }} }}",
                id = r.id
            );
            for b in r.bindings {
                let _ = writeln!(
                    bindings,
                    "  - {{ id: {b}, sender_id: {id}-tx, address: \"{out}\" }}",
                    id = r.id,
                    out = self.output(b),
                );
            }
            let mode = if r.shared_outbox {
                "shared_outbox, dispatch_mode: fan_out"
            } else {
                "direct_hold"
            };
            let _ = write!(
                out,
                "  - {{ id: {id}, receiver_id: {id}-rx, delivery_mode: {mode}, bindings: [{b}]",
                id = r.id,
                b = r.bindings.join(", "),
            );
            if r.shared_outbox {
                let _ = write!(
                    out,
                    ", session: {{ session_id: {id}-out, sender_id: {id}-tx, drain_interval: 200ms, drain_batch_size: 100, lease_ttl: 3s, step_down_grace: 2s }}",
                    id = r.id
                );
            }
            out.push_str(" }\n");
        }
        y + &sessions + &receivers + &senders + &bindings + &out
    }
}

/// Publishes `seqs` to `topic` in chunks, paced so the stream spans the reload.
pub(crate) async fn stream(
    url: String,
    topic: String,
    seqs: std::ops::Range<u64>,
) -> anyhow::Result<()> {
    let mut pace = tokio::time::interval(Duration::from_millis(50));
    let mut next = seqs.start;
    while next < seqs.end {
        pace.tick().await;
        let end = (next + 20).min(seqs.end);
        publish_seq(&url, &topic, next..end, QoS::AtLeastOnce).await?;
        next = end;
    }
    Ok(())
}

pub(crate) fn reconnects(m: &Metrics, session: &str) -> f64 {
    m.session("ferry_session_reconnects_total", session)
}

/// Sends SIGHUP and waits until the agent logged `needle` once more than before.
async fn reload(agent: &mut Agent, needle: &str) -> anyhow::Result<()> {
    let before = agent.output().matches(needle).count();
    agent
        .process()
        .ok_or_else(|| anyhow::anyhow!("the agent is not running"))?
        .signal("HUP")?;
    wait::until(
        Duration::from_secs(30),
        format!("{needle:?} in the log"),
        || std::future::ready(agent.output().matches(needle).count() > before),
    )
    .await
}

/// Every binding: nothing in flight, the conservation law exactly.
pub(crate) async fn conserved(agent: &Agent, bindings: &[(&str, &str)]) -> anyhow::Result<Metrics> {
    wait::until_ok(
        DELIVERY,
        "the conservation law with nothing in flight",
        || {
            let outcome = agent.metrics().and_then(|m| {
                for (route, b) in bindings {
                    let c = m.binding(route, b);
                    anyhow::ensure!(c.in_flight == 0, "{route}/{b}: {c:?}");
                    anyhow::ensure!(c.is_conserved(), "{route}/{b}: not conserved: {c:?}");
                }
                Ok(m)
            });
            std::future::ready(outcome)
        },
    )
    .await
}

#[tokio::test]
async fn sighup_adds_changes_and_removes_routes_while_messages_flow() -> anyhow::Result<()> {
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let s = Setup {
        run: ids::unique("reload"),
        a: a.url(),
        b: b.url(),
        dir: dir.path().to_owned(),
    };
    let v1 = s.yaml(&[
        R {
            id: "keep",
            shared_outbox: true,
            bindings: &["k1"],
            ..R::default()
        },
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
        R {
            id: "keep",
            shared_outbox: true,
            bindings: &["k1"],
            ..R::default()
        },
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
    let mut agent = Agent::start(&s.dir, &v1)?;
    agent.wait_ready(Duration::from_secs(20)).await?;

    // `gone` carries a first batch before it is removed.
    const D: u64 = 200;
    publish_seq(&s.a, &s.input("gone"), 0..D, QoS::AtLeastOnce).await?;
    collector.wait_for(&s.output("d1"), 0..D, DELIVERY).await?;

    // `keep` and `grow` stream across the reload.
    const N: u64 = 2000;
    let keep_stream = tokio::spawn(stream(s.a.clone(), s.input("keep"), 0..N));
    let grow_stream = tokio::spawn(stream(s.a.clone(), s.input("grow"), 0..N));
    collector
        .wait_for(&s.output("g1"), 0..100, DELIVERY)
        .await?;
    std::fs::write(s.dir.join("bridge.yaml"), &v2)?;
    let sent_at = std::time::Instant::now();
    reload(&mut agent, "configuration applied").await?;
    let streaming = !keep_stream.is_finished() && !grow_stream.is_finished();
    eprintln!("SIGHUP to applied: {:?}", sent_at.elapsed());
    let during = agent.output();
    // The old drainer of `grow` released its lease (no abort) before the new one took it.
    assert!(!during.contains("aborted"), "{during}");
    let released = during
        .find("lease released partition=e2e/grow")
        .ok_or_else(|| anyhow::anyhow!("grow's lease was not released\n{during}"))?;
    let taken = "lease acquired partition=e2e/grow";
    wait::until(Duration::from_secs(10), "grow's lease taken again", || {
        std::future::ready(agent.output().matches(taken).count() >= 2)
    })
    .await?;
    let log = agent.output();
    let acquired = log.rfind(taken).unwrap_or_default();
    assert!(released < acquired, "released before taken again\n{log}");
    keep_stream.await??;
    grow_stream.await??;
    assert!(
        streaming,
        "messages were still flowing when the change was applied\n{during}"
    );

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

    let m = conserved(
        &agent,
        &[
            ("keep", "k1"),
            ("grow", "g1"),
            ("grow", "g2"),
            ("gone", "d1"),
            ("new", "n1"),
        ],
    )
    .await?;
    let tail = agent.tail();
    let k1 = m.binding("keep", "k1");
    assert_eq!((k1.received, k1.sent), (N, N), "{k1:?}\n{tail}");
    // A delivery the old `grow` had not finished is redelivered (at least once): counted twice.
    let g1 = m.binding("grow", "g1");
    assert_eq!(g1.received, g1.sent, "{g1:?}\n{tail}");
    assert!(g1.sent >= N + M, "{g1:?}");
    let g2 = m.binding("grow", "g2");
    assert_eq!(g2.received, g2.sent, "{g2:?}\n{tail}");
    assert!(g2.sent >= M, "{g2:?}");
    let d1 = m.binding("gone", "d1");
    assert_eq!(
        (d1.received, d1.sent),
        (D, D),
        "removed: takes nothing more\n{d1:?}"
    );
    assert_eq!(
        collector.counts().distinct(&s.output("d1")) as u64,
        D,
        "nothing reaches the removed route's destination"
    );
    let n1 = m.binding("new", "n1");
    assert_eq!((n1.received, n1.sent), (M, M), "{n1:?}\n{tail}");

    // The unchanged route's sessions never reconnected; the changed route's ingress session
    // was restarted (the counter sees restarts).
    assert_eq!(reconnects(&m, "keep-in"), 0.0, "{tail}");
    assert_eq!(reconnects(&m, "keep-out"), 0.0, "{tail}");
    assert!(
        reconnects(&m, "grow-in") >= 1.0,
        "grow-in restarted\n{tail}"
    );
    assert!(
        collector
            .counts()
            .duplicates()
            .iter()
            .all(|(topic, _, _)| !topic.ends_with("/k1")),
        "the unchanged route saw no redelivery"
    );

    let status = agent.terminate(Duration::from_secs(15)).await?;
    assert!(status.success(), "graceful shutdown exits 0: {status}");
    Ok(())
}

#[tokio::test]
async fn an_invalid_file_on_sighup_is_logged_and_changes_nothing() -> anyhow::Result<()> {
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let s = Setup {
        run: ids::unique("reload"),
        a: a.url(),
        b: b.url(),
        dir: dir.path().to_owned(),
    };
    let v1 = s.yaml(&[R {
        id: "keep",
        shared_outbox: true,
        bindings: &["k1"],
        ..R::default()
    }]);
    let collector = ferry_tests::Collector::start(
        &s.b,
        &ids::unique("collector"),
        &format!("{}/out/#", s.run),
        QoS::AtLeastOnce,
    )
    .await?;
    let mut agent = Agent::start(&s.dir, &v1)?;
    agent.wait_ready(Duration::from_secs(20)).await?;
    publish_seq(&s.a, &s.input("keep"), 0..100, QoS::AtLeastOnce).await?;
    collector
        .wait_for(&s.output("k1"), 0..100, DELIVERY)
        .await?;

    // A route naming a binding that does not exist: the validator refuses the file.
    let invalid = v1.replace("bindings: [k1]", "bindings: [k1, nowhere]");
    std::fs::write(s.dir.join("bridge.yaml"), invalid)?;
    reload(&mut agent, "configuration ignored").await?;
    assert!(
        agent.output().contains("nowhere"),
        "the error names the problem\n{}",
        agent.tail()
    );

    publish_seq(&s.a, &s.input("keep"), 100..300, QoS::AtLeastOnce).await?;
    collector
        .wait_for(&s.output("k1"), 0..300, DELIVERY)
        .await?;
    let m = conserved(&agent, &[("keep", "k1")]).await?;
    let k1 = m.binding("keep", "k1");
    assert_eq!((k1.received, k1.sent), (300, 300), "{k1:?}");
    assert_eq!(reconnects(&m, "keep-in"), 0.0, "{}", agent.tail());
    assert_eq!(reconnects(&m, "keep-out"), 0.0, "{}", agent.tail());
    assert!(!agent.output().contains("configuration applied"));

    let status = agent.terminate(Duration::from_secs(15)).await?;
    assert!(status.success(), "graceful shutdown exits 0: {status}");
    Ok(())
}

/// A removed `shared_outbox` route leaves its records in the outbox, shown by
/// `ferry_outbox_depth`; when the route comes back they drain, counted once.
#[tokio::test]
async fn a_removed_routes_records_stay_visible_and_drain_when_it_comes_back() -> anyhow::Result<()>
{
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let s = Setup {
        run: ids::unique("reload"),
        a: a.url(),
        b: b.url(),
        dir: dir.path().to_owned(),
    };
    let keep = || R {
        id: "keep",
        shared_outbox: true,
        bindings: &["k1"],
        ..R::default()
    };
    // `park` sends to a port nothing listens on: its records wait in the outbox.
    let nowhere = format!("tcp://127.0.0.1:{}", ferry_tests::free_port()?);
    let v1 = s.yaml(&[
        keep(),
        R {
            id: "park",
            shared_outbox: true,
            bindings: &["p1"],
            egress: Some(nowhere),
        },
    ]);
    let v2 = s.yaml(&[keep()]);
    let v3 = s.yaml(&[
        keep(),
        R {
            id: "park",
            shared_outbox: true,
            bindings: &["p1"],
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
    // Not ready (park-out never connects): wait for the admin listener instead.
    let mut agent = Agent::start(&s.dir, &v1)?;
    wait::until_ok(Duration::from_secs(20), "/metrics", || {
        std::future::ready(agent.metrics().map(drop))
    })
    .await?;

    const K: u64 = 150;
    publish_seq(&s.a, &s.input("park"), 0..K, QoS::AtLeastOnce).await?;
    let depth = |agent: &Agent| -> anyhow::Result<f64> {
        Ok(agent.metrics()?.get("ferry_outbox_depth", "park", "p1"))
    };
    wait::until(DELIVERY, "park's records in the outbox", || {
        std::future::ready(depth(&agent).is_ok_and(|d| d == K as f64))
    })
    .await?;

    std::fs::write(s.dir.join("bridge.yaml"), &v2)?;
    reload(&mut agent, "configuration applied").await?;
    let m = agent.metrics()?;
    assert_eq!(
        m.get("ferry_outbox_depth", "park", "p1"),
        K as f64,
        "the removed route's records are shown\n{}",
        agent.tail()
    );
    let p1 = m.binding("park", "p1");
    assert_eq!(
        (p1.received, p1.sent, p1.in_flight),
        (K, 0, K as i64),
        "{p1:?}"
    );
    assert!(p1.is_conserved(), "{p1:?}");
    assert_eq!(collector.counts().distinct(&s.output("p1")), 0);

    std::fs::write(s.dir.join("bridge.yaml"), &v3)?;
    reload(&mut agent, "configuration applied").await?;
    collector.wait_for(&s.output("p1"), 0..K, DELIVERY).await?;
    let m = conserved(&agent, &[("park", "p1"), ("keep", "k1")]).await?;
    let p1 = m.binding("park", "p1");
    assert_eq!((p1.received, p1.sent), (K, K), "counted once\n{p1:?}");
    wait::until(DELIVERY, "park's outbox depth back to 0", || {
        std::future::ready(depth(&agent).is_ok_and(|d| d == 0.0))
    })
    .await?;
    assert_eq!(reconnects(&m, "keep-in"), 0.0, "{}", agent.tail());
    assert_eq!(reconnects(&m, "keep-out"), 0.0, "{}", agent.tail());

    let status = agent.terminate(Duration::from_secs(15)).await?;
    assert!(status.success(), "graceful shutdown exits 0: {status}");
    Ok(())
}

/// A binding removed from a route that stays: the records already written for it were
/// acknowledged to their source, so they are still delivered (to the address they were written
/// with) and counted under that binding; the binding takes nothing new.
#[tokio::test]
async fn a_removed_bindings_records_are_still_delivered() -> anyhow::Result<()> {
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let s = Setup {
        run: ids::unique("reload"),
        a: a.url(),
        b: b.url(),
        dir: dir.path().to_owned(),
    };
    // The records wait in the outbox until the egress session points at B.
    let nowhere = format!("tcp://127.0.0.1:{}", ferry_tests::free_port()?);
    let v1 = s.yaml(&[R {
        id: "park",
        shared_outbox: true,
        bindings: &["p1", "p2"],
        egress: Some(nowhere),
    }]);
    let v2 = s.yaml(&[R {
        id: "park",
        shared_outbox: true,
        bindings: &["p1"],
        ..R::default()
    }]);
    let collector = ferry_tests::Collector::start(
        &s.b,
        &ids::unique("collector"),
        &format!("{}/out/#", s.run),
        QoS::AtLeastOnce,
    )
    .await?;
    let mut agent = Agent::start(&s.dir, &v1)?;
    wait::until_ok(Duration::from_secs(20), "/metrics", || {
        std::future::ready(agent.metrics().map(drop))
    })
    .await?;
    const K: u64 = 100;
    publish_seq(&s.a, &s.input("park"), 0..K, QoS::AtLeastOnce).await?;
    wait::until(DELIVERY, "both bindings' records in the outbox", || {
        std::future::ready(agent.metrics().is_ok_and(|m| {
            m.binding("park", "p1").received == K && m.binding("park", "p2").received == K
        }))
    })
    .await?;

    std::fs::write(s.dir.join("bridge.yaml"), &v2)?;
    reload(&mut agent, "configuration applied").await?;
    collector.wait_for(&s.output("p1"), 0..K, DELIVERY).await?;
    collector.wait_for(&s.output("p2"), 0..K, DELIVERY).await?;
    publish_seq(&s.a, &s.input("park"), K..2 * K, QoS::AtLeastOnce).await?;
    collector
        .wait_for(&s.output("p1"), 0..2 * K, DELIVERY)
        .await?;
    let m = conserved(&agent, &[("park", "p1"), ("park", "p2")]).await?;
    let (p1, p2) = (m.binding("park", "p1"), m.binding("park", "p2"));
    assert_eq!((p1.received, p1.sent), (2 * K, 2 * K), "{p1:?}");
    assert_eq!((p2.received, p2.sent), (K, K), "nothing new for p2\n{p2:?}");
    assert_eq!(
        collector.counts().distinct(&s.output("p2")) as u64,
        K,
        "{}",
        agent.tail()
    );

    let status = agent.terminate(Duration::from_secs(15)).await?;
    assert!(status.success(), "graceful shutdown exits 0: {status}");
    Ok(())
}

/// A valid file the agent cannot start (a CA file that does not exist, read only when the
/// session starts): the change is undone — the routes it had stopped start again with the
/// previous version — and the error is logged.
#[tokio::test]
async fn a_change_that_cannot_start_leaves_the_previous_version_running() -> anyhow::Result<()> {
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let s = Setup {
        run: ids::unique("reload"),
        a: a.url(),
        b: b.url(),
        dir: dir.path().to_owned(),
    };
    let v1 = s.yaml(&[
        R {
            id: "keep",
            shared_outbox: true,
            bindings: &["k1"],
            ..R::default()
        },
        R {
            id: "grow",
            shared_outbox: true,
            bindings: &["g1"],
            ..R::default()
        },
    ]);
    let grow_in = format!("broker_url: \"{}\", client_id: {}-grow-in", s.a, s.run);
    anyhow::ensure!(v1.contains(&grow_in), "{v1}");
    let broken = v1.replace(
        &grow_in,
        &format!(
            "broker_url: \"mqtts://127.0.0.1:8883\", ca_file: {}/missing-ca.pem, client_id: {}-grow-in",
            s.dir.display(),
            s.run
        ),
    );
    let collector = ferry_tests::Collector::start(
        &s.b,
        &ids::unique("collector"),
        &format!("{}/out/#", s.run),
        QoS::AtLeastOnce,
    )
    .await?;
    let mut agent = Agent::start(&s.dir, &v1)?;
    agent.wait_ready(Duration::from_secs(20)).await?;
    publish_seq(&s.a, &s.input("grow"), 0..100, QoS::AtLeastOnce).await?;
    collector
        .wait_for(&s.output("g1"), 0..100, DELIVERY)
        .await?;

    std::fs::write(s.dir.join("bridge.yaml"), broken)?;
    reload(&mut agent, "cannot apply the configuration").await?;
    assert!(
        agent.output().contains("missing-ca.pem"),
        "the error names the file\n{}",
        agent.tail()
    );
    agent.wait_ready(Duration::from_secs(20)).await?;

    publish_seq(&s.a, &s.input("grow"), 100..300, QoS::AtLeastOnce).await?;
    publish_seq(&s.a, &s.input("keep"), 0..200, QoS::AtLeastOnce).await?;
    collector
        .wait_for(&s.output("g1"), 0..300, DELIVERY)
        .await?;
    collector
        .wait_for(&s.output("k1"), 0..200, DELIVERY)
        .await?;
    let m = conserved(&agent, &[("keep", "k1"), ("grow", "g1")]).await?;
    let (k1, g1) = (m.binding("keep", "k1"), m.binding("grow", "g1"));
    assert_eq!((k1.received, k1.sent), (200, 200), "{k1:?}");
    assert_eq!(g1.received, g1.sent, "{g1:?}");
    assert!(g1.sent >= 300, "{g1:?}");
    assert_eq!(reconnects(&m, "keep-in"), 0.0, "{}", agent.tail());
    assert_eq!(reconnects(&m, "keep-out"), 0.0, "{}", agent.tail());

    let status = agent.terminate(Duration::from_secs(15)).await?;
    assert!(status.success(), "graceful shutdown exits 0: {status}");
    Ok(())
}
