//! Shared helpers of the control plane's API tests: a server on SQLite in a
//! temporary directory, reached in memory (tokio duplex pipes) or over TCP;
//! configuration documents; a scripted fake agent.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ferry_control_plane::server::ControlPlane;
use ferry_control_plane::services::{Context, Options};
use ferry_control_plane::state::{StateStore, open_state_store};
use ferry_shared::api::v1 as pb;
use hyper_util::rt::TokioIo;
use pb::agent_message::Message as Up;
use pb::control_message::Message as Down;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint, Uri};

pub use pb::agent_service_client::AgentServiceClient;
pub use pb::config_service_client::ConfigServiceClient;
pub use pb::dlq_service_client::DlqServiceClient;
pub use pb::lease_service_client::LeaseServiceClient;
pub use pb::metrics_service_client::MetricsServiceClient;

/// How a test reaches the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// tokio duplex pipes, no sockets.
    Memory,
    /// A TCP listener on a free loopback port.
    Tcp,
}

/// Both transports, for tests that run every call over each.
pub const TRANSPORTS: [Transport; 2] = [Transport::Memory, Transport::Tcp];

/// A control plane on SQLite in a temporary directory.
pub struct TestServer {
    pub channel: Channel,
    pub store: Arc<dyn StateStore>,
    pub ctx: Context,
    pub state_url: String,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
    _dir: Option<tempfile::TempDir>,
}

/// Short timings so tests about heartbeats and redrives finish quickly.
pub fn test_options() -> Options {
    Options {
        heartbeat_interval: Duration::from_millis(200),
        resync_interval: Duration::from_secs(5),
        hello_timeout: Duration::from_secs(2),
        command_timeout: Duration::from_secs(2),
        ..Options::default()
    }
}

impl TestServer {
    /// A server on a fresh SQLite file.
    pub async fn start(transport: Transport) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/state.db", dir.path().display());
        let mut server = Self::start_on(transport, &url, test_options()).await;
        server._dir = Some(dir);
        server
    }

    /// A server on the state at `url` (for restarts on the same file).
    pub async fn start_on(transport: Transport, url: &str, options: Options) -> Self {
        let store = open_state_store(url).await.unwrap();
        let control_plane = ControlPlane::new(store.clone(), options);
        let ctx = control_plane.context().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let shutdown = async move {
            let _ = stopped.await;
        };
        let (channel, task) = match transport {
            Transport::Memory => {
                let (conn_tx, conn_rx) = mpsc::channel::<tokio::io::DuplexStream>(16);
                let incoming = ReceiverStream::new(conn_rx).map(Ok::<_, std::io::Error>);
                let task = tokio::spawn(async move {
                    control_plane
                        .serve_with_incoming(incoming, shutdown)
                        .await
                        .unwrap();
                });
                let channel = Endpoint::try_from("http://in-memory.invalid")
                    .unwrap()
                    .connect_with_connector(tower::service_fn(move |_: Uri| {
                        let conn_tx = conn_tx.clone();
                        async move {
                            let (client, server) = tokio::io::duplex(1 << 20);
                            conn_tx.send(server).await.map_err(std::io::Error::other)?;
                            Ok::<_, std::io::Error>(TokioIo::new(client))
                        }
                    }))
                    .await
                    .unwrap();
                (channel, task)
            }
            Transport::Tcp => {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let addr = listener.local_addr().unwrap();
                let task = tokio::spawn(async move {
                    control_plane.serve(listener, shutdown).await.unwrap();
                });
                let channel = Endpoint::try_from(format!("http://{addr}"))
                    .unwrap()
                    .connect()
                    .await
                    .unwrap();
                (channel, task)
            }
        };
        Self {
            channel,
            store,
            ctx,
            state_url: url.to_owned(),
            stop: Some(stop),
            task: Some(task),
            _dir: None,
        }
    }

    pub fn config(&self) -> ConfigServiceClient<Channel> {
        ConfigServiceClient::new(self.channel.clone())
            .max_encoding_message_size(32 << 20)
            .max_decoding_message_size(32 << 20)
    }
    pub fn agents(&self) -> AgentServiceClient<Channel> {
        AgentServiceClient::new(self.channel.clone())
    }
    pub fn leases(&self) -> LeaseServiceClient<Channel> {
        LeaseServiceClient::new(self.channel.clone())
    }
    pub fn dlq(&self) -> DlqServiceClient<Channel> {
        DlqServiceClient::new(self.channel.clone())
    }
    pub fn metrics(&self) -> MetricsServiceClient<Channel> {
        MetricsServiceClient::new(self.channel.clone())
    }

    /// Stops the server (agent streams end) and waits until it has.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(10), task)
                .await
                .expect("the server stops within 10 s")
                .unwrap();
        }
    }

    /// Where the SQLite state lives (kept until the server is dropped).
    pub fn dir(&self) -> Option<PathBuf> {
        self._dir.as_ref().map(|d| d.path().to_owned())
    }
}

