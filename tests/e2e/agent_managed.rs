//! Managed agents (`ferry-agent run --control-plane URL`) as processes with a
//! control plane, `ferryctl` and a real Mosquitto: an applied configuration
//! bridges within 2 s and shows in `ferryctl get agents` / `describe agent`;
//! a second bridge runs beside it and a deleted one is withdrawn;
//! a version the agent cannot run is NACKed and the last good one keeps
//! running (untouched, or started again when the new one failed to start); the control plane SIGKILLed mid-run stops no message and the
//! agent reports again within two heartbeat intervals of its return; an
//! agent started while the control plane is down runs from its cache.

use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use ferry_shared::api::v1 as pb;
use ferry_tests::agent::{Metrics, http_get};
use ferry_tests::mqtt::QoS;
use ferry_tests::{ChildProcess, Collector, Mosquitto, free_port, ids, project_bin, publish_seq};

use crate::control_plane::ControlPlane;

pub(crate) const TIMEOUT: Duration = Duration::from_secs(15);
/// The control plane's heartbeat interval in these tests (`ControlPlane::start`).
const HEARTBEAT: Duration = Duration::from_millis(500);
/// Messages per batch.
const N: u64 = 200;

/// A `ferry-agent run --control-plane` process.
pub(crate) struct ManagedAgent {
    pub(crate) process: ChildProcess,
    port: u16,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl ManagedAgent {
    pub(crate) fn start(endpoint: &str, data_dir: &Path, id: &str) -> anyhow::Result<Self> {
        Self::start_with_env(endpoint, data_dir, id, Vec::new())
    }

    /// Like [`Self::start`], with `env` added to the process's environment.
    pub(crate) fn start_with_env(
        endpoint: &str,
        data_dir: &Path,
        id: &str,
        env: Vec<(String, String)>,
    ) -> anyhow::Result<Self> {
        let port = free_port()?;
        let args = vec![
            "run".to_owned(),
            "--control-plane".to_owned(),
            endpoint.to_owned(),
            "--data-dir".to_owned(),
            data_dir.display().to_string(),
            "--agent-id".to_owned(),
            id.to_owned(),
            "--label".to_owned(),
            "site=a".to_owned(),
            "--admin-listen".to_owned(),
            format!("127.0.0.1:{port}"),
        ];
        let process = Self::spawn(&args, &env)?;
        Ok(Self {
            process,
            port,
            args,
            env,
        })
    }

    fn spawn(args: &[String], env: &[(String, String)]) -> anyhow::Result<ChildProcess> {
        let log = ("RUST_LOG".to_owned(), "info,ferry_agent=debug".to_owned());
        ChildProcess::spawn(
            project_bin("ferry-agent")?,
            args,
            std::iter::once(log).chain(env.iter().cloned()),
        )
    }

    async fn restart(&mut self) -> anyhow::Result<()> {
        self.process.terminate(TIMEOUT).await?;
        self.process = Self::spawn(&self.args, &self.env)?;
        Ok(())
    }

    pub(crate) fn is_ready(&self) -> bool {
        http_get(self.port, "/readyz").is_ok_and(|(status, _)| status == 200)
    }

    pub(crate) fn metrics(&self) -> anyhow::Result<Metrics> {
        let (_, body) = http_get(self.port, "/metrics")?;
        Ok(Metrics::parse(&body))
    }
}

/// A one-route bridge from `in/#` to `out/<bridge>` on `broker`, its DLQ in
/// SQLite at `dlq`.
pub(crate) fn document(bridge: &str, broker: &str, dlq: &str) -> String {
    crate::ferryctl::document(bridge, 10)
        .replace("tcp://127.0.0.1:1883", broker)
        .replace(&format!("/tmp/{bridge}-dlq.db"), dlq)
        .replace("address: out/topic", &format!("address: out/{bridge}"))
}

pub(crate) async fn ferryctl(cp: &ControlPlane, args: &[&str]) -> anyhow::Result<String> {
    ferry_tests::process::ferryctl(&cp.endpoint(), args).await
}

pub(crate) async fn apply(
    cp: &ControlPlane,
    dir: &Path,
    name: &str,
    yaml: &str,
) -> anyhow::Result<()> {
    let path = dir.join(name);
    std::fs::write(&path, yaml)?;
    let path = path.display().to_string();
    ferryctl(cp, &["apply", "-f", &path, "--selector", "site=a"]).await?;
    Ok(())
}

/// The agent as the control plane's `GetAgent` shows it.
pub(crate) async fn agent_info(cp: &ControlPlane, id: &str) -> anyhow::Result<pb::AgentInfo> {
    let mut client = pb::agent_service_client::AgentServiceClient::new(cp.channel().await?);
    let response = client
        .get_agent(pb::GetAgentRequest {
            agent_id: id.to_owned(),
        })
        .await?;
    response
        .into_inner()
        .agent
        .context("no agent in the answer")
}

/// Waits until the agent ACKed `version` of its one bridge and is ready
/// (every session of the bridge connected).
pub(crate) async fn running(
    cp: &ControlPlane,
    agent: &ManagedAgent,
    id: &str,
    bridge: &str,
    version: u64,
) -> anyhow::Result<()> {
    let what = format!("{bridge} version {version} running");
    ferry_tests::wait::until_ok(TIMEOUT, what, || async {
        let info = agent_info(cp, id).await?;
        anyhow::ensure!(
            info.configs
                .iter()
                .any(|c| c.bridge_id == bridge && c.acked_version == version),
            "{info:?}"
        );
        anyhow::ensure!(agent.is_ready(), "not ready");
        Ok(())
    })
    .await
}

/// Publishes `seqs` on `in/x` and waits until the collector holds `total`.
async fn flows(
    broker: &Mosquitto,
    out: &Collector,
    seqs: std::ops::Range<u64>,
    total: u64,
) -> anyhow::Result<()> {
    publish_seq(&broker.url(), "in/x", seqs, QoS::AtLeastOnce).await?;
    out.wait_for_total(total, TIMEOUT).await?;
    Ok(())
}

/// Every message counted on the route's binding is settled: the law holds
/// exactly and nothing is in flight, dropped or dead-lettered.
async fn conserved(agent: &ManagedAgent, route: &str, delivered: u64) -> anyhow::Result<()> {
    ferry_tests::wait::until_ok(TIMEOUT, "the conservation law", || async {
        let counts = agent.metrics()?.binding(route, "to-out");
        anyhow::ensure!(counts.is_conserved(), "{counts:?}");
        anyhow::ensure!(counts.in_flight == 0, "{counts:?}");
        anyhow::ensure!(counts.sent == delivered, "{counts:?} != {delivered} sent");
        anyhow::ensure!(counts.dead_lettered + counts.dropped == 0, "{counts:?}");
        Ok(())
    })
    .await
}

#[tokio::test]
async fn managed_agent_runs_applied_configs_and_nacks_what_it_cannot_run() -> anyhow::Result<()> {
    let broker = Mosquitto::start().await?;
    let cp = ControlPlane::start(None).await?;
    let dir = tempfile::tempdir()?;
    let id = ids::unique("managed");
    let agent = ManagedAgent::start(&cp.endpoint(), &dir.path().join("agent"), &id)?;
    let hello =
        ferry_tests::wait::until_ok(TIMEOUT, "the agent's hello", || agent_info(&cp, &id)).await?;
    let out = Collector::start(&broker.url(), "collector", "out/#", QoS::AtLeastOnce).await?;

    let dlq = dir.path().join("dlq.db").display().to_string();
    let v1 = document("edge", &broker.url(), &dlq);
    let applied = Instant::now();
    apply(&cp, dir.path(), "v1.yaml", &v1).await?;
    running(&cp, &agent, &id, "edge", 1).await?;
    let bridged = applied.elapsed();
    eprintln!("apply → bridge running: {bridged:?}");
    assert!(bridged <= Duration::from_secs(2), "{bridged:?}");
    flows(&broker, &out, 0..N, N).await?;

    let listed = ferryctl(&cp, &["get", "agents"]).await?;
    assert!(
        listed.contains(&id) && listed.contains("edge@1"),
        "{listed}"
    );
    let described = ferryctl(&cp, &["describe", "agent", &id]).await?;
    assert!(
        described.contains("edge") && described.contains("true"),
        "{described}"
    );

    // Valid for the control plane, impossible here: the DLQ under a file.
    let file = dir.path().join("a-file");
    std::fs::write(&file, "not a directory")?;
    let bad_dlq = file.join("dlq.db").display().to_string();
    apply(
        &cp,
        dir.path(),
        "v2.yaml",
        &document("edge", &broker.url(), &bad_dlq),
    )
    .await?;
    let nack = ferry_tests::wait::until_ok(TIMEOUT, "the NACK", || async {
        let info = agent_info(&cp, &id).await?;
        let status = info.configs.first().context("no config status")?;
        anyhow::ensure!(status.nacked_version == 2, "{status:?}");
        Ok(status.clone())
    })
    .await?;
    assert_eq!(nack.acked_version, 1, "{nack:?}");
    assert!(nack.nack_error.contains("a-file"), "{nack:?}");
    let described = ferryctl(&cp, &["describe", "agent", &id]).await?;
    assert!(described.contains("a-file"), "{described}");

    // The last good version still bridges.
    flows(&broker, &out, N..2 * N, 2 * N).await?;

    // One that fails only once the old version stopped (its DLQ's path is a
    // directory: its parent is created and locked, the store fails to open;
    // a change of stores restarts the whole bridge): NACKed, and the last
    // good version started again.
    let a_dir = dir.path().join("dlq-is-a-directory");
    std::fs::create_dir(&a_dir)?;
    apply(
        &cp,
        dir.path(),
        "v3.yaml",
        &document("edge", &broker.url(), &a_dir.display().to_string()),
    )
    .await?;
    let nack = ferry_tests::wait::until_ok(TIMEOUT, "the second NACK", || async {
        let info = agent_info(&cp, &id).await?;
        let status = info.configs.first().context("no config status")?;
        anyhow::ensure!(status.nacked_version == 3, "{status:?}");
        Ok(status.clone())
    })
    .await?;
    assert_eq!(nack.acked_version, 1, "{nack:?}");
    assert!(nack.nack_error.contains("starting the bridge"), "{nack:?}");
    running(&cp, &agent, &id, "edge", 1).await?;
    let log = agent.process.stderr();
    assert!(log.contains("the previous one starts again"), "{log}");
    flows(&broker, &out, 2 * N..3 * N, 3 * N).await?;

    // Every message delivered once, and accounted for.
    let counts = out.counts();
    assert!(counts.missing("out/edge", 0..3 * N).is_empty());
    assert!(counts.duplicates().is_empty());
    conserved(&agent, "main", 3 * N).await?;

    // A second bridge runs beside the first, independently; the first,
    // deleted, is withdrawn: stopped, and no longer cached.
    let side = document(
        "side",
        &broker.url(),
        &dir.path().join("side.db").display().to_string(),
    )
    .replace("  - id: main\n", "  - id: side\n");
    apply(&cp, dir.path(), "side.yaml", &side).await?;
    running(&cp, &agent, &id, "side", 1).await?;
    flows(&broker, &out, 3 * N..4 * N, 5 * N).await?;
    ferryctl(&cp, &["delete", "edge"]).await?;
    let cache = dir.path().join("agent/configs");
    ferry_tests::wait::until(TIMEOUT, "edge withdrawn", || {
        std::future::ready(!cache.join("edge.yaml").exists())
    })
    .await?;
    assert!(cache.join("side.yaml").exists());
    flows(&broker, &out, 4 * N..5 * N, 6 * N).await?;
    let counts = out.counts();
    assert_eq!(counts.distinct("out/edge") as u64, 4 * N);
    assert!(counts.missing("out/side", 3 * N..5 * N).is_empty());
    assert!(counts.duplicates().is_empty());
    conserved(&agent, "main", 4 * N).await?;
    conserved(&agent, "side", 2 * N).await?;

    // Heartbeats keep the one stream open past three intervals of silence.
    let until = Instant::now() + HEARTBEAT * 4;
    while Instant::now() < until {
        let info = agent_info(&cp, &id).await?;
        assert!(info.connected, "{info:?}");
        assert_eq!(
            info.connected_at, hello.connected_at,
            "reconnected: {info:?}"
        );
        tokio::time::sleep(HEARTBEAT / 5).await;
    }
    let log = agent.process.stderr();
    assert!(!log.contains("stream down"), "{log}");
    Ok(())
}

#[tokio::test]
async fn managed_agent_outlives_its_control_plane_and_starts_from_its_cache() -> anyhow::Result<()>
{
    let broker = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let state = format!("sqlite://{}", dir.path().join("state.db").display());
    let mut cp = ControlPlane::start(Some(&state)).await?;
    let cp_args = control_plane_args(&cp, &state, &dir.path().join("cp"))?;
    let id = ids::unique("managed");
    let mut agent = ManagedAgent::start(&cp.endpoint(), &dir.path().join("agent"), &id)?;
    let out = Collector::start(&broker.url(), "collector", "out/#", QoS::AtLeastOnce).await?;
    let dlq = dir.path().join("dlq.db").display().to_string();
    apply(
        &cp,
        dir.path(),
        "v1.yaml",
        &document("edge", &broker.url(), &dlq),
    )
    .await?;
    running(&cp, &agent, &id, "edge", 1).await?;
    flows(&broker, &out, 0..N, N).await?;

    // The control plane dies mid-run: data keeps flowing.
    cp.process.sigkill()?;
    flows(&broker, &out, N..2 * N, 2 * N).await?;

    // Back on the same address and state: the agent reports within two
    // heartbeat intervals.
    let (restart, reported) = restart_control_plane(&mut cp, &cp_args, &id).await?;
    eprintln!(
        "control plane accepting → agent reported: {reported:?} ({restart:?} after the restart)"
    );
    assert!(reported <= HEARTBEAT * 2, "{reported:?}");

    // Started while the control plane is down: runs from its cache.
    cp.process.sigkill()?;
    agent.restart().await?;
    ferry_tests::wait::until(TIMEOUT, "the agent ready from its cache", || {
        std::future::ready(agent.is_ready())
    })
    .await?;
    flows(&broker, &out, 2 * N..3 * N, 3 * N).await?;
    let counts = out.counts();
    assert!(counts.missing("out/edge", 0..3 * N).is_empty());
    let log = agent.process.stderr();
    assert!(log.contains("bridge running from the cache"), "{log}");
    conserved(&agent, "main", N).await?;

    // The control plane back: the agent's Hello says what it runs, so the
    // running bridge is neither pushed again nor restarted.
    restart_control_plane(&mut cp, &cp_args, &id).await?;
    flows(&broker, &out, 3 * N..4 * N, 4 * N).await?;
    let log = agent.process.stderr();
    assert!(!log.contains("stopping bridge"), "{log}");
    assert!(!log.contains("configuration pushed"), "{log}");
    conserved(&agent, "main", 2 * N).await?;
    Ok(())
}

/// Starts the control plane again with `args` (its ports and state), waits
/// until agent `id` connected to it; returns how long after the start that
/// was, and how long after the control plane accepted connections.
async fn restart_control_plane(
    cp: &mut ControlPlane,
    args: &[String],
    id: &str,
) -> anyhow::Result<(Duration, Duration)> {
    let since = SystemTime::now();
    let spawned = Instant::now();
    cp.process = ChildProcess::spawn(
        project_bin("ferry-control-plane")?,
        args,
        [("RUST_LOG", "info")],
    )?;
    let grpc = cp.grpc;
    ferry_tests::wait::until(TIMEOUT, "the control plane back", || async move {
        ferry_tests::ports::accepts_connections(grpc)
    })
    .await?;
    let back = Instant::now();
    let cp: &ControlPlane = cp;
    ferry_tests::wait::until_ok(TIMEOUT, "the agent reconnected", || async {
        let info = agent_info(cp, id).await?;
        let at = info.connected_at.context("no connected_at")?;
        anyhow::ensure!(
            info.connected && SystemTime::try_from(at)? >= since,
            "{info:?}"
        );
        Ok(())
    })
    .await?;
    Ok((spawned.elapsed(), back.elapsed()))
}

/// The arguments `ControlPlane::start` gave `cp`, to start it again on the
/// same ports and state.
fn control_plane_args(cp: &ControlPlane, state: &str, data: &Path) -> anyhow::Result<Vec<String>> {
    std::fs::create_dir_all(data)?;
    Ok(vec![
        "--listen".to_owned(),
        cp.grpc.to_string(),
        "--http-listen".to_owned(),
        cp.http.to_string(),
        "--data-dir".to_owned(),
        data.display().to_string(),
        "--heartbeat-interval-ms".to_owned(),
        HEARTBEAT.as_millis().to_string(),
        "--state".to_owned(),
        state.to_owned(),
    ])
}
