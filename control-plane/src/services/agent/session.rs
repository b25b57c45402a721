//! One agent's `Connect` stream, after its Hello: xDS state-of-the-world.
//!
//! Invariants:
//! - the agent is sent every configuration whose selector matches its labels,
//!   once per version, each push with a fresh nonce; a version the agent said
//!   it already runs (in its Hello) is not pushed again;
//! - only an answer carrying the latest nonce sent for a bridge counts; any
//!   other is stale and ignored;
//! - a configuration that is deleted or stops matching is withdrawn;
//! - the stream re-reconciles after every local configuration change (the
//!   context's watch channel) and every `resync_interval` (changes made
//!   through another replica);
//! - heartbeats go out every interval; an agent silent for three intervals
//!   is disconnected; on shutdown the stream ends cleanly (status OK).
//!
//! The agent is marked disconnected in the state store before its
//! registration is dropped, so a reconnect is never overwritten by the old
//! stream's end.

use std::collections::{BTreeMap, BTreeSet};
use std::time::SystemTime;

use ferry_shared::api::v1 as pb;
use pb::agent_message::Message as Up;
use pb::control_message::Message as Down;
use tokio::sync::mpsc;
use tokio::time::{Instant, MissedTickBehavior};
use tonic::{Status, Streaming};
use tracing::{debug, info, warn};

use super::super::Context;
use super::super::registry::Registration;
use super::super::status::{selects, timestamp};
use crate::state::{AgentBridgeEvent, Labels, MetricsRecord, PageRequest, StoredConfig};

type Outbound = mpsc::Sender<Result<pb::ControlMessage, Status>>;

/// Why the loop ended.
enum End {
    /// The agent closed its side, or the server is shutting down.
    Clean,
    /// The stream failed or the agent misbehaved; it is told why when possible.
    Failed(Status),
    /// The agent can no longer be written to.
    Gone,
}

/// One connected agent's stream state.
pub struct Session {
    ctx: Context,
    agent_id: String,
    labels: Labels,
    registration: Registration,
    out: Outbound,
    /// Per bridge: the last version pushed and its nonce.
    pushed: BTreeMap<String, (u64, String)>,
    /// Per bridge: the version the agent runs (from its Hello or ACKs).
    running: BTreeMap<String, u64>,
    /// Per bridge: the nonce of a pending withdrawal.
    withdrawals: BTreeMap<String, String>,
    last_heard: Instant,
}

impl Session {
    /// A session for the agent that sent `hello`.
    pub fn new(ctx: Context, hello: pb::Hello, registration: Registration, out: Outbound) -> Self {
        let running: BTreeMap<String, u64> = hello
            .running
            .into_iter()
            .filter(|r| r.version > 0)
            .map(|r| (r.bridge_id, r.version))
            .collect();
        for (bridge, version) in &running {
            registration.set_running(bridge, Some(*version));
        }
        Self {
            ctx,
            agent_id: hello.agent_id,
            labels: hello.labels.into_iter().collect(),
            registration,
            out,
            pushed: BTreeMap::new(),
            running,
            withdrawals: BTreeMap::new(),
            last_heard: Instant::now(),
        }
    }

    /// Runs the stream until it ends, then records the disconnection.
    pub async fn run(
        mut self,
        mut inbound: Streaming<pb::AgentMessage>,
        mut commands: mpsc::Receiver<pb::Command>,
    ) {
        let end = self.serve(&mut inbound, &mut commands).await;
        match &end {
            End::Clean => info!(agent = %self.agent_id, "agent stream ended"),
            End::Gone => info!(agent = %self.agent_id, "agent went away"),
            End::Failed(status) => {
                warn!(agent = %self.agent_id, error = %status.message(), "agent stream failed");
            }
        }
        if let End::Failed(status) = end {
            // The agent may already be gone; nothing more to do then.
            let _ = self.out.try_send(Err(status));
        }
        if let Err(error) = self
            .ctx
            .store
            .mark_agent_disconnected(&self.agent_id, SystemTime::now())
            .await
        {
            warn!(agent = %self.agent_id, %error, "cannot record the agent's disconnection");
        }
        drop(self.registration);
    }