/// A valid configuration document for `bridge` whose one route allows
/// `max_in_flight` deliveries.
pub fn document(bridge: &str, max_in_flight: u32) -> String {
    format!(
        r#"bridge:
  id: {bridge}
sessions:
  - id: conn
    transport: mqtt
    options:
      session:
        broker_url: tcp://127.0.0.1:1883
        client_id: {bridge}-client
stores:
  dlq:
    type: sqlite
    options:
      path: /tmp/{bridge}-dlq.db
receivers:
  - id: in
    session_id: conn
    topics:
      - topic: "in/#"
        qos: 1
  - id: spare
    session_id: conn
    topics:
      - topic: "spare/#"
        qos: 1
senders:
  - id: out
    session_id: conn
bindings:
  - id: to-out
    sender_id: out
    address: out/topic
routes:
  - id: main
    receiver_id: in
    delivery_mode: direct_hold
    dispatch_mode: single
    bindings: [to-out]
    policy:
      max_in_flight: {max_in_flight}
"#
    )
}

/// An apply request for a YAML document.
pub fn apply(
    yaml: &str,
    selector: &[(&str, &str)],
    expected: Option<u64>,
) -> pb::ApplyConfigRequest {
    pb::ApplyConfigRequest {
        document: Some(pb::apply_config_request::Document::Yaml(
            yaml.as_bytes().to_vec(),
        )),
        selector: Some(pb::LabelSelector {
            match_labels: selector
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        }),
        expected_version: expected,
        change_note: "test".into(),
    }
}

/// A scripted agent on a real Connect stream.
pub struct FakeAgent {
    pub id: String,
    tx: mpsc::Sender<pb::AgentMessage>,
    rx: tonic::Streaming<pb::ControlMessage>,
}

impl FakeAgent {
    /// Connects and says hello with `labels` and the versions it `running`.
    pub async fn connect(
        channel: Channel,
        id: &str,
        labels: &[(&str, &str)],
        running: &[(&str, u64)],
    ) -> Result<Self, tonic::Status> {
        let (tx, rx) = mpsc::channel(16);
        tx.send(hello(id, labels, running)).await.unwrap();
        let response = AgentServiceClient::new(channel)
            .connect(ReceiverStream::new(rx))
            .await?;
        Ok(Self {
            id: id.to_owned(),
            tx,
            rx: response.into_inner(),
        })
    }

    pub async fn send(&self, message: Up) {
        self.tx
            .send(pb::AgentMessage {
                message: Some(message),
            })
            .await
            .unwrap();
    }

    /// The next message other than a heartbeat (within 5 s).
    pub async fn next(&mut self) -> Result<Option<Down>, tonic::Status> {
        loop {
            let message = tokio::time::timeout(Duration::from_secs(5), self.rx.message())
                .await
                .expect("a control message within 5 s")?;
            match message {
                None => return Ok(None),
                Some(pb::ControlMessage {
                    message: Some(Down::Heartbeat(_)),
                }) => continue,
                Some(pb::ControlMessage { message }) => return Ok(message),
            }
        }
    }

    /// The next heartbeat (within 5 s).
    pub async fn next_heartbeat(&mut self) -> pb::Heartbeat {
        loop {
            let message = tokio::time::timeout(Duration::from_secs(5), self.rx.message())
                .await
                .expect("a control message within 5 s")
                .unwrap()
                .expect("the stream is open");
            if let Some(Down::Heartbeat(h)) = message.message {
                return h;
            }
        }
    }

    pub async fn next_push(&mut self) -> pb::ConfigPush {
        match self.next().await.unwrap() {
            Some(Down::Push(push)) => push,
            other => panic!("expected a push, got {other:?}"),
        }
    }

    pub async fn ack(&self, push: &pb::ConfigPush) {
        self.send(Up::Ack(pb::ConfigAck {
            bridge_id: push.bridge_id.clone(),
            version: push.version,
            nonce: push.nonce.clone(),
        }))
        .await;
    }

    pub async fn nack(&self, push: &pb::ConfigPush, error: &str, details: &[&str]) {
        self.send(Up::Nack(pb::ConfigNack {
            bridge_id: push.bridge_id.clone(),
            version: push.version,
            nonce: push.nonce.clone(),
            error: error.to_owned(),
            details: details.iter().map(|d| (*d).to_owned()).collect(),
            running_version: 0,
        }))
        .await;
    }

    /// Closes the agent's side of the stream.
    pub fn close(self) -> tonic::Streaming<pb::ControlMessage> {
        self.rx
    }
}

pub fn hello(id: &str, labels: &[(&str, &str)], running: &[(&str, u64)]) -> pb::AgentMessage {
    pb::AgentMessage {
        message: Some(Up::Hello(pb::Hello {
            agent_id: id.to_owned(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            build_version: "test".into(),
            capabilities: vec!["command.dlq_redrive".into()],
            running: running
                .iter()
                .map(|(b, v)| pb::RunningConfig {
                    bridge_id: (*b).to_owned(),
                    version: *v,
                })
                .collect(),
        })),
    }
}

/// Polls `check` every 10 ms until it holds; panics after 5 s naming `what`.
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
