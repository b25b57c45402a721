//! Issue 13's last acceptance test, with processes (a control plane, a managed agent, two real
//! Mosquitto brokers, `ferryctl`): a poison message goes through the control plane's DLQ and
//! back.
//!
//! A bridge applied with `ferryctl apply` keeps its dead letters and its lease in the control
//! plane (`stores.dlq.type: control_plane`, `stores.lease.type: control_plane`). Its one
//! `shared_outbox` route fans out to a good binding and a poison one whose topic is too long
//! for broker B's `max_packet_size 1000`. The poison binding's records end in the control
//! plane's DLQ with reason `oversized` (`ferryctl get dlq` lists them); once B accepts larger
//! packets, `ferryctl dlq redrive --binding poison` is run by the agent: every poison message
//! reaches B once and the DLQ is empty. The conservation law holds exactly per binding: a
//! redrive is a new record of the binding, counted as received again, then sent.

use std::path::Path;
use std::time::Duration;

use ferry_tests::agent::BindingCounts;
use ferry_tests::mqtt::QoS;
use ferry_tests::{Mosquitto, ids, publish_seq, wait};
use serde_json::Value;

use crate::agent_managed::{ManagedAgent, apply, ferryctl, running};
use crate::agent_support::Bridge;
use crate::control_plane::ControlPlane;

const DELIVERY: Duration = Duration::from_secs(30);
/// Messages published.
const N: u64 = 20;

/// The bridge's dead letters of `binding` as `ferryctl -o json get dlq` shows them.
async fn dead_letters(cp: &ControlPlane, binding: &str) -> anyhow::Result<Vec<Value>> {
    let args = [
        "-o",
        "json",
        "get",
        "dlq",
        "--bridge",
        "e2e",
        "--binding",
        binding,
    ];
    let listed: Value = serde_json::from_str(&ferryctl(cp, &args).await?)?;
    listed
        .as_array()
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("not a list: {listed}"))
}

/// Waits until nothing is in flight on route `r` and the law holds for every binding; returns
/// the counters of `bindings`.
async fn quiesced(agent: &ManagedAgent, bindings: &[&str]) -> anyhow::Result<Vec<BindingCounts>> {
    wait::until_ok(
        DELIVERY,
        "the conservation law with nothing in flight",
        || {
            let outcome = agent.metrics().and_then(|m| {
                let counts: Vec<BindingCounts> =
                    bindings.iter().map(|b| m.binding("r", b)).collect();
                for (b, c) in bindings.iter().zip(&counts) {
                    anyhow::ensure!(c.in_flight == 0 && c.is_conserved(), "{b}: {c:?}");
                }
                Ok(counts)
            });
            std::future::ready(outcome)
        },
    )
    .await
}

