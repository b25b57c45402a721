//! What an operator sees when something is wrong (issue 12, items 6–8): a full store named by
//! `/readyz`, counted by `ferry_store_errors_total` and logged once per change of state; an
//! outbox file that shrinks back after a backlog; one agent per data directory; `ferryctl`
//! ending quietly when its reader goes away; no colour codes in a log that is not a terminal.

use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use ferry_shared::api::v1 as pb;
use ferry_shared::api::v1::dlq_service_client::DlqServiceClient;
use ferry_tests::agent::{Agent, http_get};
use ferry_tests::mqtt::QoS;
use ferry_tests::process::{ChildProcess, project_bin};
use ferry_tests::{Mosquitto, PublishOptions, free_port, publish_seq, publish_seq_with, wait};

use crate::agent_support::{Bridge, quiesced};
use crate::control_plane::ControlPlane;
use crate::ferryctl::{document, write};

const DELIVERY: Duration = Duration::from_secs(30);

/// `ferryctl get configs | head -1`: the reader goes away before ferryctl writes. The write
/// fails with EPIPE (Rust ignores SIGPIPE); ferryctl must end quietly with exit 0, not panic
/// with "Broken pipe" (exit 101). The read end is closed before ferryctl has connected, so
/// every run sees the closed pipe — reading one line first would race with a table that fits
/// in one write.
#[tokio::test]
async fn ferryctl_ends_quietly_when_its_reader_goes_away() -> anyhow::Result<()> {
    let cp = ControlPlane::start(None).await?;
    let files = tempfile::tempdir()?;
    for i in 0..5 {
        let path = write(
            files.path(),
            &format!("c{i}.yaml"),
            &document(&format!("edge-{i}"), 10),
        )?;
        let out = tokio::process::Command::new(project_bin("ferryctl")?)
            .args(["--endpoint", &cp.endpoint(), "apply", "-f", &path])
            .output()
            .await?;
        anyhow::ensure!(out.status.success(), "apply {i}: {out:?}");
    }
    for args in [
        &["get", "configs"][..],
        &["-o", "json", "get", "configs"],
        &["-o", "yaml", "get", "configs"],
        &["get", "agents"],
    ] {
        let mut child = tokio::process::Command::new(project_bin("ferryctl")?)
            .arg("--endpoint")
            .arg(cp.endpoint())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        drop(child.stdout.take());
        let out = tokio::time::timeout(Duration::from_secs(15), child.wait_with_output()).await??;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "ferryctl {args:?}: {stderr}");
        assert_eq!(out.status.code(), Some(0), "ferryctl {args:?}: {stderr}");
    }
    Ok(())
}

/// The agent's log written to a file (not a terminal) carries no ANSI colour codes.
#[tokio::test]
async fn agent_log_to_a_file_has_no_colour_codes() -> anyhow::Result<()> {
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let mut bridge = Bridge::new(&a.url(), &b.url(), dir.path(), &["out"]);
    bridge.shared_outbox = false;
    let mut agent = bridge.start_agent().await?;
    // Ready can be reported a moment before the line is read back from the log file.
    let process = agent.process().context("the agent's process")?;
    process
        .wait_for_output("bridge running", Duration::from_secs(10))
        .await?;
    let stderr = process.stderr();
    assert!(
        !stderr.contains("\x1b["),
        "colour codes in a log file: {:?}",
        stderr.lines().next()
    );
    agent.terminate(Duration::from_secs(10)).await?;
    Ok(())
}

