//! What the authentication tests share: a control plane (or standalone
//! agent) process started with security flags, token files, certificates
//! made with rcgen, and calls of any RPC by its path with an empty message.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use ferry_shared::auth::tokens::hash_token;
use ferry_tests::process::INSECURE;
use ferry_tests::{ChildProcess, free_port, ports, project_bin, wait};
use prost::Message;
use tonic::transport::{Channel, Endpoint};
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

pub const TIMEOUT: Duration = Duration::from_secs(15);

/// One token per role; the agent token is agent `edge-01`'s.
pub const ROLE_TOKENS: [(&str, &str, Option<&str>, &str); 4] = [
    ("root", "admin", None, "admin-token"),
    ("alice", "operator", None, "operator-token"),
    ("victor", "viewer", None, "viewer-token"),
    ("edge-01", "agent", Some("edge-01"), "agent-token"),
];

/// Writes a token file with `entries` (name, role, agent id, token).
pub fn write_tokens(
    path: &Path,
    entries: &[(&str, &str, Option<&str>, &str)],
) -> anyhow::Result<()> {
    let mut text = String::from("tokens:\n");
    for (name, role, agent, token) in entries {
        text.push_str(&format!("  - name: {name}\n    role: {role}\n"));
        if let Some(agent) = agent {
            text.push_str(&format!("    agent_id: {agent}\n"));
        }
        text.push_str(&format!("    sha256: {}\n", hash_token(token)));
    }
    // Write then rename: the server never reads a half-written file.
    let partial = path.with_extension("partial");
    std::fs::write(&partial, text)?;
    std::fs::rename(&partial, path)?;
    Ok(())
}

/// A process serving gRPC on a free loopback port.
pub struct Server {
    pub process: ChildProcess,
    pub addr: SocketAddr,
    pub dir: tempfile::TempDir,
}

impl Server {
    /// A control plane with `security` flags (paths inside `dir` are the
    /// caller's), its state in `dir`.
    pub async fn control_plane(
        dir: tempfile::TempDir,
        security: &[String],
    ) -> anyhow::Result<Self> {
        let addr = ports::loopback(free_port()?);
        let mut args = vec![
            "--listen".to_owned(),
            addr.to_string(),
            "--data-dir".to_owned(),
            dir.path().join("state").display().to_string(),
        ];
        args.extend(security.iter().cloned());
        Self::start(project_bin("ferry-control-plane")?, args, dir, addr).await
    }

    /// A standalone agent whose admin listener serves its DLQ over gRPC,
    /// with `security` flags; its brokers are not running (it retries).
    pub async fn agent(dir: tempfile::TempDir, security: &[String]) -> anyhow::Result<Self> {
        let addr = ports::loopback(free_port()?);
        let config = dir.path().join("bridge.yaml");
        std::fs::write(&config, bridge_yaml("local", &dir.path().join("dlq.db")))?;
        let mut args = vec![
            "run".to_owned(),
            "--config".to_owned(),
            config.display().to_string(),
            "--admin-listen".to_owned(),
            addr.to_string(),
            "--agent-id".to_owned(),
            "edge-01".to_owned(),
        ];
        args.extend(security.iter().cloned());
        Self::start(project_bin("ferry-agent")?, args, dir, addr).await
    }

    async fn start(
        bin: PathBuf,
        args: Vec<String>,
        dir: tempfile::TempDir,
        addr: SocketAddr,
    ) -> anyhow::Result<Self> {
        let process = ChildProcess::spawn(bin, args, [(INSECURE, "false"), ("RUST_LOG", "info")])?;
        let up = wait::until(TIMEOUT, format!("a server on {addr}"), || async move {
            ports::accepts_connections(addr)
        })
        .await;
        if let Err(error) = up {
            anyhow::bail!("{error:#}\n{}", process.output_tail());
        }
        Ok(Self { process, addr, dir })
    }

    /// A plain `http://` channel to it.
    pub async fn channel(&self) -> anyhow::Result<Channel> {
        Ok(Endpoint::from_shared(format!("http://{}", self.addr))?
            .connect()
            .await?)
    }
}

