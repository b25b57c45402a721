//! AgentService: the `Connect` stream of every agent (see [`session`]) and
//! the listing of agents from the state store.
//!
//! An agent id that is already connected to this replica is refused with
//! `ALREADY_EXISTS`; the old stream is kept (see
//! `docs/adr/0002-agent-id-conflict.md`).

pub mod session;

use std::pin::Pin;
use std::time::SystemTime;

use ferry_shared::api::v1 as pb;
use futures::Stream;
use pb::agent_service_server::AgentService;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use ferry_shared::auth::Caller;
use ferry_shared::auth::policy::require_own_agent;

use super::Context;
use super::status::{require, state_status, timestamp};
use crate::state::{AgentHello, AgentRecord};

/// Messages buffered towards one agent before its stream applies
/// back-pressure.
const OUTBOUND_BUFFER: usize = 64;
/// Commands queued for one agent.
const COMMAND_BUFFER: usize = 16;

/// The AgentService implementation.
#[derive(Clone)]
pub struct AgentServiceImpl {
    ctx: Context,
}

impl AgentServiceImpl {
    /// The service over `ctx`.
    pub fn new(ctx: Context) -> Self {
        Self { ctx }
    }
}

type ControlStream = Pin<Box<dyn Stream<Item = Result<pb::ControlMessage, Status>> + Send>>;

#[tonic::async_trait]
impl AgentService for AgentServiceImpl {
    type ConnectStream = ControlStream;

    async fn connect(
        &self,
        request: Request<Streaming<pb::AgentMessage>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        let caller = Caller::of(&request).principal;
        let mut inbound = request.into_inner();
        let first = tokio::time::timeout(self.ctx.options.hello_timeout, inbound.message())
            .await
            .map_err(|_| {
                Status::invalid_argument("the first message must be a hello (none arrived in time)")
            })??;
        let Some(pb::AgentMessage {
            message: Some(pb::agent_message::Message::Hello(hello)),
        }) = first
        else {
            return Err(Status::invalid_argument(
                "the first message of a stream must be a hello",
            ));
        };
        require("hello.agent_id", &hello.agent_id)?;
        require_own_agent(&caller, &hello.agent_id, "the hello")?;
        crate::rpc_span::record_agent(&hello.agent_id);

        let (commands_tx, commands_rx) = mpsc::channel(COMMAND_BUFFER);
        let registration = self
            .ctx
            .agents
            .register(&hello.agent_id, commands_tx)
            .ok_or_else(|| {
                Status::already_exists(format!(
                    "agent {:?} is already connected; a second stream with the same id is refused",
                    hello.agent_id
                ))
            })?;
        let labels = hello.labels.clone().into_iter().collect();
        self.ctx
            .store
            .upsert_agent(AgentHello {
                agent_id: hello.agent_id.clone(),
                labels,
                build_version: hello.build_version.clone(),
                capabilities: hello.capabilities.clone(),
                connected_at: SystemTime::now(),
            })
            .await
            .map_err(state_status)?;
        tracing::info!(agent = %hello.agent_id, build = %hello.build_version, "agent connected");

        let (out_tx, out_rx) = mpsc::channel(OUTBOUND_BUFFER);
        let session = session::Session::new(self.ctx.clone(), hello, registration, out_tx);
        tokio::spawn(session.run(inbound, commands_rx));
        Ok(Response::new(Box::pin(ReceiverStream::new(out_rx))))
    }

    async fn list_agents(
        &self,
        request: Request<pb::ListAgentsRequest>,
    ) -> Result<Response<pb::ListAgentsResponse>, Status> {
        let request = request.into_inner();
        let size = ferry_shared::dlq::page_size(request.page_size) as usize;
        let agents = self.ctx.store.list_agents().await.map_err(state_status)?;
        // The token is the last id of the previous page (agents are ordered
        // by id, so concurrent hellos neither skip nor repeat anyone).
        let after = request.page_token;
        let mut page: Vec<AgentRecord> = agents
            .into_iter()
            .filter(|a| after.is_empty() || a.agent_id > after)
            .take(size + 1)
            .collect();
        let next_page_token = if page.len() > size {
            page.truncate(size);
            page.last().map(|a| a.agent_id.clone()).unwrap_or_default()
        } else {
            String::new()
        };
        Ok(Response::new(pb::ListAgentsResponse {
            agents: page.into_iter().map(agent_info).collect(),
            next_page_token,
        }))
    }

    async fn get_agent(
        &self,
        request: Request<pb::GetAgentRequest>,
    ) -> Result<Response<pb::GetAgentResponse>, Status> {
        let request = request.into_inner();
        require("agent_id", &request.agent_id)?;
        let record = self
            .ctx
            .store
            .get_agent(&request.agent_id)
            .await
            .map_err(state_status)?;
        Ok(Response::new(pb::GetAgentResponse {
            agent: Some(agent_info(record)),
        }))
    }
}

fn agent_info(record: AgentRecord) -> pb::AgentInfo {
    pb::AgentInfo {
        agent_id: record.agent_id,
        labels: record.labels.into_iter().collect(),
        build_version: record.build_version,
        capabilities: record.capabilities,
        connected: record.connected,
        connected_at: Some(timestamp(record.connected_at)),
        last_seen_at: Some(timestamp(record.last_seen)),
        disconnected_at: record.disconnected_at.map(timestamp),
        configs: record
            .bridges
            .into_iter()
            .map(|status| {
                let mut updated = None;
                let mut later = |at: SystemTime| {
                    updated = Some(updated.map_or(at, |u: SystemTime| u.max(at)));
                };
                let (pushed_version, pushed_nonce) = match status.pushed {
                    Some(p) => {
                        later(p.at);
                        (p.version, p.nonce)
                    }
                    None => (0, String::new()),
                };
                let acked_version = status.acked.map_or(0, |a| {
                    later(a.at);
                    a.version
                });
                // A NACK is shown until a later version is ACKed.
                let (nacked_version, nack_error, nack_details) = match status.last_nack {
                    Some(n) if n.version > acked_version => {
                        later(n.at);
                        (n.version, n.error, n.details)
                    }
                    _ => (0, String::new(), Vec::new()),
                };
                pb::AgentConfigStatus {
                    bridge_id: status.bridge_id,
                    pushed_version,
                    pushed_nonce,
                    acked_version,
                    nacked_version,
                    nack_error,
                    nack_details,
                    updated_at: updated.map(timestamp),
                }
            })
            .collect(),
    }
}
