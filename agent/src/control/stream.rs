//! One `AgentService.Connect` stream, from the agent's side (xDS
//! state-of-the-world, see `proto/ferry/v1/agent.proto`).
//!
//! Invariants:
//! - the first message is the Hello: id, labels, build version,
//!   capabilities and every version the agent runs now, so the control plane
//!   does not push an unchanged version again;
//! - every push and withdrawal is handed to the applier in arrival order and
//!   answered by it with the push's nonce (the control plane ignores an
//!   answer that is not for its latest nonce);
//! - the agent sends a heartbeat every interval the control plane asks for
//!   (10 s until it says), also while a bridge is being applied, and drops
//!   the stream when nothing arrived for three intervals;
//! - a metrics snapshot goes up every `--metrics-interval` (the first one
//!   right after the Hello), so a reconnected agent reports at once;
//! - a command runs in a task of its own ([`super::commands`]): the loop
//!   never waits for one;
//! - each kind of message is handled by its own function.

use ferry_shared::auth::client::ClientAuth;
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use ferry_shared::api::v1 as pb;
use pb::agent_message::Message as Up;
use pb::agent_service_client::AgentServiceClient;
use pb::control_message::Message as Down;
use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use super::applier::{Work, WorkKind};
use super::commands::Commands;
use super::report::Reporter;

/// The heartbeat interval until the control plane says otherwise.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(10);
/// Messages buffered towards the control plane.
const OUTBOUND_BUFFER: usize = 64;
/// How long a connection attempt, or the answer to the Hello, may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// What the agent says about itself, and the credentials that prove it.
#[derive(Clone, Debug)]
pub struct Identity {
    /// Its id.
    pub agent_id: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its token or certificate, presented on the stream.
    pub client: ClientAuth,
}

/// What goes up the stream besides answers to pushes.
#[derive(Clone, Debug)]
pub struct Upstream {
    /// The metrics snapshots.
    pub reporter: Reporter,
    /// The commands' runner.
    pub commands: Commands,
}

/// How a stream ended.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The endpoint is not a usable URL.
    #[error("control plane endpoint {0}")]
    Endpoint(String),
    /// No connection (refused, timed out, TLS failed).
    #[error("cannot connect to the control plane: {0}")]
    Connect(#[from] tonic::transport::Error),
    /// The control plane refused or ended the stream.
    #[error("control plane: {} ({:?})", .0.message(), .0.code())]
    Status(#[from] tonic::Status),
    /// Nothing arrived for three heartbeat intervals.
    #[error("nothing arrived from the control plane for {0:?}")]
    Silent(Duration),
    /// The control plane closed the stream.
    #[error("the control plane closed the stream")]
    Closed,
}

/// The state of one open stream.
struct Stream {
    out: mpsc::Sender<pb::AgentMessage>,
    work: mpsc::Sender<Work>,
    upstream: Upstream,
    interval: Duration,
    last_heard: Instant,
}

/// Whether the stream was accepted (the Hello answered), for the backoff.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reached {
    /// The control plane answered.
    Yes,
    /// It did not.
    No,
}

/// Opens a stream to `endpoint` and serves it until it ends or `shutdown`
/// is cancelled (`Ok`). `heartbeat` is the interval last asked for; it is
/// updated when the control plane asks for another.
pub async fn serve(
    endpoint: &str,
    identity: &Identity,
    versions: &watch::Receiver<BTreeMap<String, u64>>,
    work: mpsc::Sender<Work>,
    upstream: &Upstream,
    heartbeat: &mut Duration,
    shutdown: &CancellationToken,
) -> (Reached, Result<(), StreamError>) {
    let channel = match connect(endpoint, &identity.client).await {
        Ok(channel) => channel,
        Err(e) => return (Reached::No, Err(e)),
    };
    let (out, out_rx) = mpsc::channel(OUTBOUND_BUFFER);
    let hello = hello(identity, &versions.borrow());
    if out.send(hello).await.is_err() {
        return (Reached::No, Err(StreamError::Closed));
    }
    let mut client = AgentServiceClient::new(identity.client.wrap(channel));
    let opened = tokio::time::timeout(CONNECT_TIMEOUT, client.connect(ReceiverStream::new(out_rx)));
    let mut inbound = match opened.await {
        Ok(Ok(response)) => response.into_inner(),
        Ok(Err(status)) => return (Reached::No, Err(status.into())),
        Err(_) => return (Reached::No, Err(StreamError::Silent(CONNECT_TIMEOUT))),
    };
    tracing::info!(endpoint, agent = %identity.agent_id, "connected to the control plane");
    let mut stream = Stream {
        out,
        work,
        upstream: upstream.clone(),
        interval: *heartbeat,
        last_heard: Instant::now(),
    };
    let result = stream.run(&mut inbound, shutdown).await;
    *heartbeat = stream.interval;
    (Reached::Yes, result)
}