/// A bridge document selecting nothing in itself (the selector is applied
/// with it): one direct_hold route, a SQLite DLQ at `dlq`.
pub fn bridge_yaml(bridge: &str, dlq: &Path) -> String {
    format!(
        "bridge:\n  id: {bridge}\nsessions:\n  - id: conn\n    transport: mqtt\n    options:\n      session:\n        broker_url: tcp://127.0.0.1:9\n        client_id: {bridge}-client\nstores:\n  dlq:\n    type: sqlite\n    options:\n      path: {}\nreceivers:\n  - id: in\n    session_id: conn\n    topics:\n      - topic: \"in/#\"\n        qos: 1\nsenders:\n  - id: out\n    session_id: conn\nbindings:\n  - id: to-out\n    sender_id: out\n    address: out/topic\nroutes:\n  - id: main\n    receiver_id: in\n    delivery_mode: direct_hold\n    dispatch_mode: single\n    bindings: [to-out]\n",
        dlq.display()
    )
}

/// `request` with `authorization: Bearer token` when a token is given.
pub fn bearer<T>(mut request: tonic::Request<T>, token: Option<&str>) -> tonic::Request<T> {
    if let Some(token) = token {
        let value = format!("Bearer {token}").parse().expect("ASCII token");
        request.metadata_mut().insert("authorization", value);
    }
    request
}

/// Calls `path` with one empty message (valid for every request type) as a
/// stream, which every method accepts on the wire; the call's status
/// (`Ok` for an OK answer).
pub async fn call(channel: Channel, path: &str, token: Option<&str>) -> Result<(), tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let path: http::uri::PathAndQuery = path.parse().expect("a method path");
    let request = bearer(tonic::Request::new(tokio_stream::once(())), token);
    let codec = tonic_prost::ProstCodec::<(), ()>::default();
    let answered = tokio::time::timeout(TIMEOUT, async move {
        let mut stream = grpc.streaming(request, path, codec).await?.into_inner();
        while stream.message().await?.is_some() {}
        Ok(())
    });
    answered
        .await
        .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("no answer")))
}

/// Every method the server lists by reflection, as `/package.Service/Method`,
/// except the reflection service itself and health.
pub async fn reflected_methods(channel: Channel) -> anyhow::Result<Vec<String>> {
    let mut client = ServerReflectionClient::new(channel);
    let ask = |message| ServerReflectionRequest {
        host: String::new(),
        message_request: Some(message),
    };
    let mut services = Vec::new();
    let mut answers = client
        .server_reflection_info(tokio_stream::iter([ask(MessageRequest::ListServices(
            String::new(),
        ))]))
        .await?
        .into_inner();
    if let Some(MessageResponse::ListServicesResponse(list)) =
        answers.message().await?.and_then(|r| r.message_response)
    {
        services.extend(list.service.into_iter().map(|s| s.name));
    }
    anyhow::ensure!(!services.is_empty(), "reflection lists no service");
    let mut methods = Vec::new();
    for service in services.iter().filter(|s| !s.starts_with("grpc.")) {
        let mut answers = client
            .server_reflection_info(tokio_stream::iter([ask(
                MessageRequest::FileContainingSymbol(service.clone()),
            )]))
            .await?
            .into_inner();
        let Some(MessageResponse::FileDescriptorResponse(files)) =
            answers.message().await?.and_then(|r| r.message_response)
        else {
            anyhow::bail!("no descriptor for {service}");
        };
        let (package, name) = service.rsplit_once('.').context("a qualified name")?;
        for bytes in files.file_descriptor_proto {
            let file = prost_types::FileDescriptorProto::decode(bytes.as_slice())?;
            if file.package() != package {
                continue;
            }
            for s in file.service.iter().filter(|s| s.name() == name) {
                methods.extend(s.method.iter().map(|m| format!("/{service}/{}", m.name())));
            }
        }
    }
    Ok(methods)
}

/// A CA and certificates it signs, made with rcgen.
pub struct Ca {
    issuer: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
}

impl Ca {
    pub fn new(name: &str) -> anyhow::Result<Self> {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let issuer = rcgen::CertifiedIssuer::self_signed(params, rcgen::KeyPair::generate()?)?;
        Ok(Self { issuer })
    }

    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A leaf for `dns` names and SAN `uris`, as (certificate, key) PEM.
    pub fn leaf(&self, dns: &[&str], uris: &[&str]) -> anyhow::Result<(String, String)> {
        let names: Vec<String> = dns.iter().map(|d| d.to_string()).collect();
        let mut params = rcgen::CertificateParams::new(names)?;
        for uri in uris {
            params
                .subject_alt_names
                .push(rcgen::SanType::URI(rcgen::string::Ia5String::try_from(
                    *uri,
                )?));
        }
        let key = rcgen::KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}

/// Writes `pem` to `dir/name` and returns the path as a flag value.
pub fn write(dir: &Path, name: &str, pem: &str) -> anyhow::Result<String> {
    let path = dir.join(name);
    std::fs::write(&path, pem)?;
    Ok(path.display().to_string())
}
