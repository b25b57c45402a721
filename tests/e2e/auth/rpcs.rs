//! Every RPC behind the authentication layer: refused without a credential
//! (found by reflection, so a new RPC cannot slip through), answered for
//! each role as the one table says, and an agent token that acts only as its
//! agent and for the bridges assigned to it.

use std::time::Duration;

use ferry_shared::api::v1 as pb;
use ferry_shared::auth::policy::{self, TABLE};
use ferry_shared::auth::tokens::parse_role;
use pb::agent_service_client::AgentServiceClient;
use pb::config_service_client::ConfigServiceClient;
use pb::dlq_service_client::DlqServiceClient;
use pb::lease_service_client::LeaseServiceClient;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

use super::support::{
    ROLE_TOKENS, Server, bearer, bridge_yaml, call, reflected_methods, write_tokens,
};

/// A server's reflected methods each refuse a call without a credential
/// with UNAUTHENTICATED, and each has an entry in the table.
async fn refuses_every_reflected_rpc(server: &Server, expect_service: &str) -> anyhow::Result<()> {
    let methods = reflected_methods(server.channel().await?).await?;
    anyhow::ensure!(
        methods.iter().any(|m| m.starts_with(expect_service)),
        "reflection lists no {expect_service}: {methods:?}"
    );
    for method in &methods {
        let status = call(server.channel().await?, method, None)
            .await
            .expect_err(method);
        assert_eq!(status.code(), Code::Unauthenticated, "{method}: {status:?}");
        assert!(
            status.message().contains("no credential"),
            "{method}: {status:?}"
        );
        assert!(
            policy::roles(method).is_some(),
            "{method} has no entry in the role table"
        );
    }
    Ok(())
}

#[tokio::test]
async fn every_reflected_rpc_refuses_a_call_without_a_credential() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let tokens = dir.path().join("tokens.yaml");
    write_tokens(&tokens, &ROLE_TOKENS)?;
    let flags = ["--tokens".to_owned(), tokens.display().to_string()];
    let cp = Server::control_plane(dir, &flags).await?;
    let methods = reflected_methods(cp.channel().await?).await?;
    for (path, _) in TABLE {
        assert!(
            methods.iter().any(|m| m == path),
            "{path} is not served: {methods:?}"
        );
    }
    refuses_every_reflected_rpc(&cp, "/ferry.v1.ConfigService/").await?;

    let dir = tempfile::tempdir()?;
    let tokens = dir.path().join("admin-tokens.yaml");
    write_tokens(&tokens, &ROLE_TOKENS)?;
    let flags = ["--tokens".to_owned(), tokens.display().to_string()];
    let agent = Server::agent(dir, &flags).await?;
    refuses_every_reflected_rpc(&agent, "/ferry.v1.DlqService/").await?;
    // The operator's token reaches the agent's DLQ.
    let listed = DlqServiceClient::new(agent.channel().await?)
        .list_dlq_entries(bearer(
            tonic::Request::new(pb::ListDlqEntriesRequest::default()),
            Some("operator-token"),
        ))
        .await;
    assert!(listed.is_ok(), "{listed:?}");
    Ok(())
}

#[tokio::test]
async fn every_rpc_answers_each_role_as_the_table_says() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let tokens = dir.path().join("tokens.yaml");
    write_tokens(&tokens, &ROLE_TOKENS)?;
    let flags = ["--tokens".to_owned(), tokens.display().to_string()];
    let cp = Server::control_plane(dir, &flags).await?;
    for (path, allowed) in TABLE {
        for (name, role, _, token) in ROLE_TOKENS {
            let role = parse_role(role).expect("a role");
            let result = call(cp.channel().await?, path, Some(token)).await;
            let code = result.as_ref().err().map_or(Code::Ok, tonic::Status::code);
            if allowed.contains(&role) {
                // Past the layer: the empty request is the service's to judge.
                assert!(
                    !matches!(code, Code::PermissionDenied | Code::Unauthenticated),
                    "{name} ({role}) on {path}: {result:?}"
                );
            } else {
                let status = result.expect_err(path);
                assert_eq!(status.code(), Code::PermissionDenied, "{name} on {path}");
                assert!(status.message().contains(path), "{status:?}");
            }
        }
    }
    Ok(())
}

/// `ApplyConfig` of bridge `bridge` for agents labelled `site`, as the
/// operator (`token`; `None` for a certificate).
pub(super) fn apply(
    bridge: &str,
    site: &str,
    token: Option<&str>,
) -> tonic::Request<pb::ApplyConfigRequest> {
    let yaml = bridge_yaml(bridge, std::path::Path::new("/tmp/unused-dlq.db"));
    bearer(
        tonic::Request::new(pb::ApplyConfigRequest {
            document: Some(pb::apply_config_request::Document::Yaml(yaml.into_bytes())),
            selector: Some(pb::LabelSelector {
                match_labels: [("site".to_owned(), site.to_owned())].into(),
            }),
            ..Default::default()
        }),
        token,
    )
}

fn hello(agent: &str, site: &str) -> pb::AgentMessage {
    pb::AgentMessage {
        message: Some(pb::agent_message::Message::Hello(pb::Hello {
            agent_id: agent.to_owned(),
            labels: [("site".to_owned(), site.to_owned())].into(),
            ..Default::default()
        })),
    }
}

