//! A managed agent reports to the control plane and runs its commands, as
//! processes (control plane, `ferryctl`, agent, real Mosquitto):
//! - its metrics snapshots reach the control plane within two metrics
//!   intervals: `ferryctl metrics`, `ferryctl get agents`, `describe agent`
//!   and the control plane's `/metrics` show the agent's counters (sent per
//!   binding equal to what was published), per agent and as fleet totals;
//! - `ferryctl dlq redrive` of an entry in the control plane's DLQ is run by
//!   the agent running the entry's route: the envelope reaches the
//!   destination and the entry is gone; an entry the agent cannot redrive
//!   (a binding not on its route) fails with the agent's error and stays.

use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use ferry_shared::api::v1 as pb;
use ferry_tests::agent::{Metrics, http_get};
use ferry_tests::mqtt::{QoS, seq_payload};
use ferry_tests::{ChildProcess, Collector, Mosquitto, free_port, ids, project_bin, publish_seq};

use crate::agent_managed::{TIMEOUT, apply, document, ferryctl};
use crate::control_plane::ControlPlane;

/// The agents' metrics interval in these tests.
const INTERVAL: Duration = Duration::from_millis(300);
/// Messages published.
const N: u64 = 200;
/// The sequence number of the redriven message (outside `0..N`).
const REDRIVEN: u64 = 10_000;

/// A managed agent reporting every [`INTERVAL`], with its admin port.
fn agent(cp: &ControlPlane, data_dir: &Path, id: &str) -> anyhow::Result<(ChildProcess, u16)> {
    let port = free_port()?;
    let interval = INTERVAL.as_millis().to_string();
    let admin = format!("127.0.0.1:{port}");
    let endpoint = cp.endpoint();
    let data_dir = data_dir.display().to_string();
    let args = [
        "run",
        "--control-plane",
        &endpoint,
        "--data-dir",
        &data_dir,
        "--agent-id",
        id,
        "--label",
        "site=a",
        "--metrics-interval-ms",
        &interval,
        "--admin-listen",
        &admin,
    ];
    let process = ChildProcess::spawn(project_bin("ferry-agent")?, args, [("RUST_LOG", "info")])?;
    Ok((process, port))
}

/// The agent's latest snapshot at the control plane, if any.
async fn snapshot(cp: &ControlPlane, id: &str) -> anyhow::Result<pb::MetricsSnapshot> {
    let mut client = pb::metrics_service_client::MetricsServiceClient::new(cp.channel().await?);
    let response = client
        .get_agent_metrics(pb::GetAgentMetricsRequest {
            agent_id: id.to_owned(),
        })
        .await?;
    response
        .into_inner()
        .snapshot
        .ok_or_else(|| anyhow::anyhow!("no snapshot in the answer"))
}

/// The counters of `binding` on route `main` of bridge `edge` in `snapshot`.
fn counters(snapshot: &pb::MetricsSnapshot, binding: &str) -> Option<pb::DeliveryCounters> {
    snapshot
        .routes
        .iter()
        .filter(|r| r.bridge_id == "edge" && r.route_id == "main")
        .flat_map(|r| &r.bindings)
        .find(|b| b.binding_id == binding)
        .and_then(|b| b.counters)
}

/// Waits until the agent runs version 1 of `edge`, connected to its broker.
async fn bridging(cp: &ControlPlane, id: &str, port: u16) -> anyhow::Result<()> {
    ferry_tests::wait::until_ok(TIMEOUT, "edge@1 running and ready", || async {
        let listed = ferryctl(cp, &["get", "agents"]).await?;
        anyhow::ensure!(listed.contains(id) && listed.contains("edge@1"), "{listed}");
        let (status, _) = http_get(port, "/readyz")?;
        anyhow::ensure!(status == 200, "not ready");
        Ok(())
    })
    .await
}

/// The law holds exactly on the agent's own `/metrics` for `to-out`, with
/// `sent` messages sent and nothing in flight, dropped or dead-lettered.
async fn conserved(port: u16, sent: u64) -> anyhow::Result<()> {
    ferry_tests::wait::until_ok(TIMEOUT, "the conservation law", || async {
        let (_, body) = http_get(port, "/metrics")?;
        let counts = Metrics::parse(&body).binding("main", "to-out");
        anyhow::ensure!(counts.is_conserved(), "{counts:?}");
        anyhow::ensure!(counts.received == sent && counts.sent == sent, "{counts:?}");
        anyhow::ensure!(counts.in_flight == 0, "{counts:?}");
        anyhow::ensure!(counts.dead_lettered + counts.dropped == 0, "{counts:?}");
        Ok(())
    })
    .await
}

