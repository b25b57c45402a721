//! An agent whose lease and DLQ live in the control plane (`stores.lease.type:
//! control_plane`, `stores.dlq.type: control_plane`), against a real `ferry-control-plane`
//! process: `ferryctl get leases` shows the agent holding its partition lease; a poison
//! message (over `max_payload_bytes`) written while the control plane is down is held, not
//! settled, and lands in `ferryctl get dlq` once the control plane is back; the drainer,
//! which stopped when its lease could not be renewed before it expired, takes the lease again
//! at a higher version and nothing is lost.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use ferry_tests::agent::Agent;
use ferry_tests::mqtt::QoS;
use ferry_tests::process::{ChildProcess, ferryctl, project_bin};
use ferry_tests::{
    Mosquitto, PublishOptions, free_port, ports, publish_seq, publish_seq_with, wait,
};
use serde_json::Value;

use crate::agent_support::{Bridge, quiesced};

const DELIVERY: Duration = Duration::from_secs(30);

/// A control plane on a fixed port and data directory, so that a restart finds both.
fn spawn_control_plane(grpc: SocketAddr, dir: &Path) -> anyhow::Result<ChildProcess> {
    ChildProcess::spawn(
        project_bin("ferry-control-plane")?,
        [
            "--listen".to_owned(),
            grpc.to_string(),
            "--data-dir".to_owned(),
            dir.display().to_string(),
            "--heartbeat-interval-ms".to_owned(),
            "500".to_owned(),
        ],
        [("RUST_LOG", "info")],
    )
}

async fn start_control_plane(grpc: SocketAddr, dir: &Path) -> anyhow::Result<ChildProcess> {
    let process = spawn_control_plane(grpc, dir)?;
    let up = wait::until(
        DELIVERY,
        format!("the control plane on {grpc}"),
        || async move { ports::accepts_connections(grpc) },
    )
    .await;
    if let Err(error) = up {
        anyhow::bail!("{error:#}\n{}", process.output_tail());
    }
    Ok(process)
}

/// `ferryctl -o json ARGS` against `grpc`, parsed.
async fn ferryctl_json(grpc: SocketAddr, args: &[&str]) -> anyhow::Result<Value> {
    let args = [&["-o", "json"], args].concat();
    let out = ferryctl(&format!("http://{grpc}"), &args).await?;
    serde_json::from_str(&out).with_context(|| format!("ferryctl {args:?} output"))
}

/// The lease of route `r` of bridge `e2e` as `ferryctl get leases` shows it: (holder,
/// version).
async fn route_lease(grpc: SocketAddr) -> anyhow::Result<(String, u64)> {
    let leases = ferryctl_json(grpc, &["get", "leases"]).await?;
    let lease = leases
        .as_array()
        .and_then(|all| all.iter().find(|l| l["key"] == "e2e/r"))
        .with_context(|| format!("no lease e2e/r in {leases}"))?;
    let holder = lease["holder"].as_str().unwrap_or_default().to_owned();
    let version = lease["version"].as_u64().context("lease version")?;
    Ok((holder, version))
}

/// `bridge`'s document with its lease and DLQ kept by the control plane at `endpoint`.
fn with_control_plane_stores(bridge: &Bridge, endpoint: &str) -> anyhow::Result<String> {
    let dir = bridge.dir.display();
    let mut yaml = bridge.yaml();
    for store in ["lease", "dlq"] {
        let sqlite =
            format!("  {store}:\n    type: sqlite\n    options:\n      path: {dir}/{store}.db\n");
        anyhow::ensure!(yaml.contains(&sqlite), "no sqlite {store} in\n{yaml}");
        let remote = format!(
            "  {store}:\n    type: control_plane\n    options:\n      endpoint: {endpoint}\n"
        );
        yaml = yaml.replace(&sqlite, &remote);
    }
    Ok(yaml)
}

/// `ferry_store_errors_total` of the DLQ store, every kind.
fn dlq_store_errors(agent: &Agent) -> anyhow::Result<f64> {
    Ok(agent
        .metrics_text()?
        .lines()
        .filter(|l| l.starts_with("ferry_store_errors_total{") && l.contains("store=\"dlq\""))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum())
}

