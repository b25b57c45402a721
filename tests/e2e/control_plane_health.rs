//! The control plane's standard endpoints, over TCP against the real binary:
//! gRPC health checking answers SERVING and server reflection lists every
//! `ferry.v1` service, so `grpc_health_probe` and `grpcurl` work.

use std::time::Duration;

use ferry_tests::ports::free_port;
use ferry_tests::process::{ChildProcess, project_bin};
use ferry_tests::wait;
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

const STARTUP: Duration = Duration::from_secs(30);

/// Starts `ferry-control-plane` on a free port.
async fn start_control_plane() -> anyhow::Result<(ChildProcess, Channel)> {
    let port = free_port()?;
    let listen = format!("127.0.0.1:{port}");
    let process = ChildProcess::spawn(
        project_bin("ferry-control-plane")?,
        ["--listen", listen.as_str()],
        Vec::<(String, String)>::new(),
    )?;
    let endpoint = Endpoint::from_shared(format!("http://{listen}"))?;
    let channel = wait::until_ok(STARTUP, "the control plane to accept gRPC", || {
        let endpoint = endpoint.clone();
        async move { Ok(endpoint.connect().await?) }
    })
    .await?;
    Ok((process, channel))
}

#[tokio::test]
async fn health_check_answers_serving_and_reflection_lists_every_service() -> anyhow::Result<()> {
    let (mut process, channel) = start_control_plane().await?;

    let health = HealthClient::new(channel.clone())
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await?
        .into_inner();
    assert_eq!(health.status(), ServingStatus::Serving);

    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = ServerReflectionClient::new(channel)
        .server_reflection_info(tokio_stream_once(request))
        .await?
        .into_inner();
    let response = responses
        .message()
        .await?
        .ok_or_else(|| anyhow::anyhow!("reflection closed the stream without an answer"))?;
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        anyhow::bail!("reflection answered {response:?} to ListServices");
    };
    let names: Vec<&str> = list.service.iter().map(|s| s.name.as_str()).collect();
    for service in [
        "ferry.v1.ConfigService",
        "ferry.v1.AgentService",
        "ferry.v1.LeaseService",
        "ferry.v1.DlqService",
        "ferry.v1.MetricsService",
        "grpc.health.v1.Health",
    ] {
        assert!(names.contains(&service), "{service} missing from {names:?}");
    }

    process.sigterm()?;
    let status = process.wait_exit(Duration::from_secs(10)).await?;
    assert!(
        status.success(),
        "SIGTERM should stop the control plane cleanly: {status}"
    );
    Ok(())
}

/// A request stream of one message.
fn tokio_stream_once<T: Send + 'static>(
    item: T,
) -> impl tonic::codegen::tokio_stream::Stream<Item = T> {
    tonic::codegen::tokio_stream::iter([item])
}