#[tokio::test]
async fn agent_metrics_reach_ferryctl_and_the_control_plane_metrics() -> anyhow::Result<()> {
    let broker = Mosquitto::start().await?;
    let cp = ControlPlane::start(None).await?;
    let dir = tempfile::tempdir()?;
    let id = ids::unique("fleet");
    let (mut process, port) = agent(&cp, &dir.path().join("agent"), &id)?;
    let out = Collector::start(&broker.url(), "collector", "out/#", QoS::AtLeastOnce).await?;
    let dlq = dir.path().join("dlq.db").display().to_string();
    apply(
        &cp,
        dir.path(),
        "edge.yaml",
        &document("edge", &broker.url(), &dlq),
    )
    .await?;
    bridging(&cp, &id, port).await?;

    publish_seq(&broker.url(), "in/x", 0..N, QoS::AtLeastOnce).await?;
    out.wait_for("out/edge", 0..N, TIMEOUT).await?;
    conserved(port, N).await?;
    // From the moment the agent counted every send: the control plane has
    // them within two metrics intervals.
    let counted = Instant::now();
    ferry_tests::wait::until_ok(
        2 * INTERVAL,
        "the snapshot at the control plane",
        || async {
            let snapshot = snapshot(&cp, &id).await?;
            let c = counters(&snapshot, "to-out").unwrap_or_default();
            anyhow::ensure!(c.received == N && c.sent == N, "{c:?}");
            Ok(())
        },
    )
    .await?;
    eprintln!("counted → at the control plane: {:?}", counted.elapsed());

    let snapshot = snapshot(&cp, &id).await?;
    assert_eq!(snapshot.agent_id, id);
    let route = snapshot
        .routes
        .iter()
        .find(|r| r.route_id == "main")
        .ok_or_else(|| anyhow::anyhow!("no route main in {snapshot:?}"))?;
    assert_eq!(route.delivery_mode, "direct_hold");
    let session = snapshot
        .sessions
        .iter()
        .find(|s| s.bridge_id == "edge" && s.session_id == "conn")
        .ok_or_else(|| anyhow::anyhow!("no session conn in {snapshot:?}"))?;
    assert!(session.connected, "{session:?}");
    assert_eq!(session.reconnects, 0, "{session:?}");

    // ferryctl: fleet totals, per agent, get agents and describe agent.
    let totals = ferryctl(&cp, &["metrics"]).await?;
    let row = totals
        .lines()
        .find(|l| l.starts_with("edge"))
        .unwrap_or_default();
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(
        cells.get(..5),
        Some(&["edge", "main", "to-out", "200", "200"][..]),
        "{totals}"
    );
    assert!(totals.contains("agents: 1 (1 connected)"), "{totals}");
    let by_agent = ferryctl(&cp, &["-o", "json", "metrics", "--by-agent"]).await?;
    let rows: serde_json::Value = serde_json::from_str(&by_agent)?;
    assert_eq!(rows[0]["agent_id"], id.as_str(), "{by_agent}");
    assert_eq!(rows[0]["binding_id"], "to-out", "{by_agent}");
    assert_eq!(rows[0]["sent"], N, "{by_agent}");
    let agents = ferryctl(&cp, &["-o", "json", "get", "agents"]).await?;
    let agents: serde_json::Value = serde_json::from_str(&agents)?;
    assert_eq!(agents[0]["metrics"]["sent"], N, "{agents}");
    assert_eq!(agents[0]["metrics"]["in_flight"], 0, "{agents}");
    let table = ferryctl(&cp, &["get", "agents"]).await?;
    assert!(table.contains("SENT"), "{table}");
    assert!(
        table.contains("fleet: 1 agents (1 connected), received 200, sent 200, dlq 0"),
        "{table}"
    );
    watch_refreshes(&cp, &id).await?;
    let described = ferryctl(&cp, &["describe", "agent", &id]).await?;
    assert!(described.contains("metrics at:"), "{described}");
    assert!(described.contains("to-out"), "{described}");

    // The control plane's /metrics: the agent's series and the fleet's.
    let (status, body) = http_get(cp.http.port(), "/metrics")?;
    assert_eq!(status, 200, "{body}");
    let agent_series = format!(
        r#"ferry_agent_sent_total{{agent="{id}",bridge="edge",route="main",binding="to-out"}} 200"#
    );
    assert!(body.contains(&agent_series), "{agent_series} in {body}");
    let session_series =
        format!(r#"ferry_agent_session_connected{{agent="{id}",bridge="edge",session="conn"}} 1"#);
    assert!(body.contains(&session_series), "{session_series} in {body}");
    let fleet = Metrics::parse(&body);
    assert_eq!(fleet.get("ferry_fleet_sent_total", "main", "to-out"), 200.0);
    assert_eq!(
        fleet.get("ferry_fleet_received_total", "main", "to-out"),
        200.0
    );

    assert_eq!(out.counts().missing("out/edge", 0..N), Vec::<u64>::new());
    conserved(port, N).await?;
    process.terminate(TIMEOUT).await?;
    Ok(())
}

/// `ferryctl get agents --watch` prints the table again every interval; off
/// a terminal it clears no screen.
async fn watch_refreshes(cp: &ControlPlane, id: &str) -> anyhow::Result<()> {
    use tokio::io::AsyncBufReadExt;
    let mut child = tokio::process::Command::new(project_bin("ferryctl")?)
        .arg("--endpoint")
        .arg(cp.endpoint())
        .args(["get", "agents", "--watch", "--interval", "1"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let (mut tables, mut rows) = (0, 0);
    let read = async {
        while tables < 2 {
            let line = lines
                .next_line()
                .await?
                .ok_or_else(|| anyhow::anyhow!("ferryctl ended"))?;
            anyhow::ensure!(!line.contains('\x1b'), "an escape off a terminal: {line:?}");
            tables += usize::from(line.starts_with("fleet: 1 agents"));
            rows += usize::from(line.starts_with(id));
        }
        anyhow::Ok(())
    };
    tokio::time::timeout(TIMEOUT, read).await??;
    assert_eq!(rows, 2, "one row per refresh");
    child.kill().await?;
    Ok(())
}

/// A dead letter of `edge`'s route `main` for `binding`, as an agent with a
/// `control_plane` DLQ store writes it.
fn dead_letter(id: &str, binding: &str) -> pb::DlqEntry {
    pb::DlqEntry {
        id: id.to_owned(),
        bridge_id: "edge".to_owned(),
        route_id: "main".to_owned(),
        binding_id: binding.to_owned(),
        address: "out/edge".to_owned(),
        envelope: Some(pb::Envelope {
            id: format!("m-{id}"),
            payload: seq_payload(REDRIVEN),
            source: Some(pb::Source {
                transport: "mqtt".to_owned(),
                session_id: "conn".to_owned(),
                address: "in/x".to_owned(),
                received_at: Some(SystemTime::now().into()),
            }),
            ..Default::default()
        }),
        reason: pb::DlqReason::PermanentError.into(),
        last_error: "refused by broker".to_owned(),
        attempts: 1,
        dead_lettered_at: Some(SystemTime::now().into()),
        agent_id: "elsewhere".to_owned(),
        ..Default::default()
    }
}

/// `ferryctl` with `args`: whether it succeeded, and its stdout and stderr.
async fn ferryctl_status(cp: &ControlPlane, args: &[&str]) -> anyhow::Result<(bool, String)> {
    let output = tokio::process::Command::new(project_bin("ferryctl")?)
        .arg("--endpoint")
        .arg(cp.endpoint())
        .args(args)
        .output()
        .await?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok((output.status.success(), text))
}

#[tokio::test]
async fn ferryctl_dlq_redrive_runs_on_the_agent_running_the_route() -> anyhow::Result<()> {
    let broker = Mosquitto::start().await?;
    let cp = ControlPlane::start(None).await?;
    let dir = tempfile::tempdir()?;
    let id = ids::unique("fleet");
    let (mut process, port) = agent(&cp, &dir.path().join("agent"), &id)?;
    let out = Collector::start(&broker.url(), "collector", "out/#", QoS::AtLeastOnce).await?;
    let dlq = dir.path().join("dlq.db").display().to_string();
    apply(
        &cp,
        dir.path(),
        "edge.yaml",
        &document("edge", &broker.url(), &dlq),
    )
    .await?;
    bridging(&cp, &id, port).await?;
    publish_seq(&broker.url(), "in/x", 0..N, QoS::AtLeastOnce).await?;
    out.wait_for("out/edge", 0..N, TIMEOUT).await?;

    let mut client = pb::dlq_service_client::DlqServiceClient::new(cp.channel().await?);
    for (entry, binding) in [("dl-good", "to-out"), ("dl-stray", "to-nowhere")] {
        client
            .write_dlq_entry(pb::WriteDlqEntryRequest {
                entry: Some(dead_letter(entry, binding)),
            })
            .await?;
    }
    let listed = ferryctl(&cp, &["get", "dlq", "--bridge", "edge"]).await?;
    assert!(
        listed.contains("dl-good") && listed.contains("dl-stray"),
        "{listed}"
    );

    // Redriven by the agent: delivered once, and the entry is gone.
    let (ok, text) = ferryctl_status(&cp, &["dlq", "redrive", "dl-good"]).await?;
    assert!(ok, "{text}");
    let counts = out
        .wait_for("out/edge", REDRIVEN..REDRIVEN + 1, TIMEOUT)
        .await?;
    assert_eq!(counts.count("out/edge", REDRIVEN), 1);
    let listed = ferryctl(&cp, &["get", "dlq", "--bridge", "edge"]).await?;
    assert!(!listed.contains("dl-good"), "{listed}");

    // A binding the route does not have: the agent's error, the entry kept.
    let (ok, text) = ferryctl_status(&cp, &["dlq", "redrive", "dl-stray"]).await?;
    assert!(!ok, "{text}");
    assert!(
        text.contains("binding to-nowhere is not on route main"),
        "{text}"
    );
    let listed = ferryctl(&cp, &["get", "dlq", "--bridge", "edge"]).await?;
    assert!(listed.contains("dl-stray"), "{listed}");

    // Every published message and the redriven one were sent exactly as
    // counted; nothing else reached the destination.
    conserved(port, N + 1).await?;
    let counts = out.counts();
    assert_eq!(counts.missing("out/edge", 0..N), Vec::<u64>::new());
    assert_eq!(counts.total(), N + 1, "{:?}", counts.duplicates());
    process.terminate(TIMEOUT).await?;
    Ok(())
}
