//! The `ferry-control-plane` binary as a process: health and reflection over
//! TCP, Prometheus `/metrics`, graceful SIGTERM with an agent stream open,
//! and two processes on one PostgreSQL database handing out lease versions.

use ferry_shared::auth::client::{AuthChannel, ClientAuth};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use ferry_shared::api::v1 as pb;
use ferry_tests::{ChildProcess, TestDatabase, free_port, ports, project_bin, wait};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::Endpoint;

const TIMEOUT: Duration = Duration::from_secs(15);

/// A control-plane process on free loopback ports.
pub struct ControlPlane {
    pub process: ChildProcess,
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    /// What the test's own gRPC calls ([`Self::channel`]) present: nothing
    /// in the open mode, or the token [`Self::with_token`] set.
    auth: ClientAuth,
    _dir: tempfile::TempDir,
}

impl ControlPlane {
    /// Starts one on SQLite in a fresh data directory, or on `state` when given.
    pub async fn start(state: Option<&str>) -> anyhow::Result<Self> {
        Self::start_with(state, &[], &[]).await
    }

    /// Like [`Self::start`], with `extra` arguments (security flags) and
    /// `env` added to the process's environment.
    pub async fn start_with(
        state: Option<&str>,
        extra: &[String],
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let grpc = ports::loopback(free_port()?);
        let http = ports::loopback(free_port()?);
        let mut args = vec![
            "--listen".to_owned(),
            grpc.to_string(),
            "--http-listen".to_owned(),
            http.to_string(),
            "--data-dir".to_owned(),
            dir.path().display().to_string(),
            "--heartbeat-interval-ms".to_owned(),
            "500".to_owned(),
            "--command-timeout-ms".to_owned(),
            "2000".to_owned(),
        ];
        if let Some(state) = state {
            args.extend(["--state".to_owned(), state.to_owned()]);
        }
        args.extend(extra.iter().cloned());
        let mut process = ChildProcess::spawn(
            project_bin("ferry-control-plane")?,
            args,
            std::iter::once(("RUST_LOG", "info")).chain(env.iter().copied()),
        )?;
        let started = wait::until(
            TIMEOUT,
            format!("the control plane on {grpc}"),
            || async move { ports::accepts_connections(grpc) },
        )
        .await;
        if let Err(error) = started {
            anyhow::bail!("{error:#}\n{}", process.output_tail());
        }
        assert!(process.is_running());
        Ok(Self {
            process,
            grpc,
            http,
            auth: ClientAuth::default(),
            _dir: dir,
        })
    }

    /// The test's own calls present `token` from now on.
    pub fn with_token(mut self, token: &str) -> anyhow::Result<Self> {
        self.auth = ClientAuth::new(Some(token), None, None, None)?;
        Ok(self)
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.grpc)
    }

    pub async fn channel(&self) -> anyhow::Result<AuthChannel> {
        let channel = Endpoint::from_shared(self.endpoint())?.connect().await?;
        Ok(self.auth.wrap(channel))
    }
}

/// A plain HTTP/1.0 GET, returning status line and body.
async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    Ok(response)
}

#[tokio::test]
async fn health_reflection_metrics_and_graceful_sigterm() -> anyhow::Result<()> {
    let mut cp = ControlPlane::start(None).await?;
    let channel = cp.channel().await?;

    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let services = [
        "ferry.v1.ConfigService",
        "ferry.v1.AgentService",
        "ferry.v1.LeaseService",
        "ferry.v1.DlqService",
        "ferry.v1.MetricsService",
    ];
    for service in std::iter::once("").chain(services) {
        let status = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await?
            .into_inner()
            .status;
        assert_eq!(
            status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
            "{service:?}"
        );
    }

    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let request = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = ServerReflectionClient::new(channel.clone())
        .server_reflection_info(tokio_stream::iter([request]))
        .await?
        .into_inner();
    let response = responses
        .message()
        .await?
        .context("a reflection response")?;
    let Some(MessageResponse::ListServicesResponse(listed)) = response.message_response else {
        anyhow::bail!("unexpected reflection response {response:?}");
    };
    let names: HashSet<String> = listed.service.into_iter().map(|s| s.name).collect();
    for service in services {
        assert!(names.contains(service), "{service} missing from {names:?}");
    }

    let metrics = http_get(cp.http, "/metrics").await?;
    assert!(
        metrics.starts_with("HTTP/1.0 200") || metrics.starts_with("HTTP/1.1 200"),
        "{metrics}"
    );
    assert!(metrics.contains("ferry_agents_connected 0"), "{metrics}");

    // An open agent stream does not hold up shutdown; it ends cleanly.
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(pb::AgentMessage {
        message: Some(pb::agent_message::Message::Hello(pb::Hello {
            agent_id: "sigterm-agent".into(),
            ..Default::default()
        })),
    })
    .await?;
    let mut stream = pb::agent_service_client::AgentServiceClient::new(channel)
        .connect(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    stream.message().await?.context("a first heartbeat")?;
    let metrics = http_get(cp.http, "/metrics").await?;
    assert!(metrics.contains("ferry_agents_connected 1"), "{metrics}");

    cp.process.sigterm()?;
    let status = cp.process.wait_exit(TIMEOUT).await?;
    assert!(status.success(), "{status:?}\n{}", cp.process.output_tail());
    loop {
        match tokio::time::timeout(TIMEOUT, stream.message()).await? {
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(status) => anyhow::bail!("the stream should end cleanly: {status:?}"),
        }
    }
    drop(tx);
    Ok(())
}

/// Two control-plane processes on one PostgreSQL database: concurrent
/// acquirers on both never get one fencing version twice.
#[tokio::test]
async fn two_control_planes_on_one_postgres_never_hand_out_a_version_twice() -> anyhow::Result<()> {
    use pb::acquire_lease_response::Outcome;
    let database = TestDatabase::create().await?;
    let url = database.url()?;
    let first = ControlPlane::start(Some(&url)).await?;
    let second = ControlPlane::start(Some(&url)).await?;
    let channels = [first.channel().await?, second.channel().await?];

    let mut tasks = Vec::new();
    for worker in 0..8 {
        let channel = channels[worker % 2].clone();
        tasks.push(tokio::spawn(async move {
            let mut leases = pb::lease_service_client::LeaseServiceClient::new(channel);
            let holder = format!("worker-{worker}");
            let mut granted = Vec::new();
            let mut attempts = 0;
            while granted.len() < 5 && attempts < 2000 {
                attempts += 1;
                let outcome = leases
                    .acquire_lease(pb::AcquireLeaseRequest {
                        key: "pg/partition".into(),
                        holder: holder.clone(),
                        ttl: Some(Duration::from_secs(30).try_into()?),
                    })
                    .await?
                    .into_inner()
                    .outcome;
                if let Some(Outcome::Granted(lease)) = outcome {
                    granted.push(lease.version);
                    leases
                        .release_lease(pb::ReleaseLeaseRequest {
                            key: "pg/partition".into(),
                            holder: holder.clone(),
                            version: lease.version,
                        })
                        .await?;
                } else {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            anyhow::Ok(granted)
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        let granted = task.await??;
        assert!(granted.windows(2).all(|w| w[0] < w[1]), "{granted:?}");
        all.extend(granted);
    }
    let unique: HashSet<u64> = all.iter().copied().collect();
    assert_eq!(
        unique.len(),
        all.len(),
        "a version was handed out twice: {all:?}"
    );
    assert_eq!(all.len(), 40, "every worker got its five grants");
    Ok(())
}