    async fn serve(
        &mut self,
        inbound: &mut Streaming<pb::AgentMessage>,
        commands: &mut mpsc::Receiver<pb::Command>,
    ) -> End {
        let interval = self.ctx.options.heartbeat_interval;
        let mut heartbeat = tokio::time::interval(interval);
        heartbeat.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut resync = tokio::time::interval(self.ctx.options.resync_interval);
        resync.set_missed_tick_behavior(MissedTickBehavior::Delay);
        resync.tick().await;
        let mut changes = self.ctx.changes.subscribe();
        changes.mark_unchanged();
        if let Err(end) = self.reconcile().await {
            return end;
        }
        let shutdown = self.ctx.shutdown.clone();
        loop {
            let step = tokio::select! {
                () = shutdown.cancelled() => return End::Clean,
                message = inbound.message() => match message {
                    Ok(Some(message)) => self.handle(message).await,
                    Ok(None) => return End::Clean,
                    Err(status) => return End::Failed(status),
                },
                changed = changes.changed() => match changed {
                    Ok(()) => self.reconcile().await,
                    Err(_) => return End::Clean,
                },
                _ = resync.tick() => self.reconcile().await,
                Some(command) = commands.recv() => self.send(Down::Command(command)).await,
                _ = heartbeat.tick() => self.heartbeat(interval).await,
            };
            if let Err(end) = step {
                return end;
            }
        }
    }

    async fn send(&self, message: Down) -> Result<(), End> {
        self.out
            .send(Ok(pb::ControlMessage {
                message: Some(message),
            }))
            .await
            .map_err(|_| End::Gone)
    }

    async fn heartbeat(&mut self, interval: std::time::Duration) -> Result<(), End> {
        if self.last_heard.elapsed() > interval * 3 {
            return Err(End::Failed(Status::deadline_exceeded(format!(
                "nothing arrived from agent {} for three heartbeat intervals ({interval:?} each)",
                self.agent_id
            ))));
        }
        let interval_ms = u32::try_from(interval.as_millis()).unwrap_or(u32::MAX);
        self.send(Down::Heartbeat(pb::Heartbeat {
            sent_at: Some(timestamp(SystemTime::now())),
            interval_ms,
        }))
        .await
    }

    async fn handle(&mut self, message: pb::AgentMessage) -> Result<(), End> {
        self.last_heard = Instant::now();
        let now = SystemTime::now();
        let store = &self.ctx.store;
        if let Err(error) = store.mark_agent_seen(&self.agent_id, now).await {
            warn!(agent = %self.agent_id, %error, "cannot record the agent as seen");
        }
        let event = match message.message {
            None => return Ok(()),
            Some(Up::Hello(_)) => {
                return Err(End::Failed(Status::invalid_argument(
                    "hello is only allowed as the first message of a stream",
                )));
            }
            Some(Up::Heartbeat(_)) => return Ok(()),
            Some(Up::CommandResult(result)) => {
                if !self.ctx.agents.complete(result) {
                    debug!(agent = %self.agent_id, "command result nobody waits for");
                }
                return Ok(());
            }
            Some(Up::Metrics(mut snapshot)) => {
                snapshot.agent_id.clone_from(&self.agent_id);
                let captured_at = snapshot
                    .captured_at
                    .and_then(|t| SystemTime::try_from(t).ok())
                    .unwrap_or(now);
                let record = MetricsRecord {
                    agent_id: self.agent_id.clone(),
                    captured_at,
                    snapshot: prost::Message::encode_to_vec(&snapshot),
                };
                if let Err(error) = store.put_metrics(record).await {
                    warn!(agent = %self.agent_id, %error, "cannot store a metrics snapshot");
                }
                return Ok(());
            }
            Some(Up::Ack(ack)) => {
                if self.withdrawals.get(&ack.bridge_id) == Some(&ack.nonce) {
                    self.withdrawals.remove(&ack.bridge_id);
                    return Ok(());
                }
                if !self.is_latest(&ack.bridge_id, &ack.nonce) {
                    debug!(agent = %self.agent_id, bridge = %ack.bridge_id, "stale ack ignored");
                    return Ok(());
                }
                self.running.insert(ack.bridge_id.clone(), ack.version);
                self.registration
                    .set_running(&ack.bridge_id, Some(ack.version));
                info!(agent = %self.agent_id, bridge = %ack.bridge_id, version = ack.version, "configuration acked");
                (
                    ack.bridge_id,
                    AgentBridgeEvent::Acked {
                        version: ack.version,
                    },
                )
            }
            Some(Up::Nack(nack)) => {
                if !self.is_latest(&nack.bridge_id, &nack.nonce) {
                    debug!(agent = %self.agent_id, bridge = %nack.bridge_id, "stale nack ignored");
                    return Ok(());
                }
                warn!(agent = %self.agent_id, bridge = %nack.bridge_id, version = nack.version, error = %nack.error, "configuration nacked");
                (
                    nack.bridge_id,
                    AgentBridgeEvent::Nacked {
                        version: nack.version,
                        error: nack.error,
                        details: nack.details,
                    },
                )
            }
        };
        let (bridge, event) = event;
        if let Err(error) = store
            .record_agent_bridge(&self.agent_id, &bridge, event, now)
            .await
        {
            warn!(agent = %self.agent_id, %bridge, %error, "cannot record the agent's answer");
        }
        Ok(())
    }