async fn connect(
    endpoint: &str,
    client: &ClientAuth,
) -> Result<tonic::transport::Channel, StreamError> {
    let ep = client
        .endpoint(endpoint)
        .map_err(StreamError::Endpoint)?
        .connect_timeout(CONNECT_TIMEOUT);
    Ok(ep.connect().await?)
}

fn hello(identity: &Identity, versions: &BTreeMap<String, u64>) -> pb::AgentMessage {
    pb::AgentMessage {
        message: Some(Up::Hello(pb::Hello {
            agent_id: identity.agent_id.clone(),
            labels: identity.labels.clone().into_iter().collect(),
            build_version: env!("CARGO_PKG_VERSION").to_owned(),
            capabilities: capabilities(),
            running: versions
                .iter()
                .map(|(bridge_id, version)| pb::RunningConfig {
                    bridge_id: bridge_id.clone(),
                    version: *version,
                })
                .collect(),
        })),
    }
}

/// What this agent can run.
fn capabilities() -> Vec<String> {
    [
        "transport.mqtt",
        "store.memory",
        "store.sqlite",
        "command.dlq_redrive",
        "metrics",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect()
}

impl Stream {
    async fn run(
        &mut self,
        inbound: &mut tonic::Streaming<pb::ControlMessage>,
        shutdown: &CancellationToken,
    ) -> Result<(), StreamError> {
        let mut ticker = self.ticker();
        let mut report = tokio::time::interval(self.upstream.reporter.interval);
        report.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                message = inbound.message() => match message? {
                    Some(message) => {
                        self.last_heard = Instant::now();
                        let before = self.interval;
                        self.handle(message).await?;
                        if self.interval != before {
                            ticker = self.ticker();
                        }
                    }
                    None => return Err(StreamError::Closed),
                },
                _ = ticker.tick() => self.heartbeat().await?,
                _ = report.tick() => self.report().await?,
            }
        }
    }

    fn ticker(&self) -> tokio::time::Interval {
        let mut ticker = tokio::time::interval(self.interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        ticker
    }

    async fn handle(&mut self, message: pb::ControlMessage) -> Result<(), StreamError> {
        match message.message {
            None => Ok(()),
            Some(Down::Push(push)) => self.on_push(push).await,
            Some(Down::Withdraw(withdraw)) => self.on_withdraw(withdraw).await,
            Some(Down::Heartbeat(heartbeat)) => {
                self.on_heartbeat(&heartbeat);
                Ok(())
            }
            Some(Down::Command(command)) => {
                self.on_command(command);
                Ok(())
            }
        }
    }

    async fn on_push(&mut self, push: pb::ConfigPush) -> Result<(), StreamError> {
        tracing::info!(bridge = %push.bridge_id, version = push.version, "configuration pushed");
        self.hand_over(WorkKind::Push(push)).await
    }

    async fn on_withdraw(&mut self, withdraw: pb::ConfigWithdraw) -> Result<(), StreamError> {
        tracing::info!(bridge = %withdraw.bridge_id, "configuration withdrawn");
        self.hand_over(WorkKind::Withdraw(withdraw)).await
    }

    fn on_heartbeat(&mut self, heartbeat: &pb::Heartbeat) {
        if heartbeat.interval_ms > 0 {
            self.interval = Duration::from_millis(u64::from(heartbeat.interval_ms));
        }
    }

    /// Starts the command's task; its result goes up this stream.
    fn on_command(&mut self, command: pb::Command) {
        tracing::info!(command = %command.command_id, "command received");
        self.upstream.commands.spawn(command, self.out.clone());
    }

    async fn report(&mut self) -> Result<(), StreamError> {
        let snapshot = self.upstream.reporter.snapshot();
        self.send(Up::Metrics(snapshot)).await
    }

    async fn hand_over(&mut self, kind: WorkKind) -> Result<(), StreamError> {
        let work = Work {
            kind,
            reply: self.out.clone(),
        };
        // The applier ends only when the agent stops.
        self.work.send(work).await.map_err(|_| StreamError::Closed)
    }

    async fn heartbeat(&mut self) -> Result<(), StreamError> {
        let silent = self.last_heard.elapsed();
        if silent > self.interval * 3 {
            return Err(StreamError::Silent(silent));
        }
        self.send(Up::Heartbeat(pb::Heartbeat {
            sent_at: Some(prost_types::Timestamp::from(SystemTime::now())),
            interval_ms: 0,
        }))
        .await
    }

    async fn send(&self, message: Up) -> Result<(), StreamError> {
        self.out
            .send(pb::AgentMessage {
                message: Some(message),
            })
            .await
            .map_err(|_| StreamError::Closed)
    }
}