#[tokio::test]
async fn poison_message_in_the_control_plane_dlq_is_redriven_by_ferryctl_after_the_fix()
-> anyhow::Result<()> {
    let a = Mosquitto::start().await?;
    let mut b = Mosquitto::builder()
        .config_line("max_packet_size 1000")
        .start()
        .await?;
    let cp = ControlPlane::start(None).await?;
    let dir = tempfile::tempdir()?;
    // The outbox stays in SQLite under `${STORE_DIR}` (the control plane checks the document in
    // its own environment, hence the default); the lease and the DLQ are the control plane's.
    let store_dir = Path::new("${STORE_DIR:-/nonexistent}");
    let mut bridge = Bridge::new(&a.url(), &b.url(), store_dir, &["good", "poison"]);
    bridge
        .address_suffix
        .insert("poison".into(), format!("/{}", "p".repeat(1200)));
    let sqlite = |store: &str| {
        format!(
            "  {store}:\n    type: sqlite\n    options:\n      path: {}/{store}.db\n",
            store_dir.display()
        )
    };
    let mut yaml = bridge.yaml();
    for store in ["lease", "dlq"] {
        anyhow::ensure!(yaml.contains(&sqlite(store)), "{yaml}");
        yaml = yaml.replace(
            &sqlite(store),
            &format!("  {store}:\n    type: control_plane\n    options: {{}}\n"),
        );
    }
    let collector = bridge.collector().await?;
    let id = ids::unique("poison");
    let stores = dir.path().join("stores");
    std::fs::create_dir_all(&stores)?;
    let agent = ManagedAgent::start_with_env(
        &cp.endpoint(),
        &dir.path().join("data"),
        &id,
        vec![("STORE_DIR".to_owned(), stores.display().to_string())],
    )?;
    apply(&cp, dir.path(), "poison.yaml", &yaml).await?;
    running(&cp, &agent, &id, "e2e", 1).await?;

    publish_seq(&a.url(), &bridge.input(), 0..N, QoS::AtLeastOnce).await?;
    collector
        .wait_for(&bridge.output("good"), 0..N, DELIVERY)
        .await?;
    // Every poison record is in the control plane's DLQ, as `ferryctl get dlq` shows it.
    let entries = wait::until_ok(DELIVERY, "the poison binding's dead letters", || async {
        let entries = dead_letters(&cp, "poison").await?;
        anyhow::ensure!(entries.len() as u64 == N, "{} so far", entries.len());
        Ok(entries)
    })
    .await?;
    for entry in &entries {
        assert_eq!(entry["reason"], "oversized", "{entry}");
        assert_eq!(entry["route_id"], "r", "{entry}");
        assert_eq!(entry["agent_id"], id.as_str(), "{entry}");
        let error = entry["last_error"].as_str().unwrap_or_default();
        assert!(error.contains("maximum packet size"), "{entry}");
    }
    assert!(dead_letters(&cp, "good").await?.is_empty());
    let table = ferryctl(&cp, &["get", "dlq", "--bridge", "e2e"]).await?;
    assert_eq!(
        table.lines().filter(|l| l.contains("oversized")).count() as u64,
        N,
        "{table}"
    );
    assert_eq!(collector.counts().distinct(&bridge.output("poison")), 0);
    let counts = quiesced(&agent, &["good", "poison"]).await?;
    assert_eq!(
        (counts[0].received, counts[0].sent, counts[0].dead_lettered),
        (N, N, 0),
        "{counts:?}"
    );
    assert_eq!(
        (counts[1].received, counts[1].sent, counts[1].dead_lettered),
        (N, 0, N),
        "{counts:?}"
    );

    // The fault is fixed: B accepts larger packets. The agent running the route redrives every
    // entry of the binding; each is deleted once its new outbox record is durable.
    let conf = b.dir().join("mosquitto.conf");
    let fixed = std::fs::read_to_string(&conf)?.replace("max_packet_size 1000\n", "");
    std::fs::write(&conf, fixed)?;
    b.restart().await?;
    let args = [
        "-o",
        "json",
        "dlq",
        "redrive",
        "--bridge",
        "e2e",
        "--binding",
        "poison",
    ];
    let redriven: Value = serde_json::from_str(&ferryctl(&cp, &args).await?)?;
    let outcomes = redriven.as_array().cloned().unwrap_or_default();
    assert_eq!(outcomes.len() as u64, N, "{redriven}");
    assert!(outcomes.iter().all(|o| o["ok"] == true), "{redriven}");

    let counts = collector
        .wait_for(&bridge.output("poison"), 0..N, DELIVERY)
        .await?;
    for seq in 0..N {
        assert_eq!(counts.count(&bridge.output("poison"), seq), 1, "seq {seq}");
    }
    assert!(dead_letters(&cp, "poison").await?.is_empty());
    let table = ferryctl(&cp, &["get", "dlq", "--bridge", "e2e"]).await?;
    assert!(!table.contains("oversized"), "{table}");

    // The law per binding: the good one untouched; the poison one received each message twice
    // (published, then redriven), dead-lettered the first and sent the second.
    let counts = quiesced(&agent, &["good", "poison"]).await?;
    assert_eq!(
        (counts[0].received, counts[0].sent, counts[0].dead_lettered),
        (N, N, 0),
        "{counts:?}"
    );
    assert_eq!(
        (counts[1].received, counts[1].sent, counts[1].dead_lettered),
        (2 * N, N, N),
        "{counts:?}"
    );
    assert_eq!(
        counts[1].dropped + counts[1].expired + counts[1].filtered,
        0
    );
    assert!(collector.counts().duplicates().is_empty());
    Ok(())
}