/// A second agent on the data directory of a running one exits at once (exit 1) with a line
/// naming the directory and the holder; the first keeps delivering; after a SIGKILL of the
/// first (the OS drops its lock) a new one starts and delivers.
#[tokio::test]
async fn a_second_agent_on_the_same_data_directory_exits_naming_the_holder() -> anyhow::Result<()> {
    const N: u64 = 50;
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let bridge = Bridge::new(&a.url(), &b.url(), dir.path(), &["x"]);
    let collector = bridge.collector().await?;
    let mut agent = bridge.start_agent().await?;
    let holder_pid = agent.process().map(|p| p.pid()).unwrap_or_default();

    let mut second = ChildProcess::spawn(
        project_bin("ferry-agent")?,
        [
            "run".to_owned(),
            "--config".to_owned(),
            dir.path().join("bridge.yaml").display().to_string(),
            "--admin-listen".to_owned(),
            format!("127.0.0.1:{}", free_port()?),
            "--agent-id".to_owned(),
            "second".to_owned(),
        ],
        [("RUST_LOG", "info")],
    )?;
    let status = second.wait_exit(Duration::from_secs(10)).await?;
    let stderr = second.stderr();
    assert_eq!(status.code(), Some(1), "{stderr}");
    let dir_name = dir.path().display().to_string();
    assert!(stderr.contains(&dir_name), "names the directory: {stderr}");
    assert!(
        stderr.contains(&format!("pid {holder_pid}")),
        "names the holder: {stderr}"
    );

    publish_seq(&a.url(), &bridge.input(), 0..N, QoS::AtLeastOnce).await?;
    collector
        .wait_for(&bridge.output("x"), 0..N, DELIVERY)
        .await?;
    quiesced(&agent, &bridge.bindings, DELIVERY).await?;

    agent.restart()?;
    agent.wait_ready(Duration::from_secs(20)).await?;
    publish_seq(&a.url(), &bridge.input(), N..2 * N, QoS::AtLeastOnce).await?;
    collector
        .wait_for(&bridge.output("x"), 0..2 * N, DELIVERY)
        .await?;
    let counts = quiesced(&agent, &bridge.bindings, DELIVERY).await?;
    assert_eq!(counts[0].sent, counts[0].received, "{counts:?}");
    assert!(
        collector
            .counts()
            .missing(&bridge.output("x"), 0..2 * N)
            .is_empty()
    );
    agent.terminate(Duration::from_secs(10)).await?;
    Ok(())
}

/// The value of `ferry_store_errors_total` for `store` and `kind` (0 when absent).
fn store_errors(agent: &Agent, store: &str, kind: &str) -> anyhow::Result<f64> {
    let (status, body) = http_get(agent_port(agent)?, "/metrics")?;
    anyhow::ensure!(status == 200, "/metrics answered {status}");
    let store = format!("store=\"{store}\"");
    let kind = format!("kind=\"{kind}\"");
    Ok(body
        .lines()
        .filter(|l| l.starts_with("ferry_store_errors_total{") && l.contains(&store))
        .filter(|l| l.contains(&kind))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum())
}

fn agent_port(agent: &Agent) -> anyhow::Result<u16> {
    let url = agent.admin_url();
    Ok(url.rsplit_once(':').map_or("", |(_, p)| p).parse()?)
}