fn acquire(key: &str, holder: &str, token: &str) -> tonic::Request<pb::AcquireLeaseRequest> {
    bearer(
        tonic::Request::new(pb::AcquireLeaseRequest {
            key: key.to_owned(),
            holder: holder.to_owned(),
            ttl: Some(prost_types::Duration {
                seconds: 10,
                nanos: 0,
            }),
        }),
        Some(token),
    )
}

fn dead_letter(bridge: &str) -> tonic::Request<pb::WriteDlqEntryRequest> {
    bearer(
        tonic::Request::new(pb::WriteDlqEntryRequest {
            entry: Some(pb::DlqEntry {
                id: format!("{bridge}-1"),
                bridge_id: bridge.to_owned(),
                route_id: "main".into(),
                binding_id: "to-out".into(),
                envelope: Some(pb::Envelope {
                    id: "m1".into(),
                    payload: b"x".to_vec(),
                    ..Default::default()
                }),
                reason: pb::DlqReason::PermanentError.into(),
                ..Default::default()
            }),
        }),
        Some("agent-token"),
    )
}

/// The first message down `agent`'s stream, or the refusal (and the sender
/// that keeps the stream open).
pub(super) type Opened = (
    mpsc::Sender<pb::AgentMessage>,
    Result<pb::ControlMessage, tonic::Status>,
);

/// Opens `agent`'s stream on `channel` with `token` (or the channel's certificate).
pub(super) async fn connect(
    channel: tonic::transport::Channel,
    token: Option<&str>,
    agent: &str,
    site: &str,
) -> anyhow::Result<Opened> {
    let (up, rx) = mpsc::channel(4);
    up.send(hello(agent, site)).await?;
    let request = bearer(tonic::Request::new(ReceiverStream::new(rx)), token);
    let answer = match AgentServiceClient::new(channel).connect(request).await {
        Ok(response) => {
            let mut down = response.into_inner();
            match tokio::time::timeout(Duration::from_secs(10), down.message()).await {
                Ok(Ok(Some(first))) => Ok(first),
                Ok(Ok(None)) => Err(tonic::Status::aborted("stream ended")),
                Ok(Err(status)) => Err(status),
                Err(_) => Err(tonic::Status::deadline_exceeded("no first message")),
            }
        }
        Err(status) => Err(status),
    };
    Ok((up, answer))
}

#[tokio::test]
async fn an_agent_token_acts_only_as_its_agent_and_for_its_bridges() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let tokens = dir.path().join("tokens.yaml");
    let mut entries = ROLE_TOKENS.to_vec();
    entries.push(("edge-02", "agent", Some("edge-02"), "other-agent-token"));
    write_tokens(&tokens, &entries)?;
    let flags = ["--tokens".to_owned(), tokens.display().to_string()];
    let cp = Server::control_plane(dir, &flags).await?;
    let mut configs = ConfigServiceClient::new(cp.channel().await?);
    configs
        .apply_config(apply("mine", "a", Some("operator-token")))
        .await?;
    configs
        .apply_config(apply("theirs", "b", Some("operator-token")))
        .await?;

    // Another agent's stream: refused, naming the id.
    let (_up, refused) = connect(cp.channel().await?, Some("agent-token"), "edge-02", "b").await?;
    let status = refused.expect_err("edge-01's token opened edge-02's stream");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(status.message().contains("edge-02"), "{status:?}");
    // Its own: the push of the bridge its labels select.
    let (_stream, first) =
        connect(cp.channel().await?, Some("agent-token"), "edge-01", "a").await?;
    let first = first.map_err(|s| anyhow::anyhow!("own stream refused: {s:?}"))?;
    assert!(
        matches!(first.message, Some(pb::control_message::Message::Push(_))),
        "{first:?}"
    );

    let mut leases = LeaseServiceClient::new(cp.channel().await?);
    let granted = leases
        .acquire_lease(acquire("mine/main", "edge-01", "agent-token"))
        .await;
    assert!(granted.is_ok(), "{granted:?}");
    for (request, names) in [
        (acquire("theirs/main", "edge-01", "agent-token"), "theirs"),
        (acquire("mine/main", "edge-02", "agent-token"), "edge-02"),
        // edge-02 never connected: nothing is assigned to it.
        (
            acquire("mine/main", "edge-02", "other-agent-token"),
            "never connected",
        ),
    ] {
        let status = leases.acquire_lease(request).await.expect_err(names);
        assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
        assert!(status.message().contains(names), "{status:?}");
    }

    let mut dlq = DlqServiceClient::new(cp.channel().await?);
    let written = dlq.write_dlq_entry(dead_letter("mine")).await;
    assert!(written.is_ok(), "{written:?}");
    let status = dlq
        .write_dlq_entry(dead_letter("theirs"))
        .await
        .expect_err("a dead letter of another agent's bridge");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    Ok(())
}

#[tokio::test]
async fn a_server_without_credentials_or_insecure_does_not_start() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("state").display().to_string();
    let cp = ferry_tests::project_bin("ferry-control-plane")?;
    let mut process = ferry_tests::ChildProcess::spawn(
        cp,
        ["--listen", "127.0.0.1:0", "--data-dir", &state],
        [(ferry_tests::process::INSECURE, "false")],
    )?;
    let status = process.wait_exit(super::support::TIMEOUT).await?;
    assert_eq!(status.code(), Some(1), "{}", process.output_tail());
    let stderr = process.stderr();
    for flag in ["--tokens", "--client-ca", "--insecure"] {
        assert!(stderr.contains(flag), "{flag} in {stderr}");
    }
    Ok(())
}