    fn is_latest(&self, bridge: &str, nonce: &str) -> bool {
        self.pushed
            .get(bridge)
            .is_some_and(|(_, latest)| latest == nonce)
    }

    /// Pushes what changed and withdraws what no longer applies. A store
    /// error is logged and retried at the next resync.
    async fn reconcile(&mut self) -> Result<(), End> {
        let configs = match self.matching_configs().await {
            Ok(configs) => configs,
            Err(error) => {
                warn!(agent = %self.agent_id, %error, "cannot read configurations; retrying at the next resync");
                return Ok(());
            }
        };
        let mut wanted = BTreeSet::new();
        for config in configs {
            wanted.insert(config.bridge_id.clone());
            let pushed = self.pushed.get(&config.bridge_id).map(|(v, _)| *v);
            let running = self.running.get(&config.bridge_id).copied();
            if pushed == Some(config.version)
                || (pushed.is_none() && running == Some(config.version))
            {
                continue;
            }
            self.push(config).await?;
        }
        let stale: Vec<String> = self
            .pushed
            .keys()
            .chain(self.running.keys())
            .filter(|bridge| !wanted.contains(*bridge))
            .cloned()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        for bridge in stale {
            self.withdraw(bridge).await?;
        }
        Ok(())
    }

    async fn matching_configs(&self) -> crate::state::StateResult<Vec<StoredConfig>> {
        let mut configs = Vec::new();
        let mut page = PageRequest::first(crate::state::MAX_PAGE_SIZE);
        loop {
            let listed = self.ctx.store.list_configs(page.clone()).await?;
            let next = page.after(&listed);
            configs.extend(
                listed
                    .items
                    .into_iter()
                    .filter(|c| selects(&c.selector, &self.labels)),
            );
            match next {
                Some(next) => page = next,
                None => return Ok(configs),
            }
        }
    }

    async fn push(&mut self, config: StoredConfig) -> Result<(), End> {
        let nonce = uuid::Uuid::now_v7().to_string();
        self.send(Down::Push(pb::ConfigPush {
            bridge_id: config.bridge_id.clone(),
            version: config.version,
            nonce: nonce.clone(),
            yaml: config.yaml,
        }))
        .await?;
        info!(agent = %self.agent_id, bridge = %config.bridge_id, version = config.version, "configuration pushed");
        self.pushed
            .insert(config.bridge_id.clone(), (config.version, nonce.clone()));
        let event = AgentBridgeEvent::Pushed {
            version: config.version,
            nonce,
        };
        self.record(&config.bridge_id, event).await;
        Ok(())
    }

    async fn withdraw(&mut self, bridge: String) -> Result<(), End> {
        let nonce = uuid::Uuid::now_v7().to_string();
        self.send(Down::Withdraw(pb::ConfigWithdraw {
            bridge_id: bridge.clone(),
            nonce: nonce.clone(),
        }))
        .await?;
        info!(agent = %self.agent_id, %bridge, "configuration withdrawn");
        self.pushed.remove(&bridge);
        self.running.remove(&bridge);
        self.registration.set_running(&bridge, None);
        self.withdrawals.insert(bridge.clone(), nonce);
        self.record(&bridge, AgentBridgeEvent::Withdrawn).await;
        Ok(())
    }

    async fn record(&self, bridge: &str, event: AgentBridgeEvent) {
        if let Err(error) = self
            .ctx
            .store
            .record_agent_bridge(&self.agent_id, bridge, event, SystemTime::now())
            .await
        {
            warn!(agent = %self.agent_id, %bridge, %error, "cannot record a push or withdrawal");
        }
    }
}