/// A DLQ that is full (`max_size_bytes` at its minimum) and a message that must be
/// dead-lettered (100 KB on a route whose `max_payload_bytes` is 1024): `/readyz` answers not
/// ready naming the DLQ and why, `ferry_store_errors_total{store="dlq",kind="full"}` counts
/// the failed writes, and the log says so once — not once per attempt. Restarted with room,
/// the agent is ready again, the message is in the DLQ and the law holds exactly.
#[tokio::test]
async fn a_full_dlq_is_named_by_readyz_counted_and_logged_once() -> anyhow::Result<()> {
    const N: u64 = 20;
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let mut bridge = Bridge::new(&a.url(), &b.url(), dir.path(), &["x"]);
    bridge.policy = vec!["max_payload_bytes: 1024".into()];
    let dlq_path = format!("path: {}/dlq.db\n", dir.path().display());
    let limited = bridge.yaml().replace(
        &dlq_path,
        &format!("{dlq_path}      max_size_bytes: 65536\n"),
    );
    anyhow::ensure!(limited != bridge.yaml(), "the DLQ limit was not applied");
    let collector = bridge.collector().await?;
    let mut agent = Agent::start(dir.path(), &limited)?;
    agent.wait_ready(Duration::from_secs(20)).await?;
    publish_seq(&a.url(), &bridge.input(), 0..N, QoS::AtLeastOnce).await?;
    collector
        .wait_for(&bridge.output("x"), 0..N, DELIVERY)
        .await?;

    let big = PublishOptions {
        payload_size: 100_000,
        ..Default::default()
    };
    publish_seq_with(&a.url(), &bridge.input(), 100..101, QoS::AtLeastOnce, big).await?;
    let port = agent_port(&agent)?;
    let body = wait::until_ok(DELIVERY, "/readyz to name the full DLQ", || {
        let r = http_get(port, "/readyz").and_then(|(status, body)| {
            anyhow::ensure!(status == 503, "{status} {body}");
            anyhow::ensure!(body.contains("store dlq: full"), "{body}");
            Ok(body)
        });
        std::future::ready(r)
    })
    .await?;
    assert!(body.contains("database or disk is full"), "{body}");
    // Several attempts (the delivery is held and its write retried), each counted.
    wait::until_ok(DELIVERY, "three failed DLQ writes counted", || {
        let r = store_errors(&agent, "dlq", "full").and_then(|n| {
            if n >= 3.0 {
                Ok(())
            } else {
                anyhow::bail!("{n} so far")
            }
        });
        std::future::ready(r)
    })
    .await?;
    let stderr = agent.process().map(|p| p.stderr()).unwrap_or_default();
    let about_it: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("WARN") || l.contains("ERROR"))
        .filter(|l| l.to_lowercase().contains("dlq") || l.contains("store"))
        .collect();
    assert!(
        about_it.len() <= 3,
        "{} warnings about the full DLQ after 3 attempts:\n{}",
        about_it.len(),
        about_it.join("\n")
    );
    // Held, not left to the source: no reconnect to have the broker send it again.
    assert!(stderr.contains("pausing intake"), "{stderr}");
    assert!(
        !stderr.contains("reconnecting so the broker redelivers")
            && !stderr.contains("mqtt connection lost"),
        "{stderr}"
    );
    assert_eq!(
        agent
            .metrics()?
            .session("ferry_session_reconnects_total", "src"),
        0.0
    );

    // Room again: the broker redelivers the message to the next run, which dead-letters it.
    std::fs::write(dir.path().join("bridge.yaml"), bridge.yaml())?;
    agent.restart()?;
    agent.wait_ready(Duration::from_secs(20)).await?;
    wait::until_ok(
        DELIVERY,
        "the message dead-lettered after the restart",
        || {
            let r = agent.metrics().and_then(|m| {
                let c = m.binding("r", "x");
                anyhow::ensure!(
                    c.dead_lettered == 1 && c.in_flight == 0 && c.is_conserved(),
                    "{c:?}"
                );
                Ok(())
            });
            std::future::ready(r)
        },
    )
    .await?;
    let counts = quiesced(&agent, &bridge.bindings, DELIVERY).await?;
    assert_eq!(
        (counts[0].dropped, counts[0].dead_lettered),
        (0, 1),
        "{counts:?}"
    );
    let channel = tonic::transport::Channel::from_shared(agent.admin_url())?
        .connect()
        .await?;
    let listed = DlqServiceClient::new(channel)
        .list_dlq_entries(pb::ListDlqEntriesRequest::default())
        .await?
        .into_inner();
    assert_eq!(listed.entries.len(), 1, "{listed:?}");
    assert!(
        collector
            .counts()
            .missing(&bridge.output("x"), 0..N)
            .is_empty()
    );
    assert_eq!(collector.counts().count(&bridge.output("x"), 100), 0);
    agent.terminate(Duration::from_secs(10)).await?;
    Ok(())
}
