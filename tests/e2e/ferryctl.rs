//! `ferryctl` as a process against a running control plane: apply, get,
//! history, rollback, describe agent (a NACK's error), dlq list / show /
//! purge; a rejected apply exits non-zero printing the validator's list.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use ferry_shared::api::v1 as pb;
use ferry_tests::project_bin;
use pb::agent_message::Message as Up;
use pb::control_message::Message as Down;

use crate::control_plane::ControlPlane;

struct Output {
    ok: bool,
    stdout: String,
    stderr: String,
}

async fn ferryctl(cp: &ControlPlane, args: &[&str]) -> anyhow::Result<Output> {
    let output = tokio::process::Command::new(project_bin("ferryctl")?)
        .arg("--endpoint")
        .arg(cp.endpoint())
        .args(args)
        .output()
        .await?;
    Ok(Output {
        ok: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    })
}

async fn ok(cp: &ControlPlane, args: &[&str]) -> anyhow::Result<String> {
    let out = ferryctl(cp, args).await?;
    anyhow::ensure!(
        out.ok,
        "ferryctl {args:?} failed:\n{}{}",
        out.stdout,
        out.stderr
    );
    Ok(out.stdout)
}

pub(crate) fn document(bridge: &str, max_in_flight: u32) -> String {
    format!(
        "bridge:\n  id: {bridge}\nsessions:\n  - id: conn\n    transport: mqtt\n    options:\n      session:\n        broker_url: tcp://127.0.0.1:1883\n        client_id: {bridge}-client\nstores:\n  dlq:\n    type: sqlite\n    options:\n      path: /tmp/{bridge}-dlq.db\nreceivers:\n  - id: in\n    session_id: conn\n    topics:\n      - topic: \"in/#\"\n        qos: 1\nsenders:\n  - id: out\n    session_id: conn\nbindings:\n  - id: to-out\n    sender_id: out\n    address: out/topic\nroutes:\n  - id: main\n    receiver_id: in\n    delivery_mode: direct_hold\n    dispatch_mode: single\n    bindings: [to-out]\n    policy:\n      max_in_flight: {max_in_flight}\n"
    )
}

pub(crate) fn write(dir: &Path, name: &str, text: &str) -> anyhow::Result<String> {
    let path = dir.join(name);
    std::fs::write(&path, text)?;
    Ok(path.display().to_string())
}