#[tokio::test]
async fn control_plane_stores_hold_a_dead_letter_until_the_control_plane_has_it()
-> anyhow::Result<()> {
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let cp_dir = tempfile::tempdir()?;
    let grpc = ports::loopback(free_port()?);
    let mut cp = start_control_plane(grpc, cp_dir.path()).await?;

    let mut bridge = Bridge::new(&a.url(), &b.url(), dir.path(), &["x"]);
    bridge.policy = vec!["max_payload_bytes: 1024".into()];
    let yaml = with_control_plane_stores(&bridge, &format!("http://{grpc}"))?;
    let collector = bridge.collector().await?;
    let mut agent = Agent::start(dir.path(), &yaml)?;
    agent.wait_ready(Duration::from_secs(20)).await?;
    publish_seq(&a.url(), &bridge.input(), 0..5, QoS::AtLeastOnce).await?;
    collector
        .wait_for(&bridge.output("x"), 0..5, DELIVERY)
        .await?;
    let (holder, first) = route_lease(grpc).await?;
    assert!(!holder.is_empty() && first >= 1, "{holder:?} at {first}");

    // The control plane goes away; the poison message arrives meanwhile.
    cp.sigkill()?;
    let big = PublishOptions {
        payload_size: 2000,
        ..Default::default()
    };
    publish_seq_with(&a.url(), &bridge.input(), 100..101, QoS::AtLeastOnce, big).await?;
    publish_seq(&a.url(), &bridge.input(), 5..10, QoS::AtLeastOnce).await?;
    wait::until_ok(DELIVERY, "a failed DLQ write", || {
        let r = dlq_store_errors(&agent).and_then(|n| {
            if n > 0.0 {
                Ok(())
            } else {
                anyhow::bail!("no DLQ store error yet")
            }
        });
        std::future::ready(r)
    })
    .await?;
    let held = agent.metrics()?.binding("r", "x");
    assert_eq!(
        held.dead_lettered, 0,
        "settled before the control plane had it: {held:?}"
    );
    // Its renewals fail: the drainer stops once the lease has expired on the agent's clock.
    wait::until_ok(DELIVERY, "the drainer to give the lease up", || {
        let r = agent.metrics().and_then(|m| {
            let held = m.route("ferry_lease_held", "r");
            anyhow::ensure!(held == 0.0, "lease still held");
            Ok(())
        });
        std::future::ready(r)
    })
    .await?;

    let mut cp = start_control_plane(grpc, cp_dir.path()).await?;
    collector
        .wait_for(&bridge.output("x"), 0..10, DELIVERY)
        .await?;
    let counts = quiesced(&agent, &bridge.bindings, DELIVERY).await?;
    let c = &counts[0];
    assert_eq!(
        (c.received, c.sent, c.dead_lettered, c.dropped),
        (11, 10, 1, 0),
        "{c:?}"
    );
    assert_eq!(collector.counts().count(&bridge.output("x"), 100), 0);

    let dlq = ferryctl_json(grpc, &["get", "dlq"]).await?;
    let entries = dlq.as_array().context("dlq list")?;
    assert_eq!(entries.len(), 1, "{dlq}");
    let entry = &entries[0];
    assert_eq!(
        (&entry["route_id"], &entry["binding_id"], &entry["reason"]),
        (
            &Value::from("r"),
            &Value::from("x"),
            &Value::from("oversized")
        ),
        "{entry}"
    );
    assert_eq!(entry["agent_id"], Value::from(holder.as_str()), "{entry}");

    // The drainer took the lease again after losing it, at a higher version.
    let (again, version) = route_lease(grpc).await?;
    assert_eq!(again, holder);
    assert!(version > first, "version {version} after {first}");

    let status = agent.terminate(Duration::from_secs(15)).await?;
    assert!(status.success(), "{status}\n{}", agent.tail());
    cp.terminate(Duration::from_secs(10)).await?;
    Ok(())
}