/// The next push on an agent stream (heartbeats skipped), within 10 s.
async fn next_push(
    stream: &mut tonic::Streaming<pb::ControlMessage>,
) -> anyhow::Result<pb::ConfigPush> {
    let wait = async {
        loop {
            let message = stream.message().await?.context("stream ended")?;
            if let Some(Down::Push(push)) = message.message {
                return anyhow::Ok(push);
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), wait).await?
}

#[tokio::test]
async fn ferryctl_manages_configs_agents_and_dead_letters() -> anyhow::Result<()> {
    let cp = ControlPlane::start(None).await?;
    let files = tempfile::tempdir()?;
    let v1 = write(files.path(), "v1.yaml", &document("edge", 10))?;
    let v2 = write(files.path(), "v2.yaml", &document("edge", 20))?;

    let out = ok(&cp, &["apply", "-f", &v1, "--selector", "site=a"]).await?;
    assert!(out.contains("bridge edge configured: version 1"), "{out}");
    let out = ok(&cp, &["get", "configs"]).await?;
    assert!(out.contains("edge") && out.contains("site=a"), "{out}");
    let out = ok(&cp, &["get", "routes", "edge"]).await?;
    for needle in ["main", "in", "direct_hold", "single", "to-out"] {
        assert!(out.contains(needle), "{needle} in {out}");
    }

    // A rejected apply: non-zero, every problem listed, nothing stored.
    let broken = document("edge", 30)
        .replace("bindings: [to-out]", "bindings: [to-nowhere]")
        .replace("receiver_id: in", "receiver_id: nothing");
    let bad = write(files.path(), "bad.yaml", &broken)?;
    let out = ferryctl(&cp, &["apply", "-f", &bad]).await?;
    assert!(!out.ok);
    assert!(out.stderr.contains("InvalidArgument"), "{}", out.stderr);
    assert!(
        out.stderr.contains("to-nowhere") && out.stderr.contains("nothing"),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr.lines().count() >= 3,
        "one line per problem: {}",
        out.stderr
    );

    // A scripted agent gets v1 and refuses it; describe shows why.
    let channel = cp.channel().await?;
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let hello = pb::Hello {
        agent_id: "edge-agent".into(),
        labels: [("site".to_owned(), "a".to_owned())].into(),
        build_version: "e2e".into(),
        ..Default::default()
    };
    tx.send(pb::AgentMessage {
        message: Some(Up::Hello(hello)),
    })
    .await?;
    let mut stream = pb::agent_service_client::AgentServiceClient::new(channel.clone())
        .connect(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    let push = next_push(&mut stream).await?;
    assert_eq!(push.version, 1);
    tx.send(pb::AgentMessage {
        message: Some(Up::Nack(pb::ConfigNack {
            bridge_id: push.bridge_id.clone(),
            version: 1,
            nonce: push.nonce.clone(),
            error: "stores.dlq: cannot open /tmp/edge-dlq.db".into(),
            details: vec!["stores.dlq.options.path: permission denied".into()],
            running_version: 0,
        })),
    })
    .await?;
    ferry_tests::wait::until_ok(
        Duration::from_secs(10),
        "the NACK in describe agent",
        || async {
            let out = ok(&cp, &["describe", "agent", "edge-agent"]).await?;
            anyhow::ensure!(out.contains("cannot open /tmp/edge-dlq.db"), "{out}");
            anyhow::ensure!(out.contains("permission denied"), "{out}");
            Ok(())
        },
    )
    .await?;

    // The fixed version is pushed and ACKed.
    let out = ok(
        &cp,
        &[
            "apply",
            "-f",
            &v2,
            "--selector",
            "site=a",
            "--expected-version",
            "1",
        ],
    )
    .await?;
    assert!(out.contains("version 2"), "{out}");
    let fixed = next_push(&mut stream).await?;
    assert_eq!(fixed.version, 2);
    tx.send(pb::AgentMessage {
        message: Some(Up::Ack(pb::ConfigAck {
            bridge_id: "edge".into(),
            version: 2,
            nonce: fixed.nonce,
        })),
    })
    .await?;
    ferry_tests::wait::until_ok(Duration::from_secs(10), "the ACK in get agents", || async {
        let out = ok(&cp, &["get", "agents"]).await?;
        anyhow::ensure!(
            out.contains("edge-agent") && out.contains("edge@2"),
            "{out}"
        );
        anyhow::ensure!(!out.contains("nack"), "{out}");
        Ok(())
    })
    .await?;

    // History and rollback.
    let out = ok(&cp, &["history", "edge"]).await?;
    assert!(out.contains('1') && out.contains('2'), "{out}");
    let out = ok(&cp, &["rollback", "edge", "--to", "1"]).await?;
    assert!(out.contains('3'), "{out}");
    let out = ok(&cp, &["-o", "json", "describe", "config", "edge"]).await?;
    let json: serde_json::Value = serde_json::from_str(&out)?;
    assert_eq!(json["version"], 3);
    assert!(
        json["yaml"]
            .as_str()
            .unwrap_or_default()
            .contains("max_in_flight: 10"),
        "{out}"
    );

    // Dead letters: list, show, purge (confirmation required).
    let mut dlq = pb::dlq_service_client::DlqServiceClient::new(channel);
    for id in ["dl-1", "dl-2"] {
        dlq.write_dlq_entry(pb::WriteDlqEntryRequest {
            entry: Some(pb::DlqEntry {
                id: id.into(),
                bridge_id: "edge".into(),
                route_id: "main".into(),
                binding_id: "to-out".into(),
                envelope: Some(pb::Envelope {
                    id: format!("m-{id}"),
                    payload: b"hello".to_vec(),
                    ..Default::default()
                }),
                reason: pb::DlqReason::PermanentError.into(),
                last_error: "refused by broker".into(),
                ..Default::default()
            }),
        })
        .await?;
    }
    let out = ok(&cp, &["get", "dlq", "--bridge", "edge"]).await?;
    assert!(out.contains("dl-1") && out.contains("dl-2"), "{out}");
    let out = ok(&cp, &["dlq", "show", "dl-1"]).await?;
    assert!(out.contains("refused by broker"), "{out}");
    let out = ferryctl(&cp, &["dlq", "purge", "--bridge", "edge"]).await?;
    assert!(!out.ok && out.stderr.contains("--yes"), "{}", out.stderr);
    ok(&cp, &["dlq", "purge", "--bridge", "edge", "--yes"]).await?;
    let out = ok(&cp, &["-o", "json", "get", "dlq"]).await?;
    assert!(!out.contains("dl-1"), "{out}");
    drop(tx);
    Ok(())
}

/// More leases than the server puts on one page (100 by default): `get
/// leases` follows the page tokens and lists every one, in key order, once.
#[tokio::test]
async fn ferryctl_lists_every_page() -> anyhow::Result<()> {
    const LEASES: usize = 250;
    let cp = ControlPlane::start(None).await?;
    let mut leases = pb::lease_service_client::LeaseServiceClient::new(cp.channel().await?);
    let keys: Vec<String> = (0..LEASES).map(|i| format!("paging/p{i:03}")).collect();
    // One more lease outside the prefix, which the first listing leaves out.
    let outside = "other/p".to_owned();
    for key in keys.iter().chain([&outside]) {
        leases
            .acquire_lease(pb::AcquireLeaseRequest {
                key: key.clone(),
                holder: "e2e".into(),
                ttl: Some(prost_types::Duration {
                    seconds: 600,
                    nanos: 0,
                }),
            })
            .await?;
    }

    let out = ok(&cp, &["-o", "json", "get", "leases", "--prefix", "paging/"]).await?;
    let listed: Vec<serde_json::Value> = serde_json::from_str(&out)?;
    let listed: Vec<&str> = listed
        .iter()
        .map(|lease| lease["key"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(listed, keys);

    let table = ok(&cp, &["get", "leases"]).await?;
    assert_eq!(table.lines().count(), 1 + LEASES + 1, "header and rows");
    assert!(table.contains(&outside) && table.contains("paging/p249"));
    Ok(())
}
