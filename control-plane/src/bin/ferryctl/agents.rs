//! Agents (`AgentService`, with their latest counters from `MetricsService`):
//! get agents (once or `--watch`), describe agent; and how each is shown.

use std::collections::{BTreeMap, HashMap};

use anyhow::Context;
use ferry_shared::api::v1 as pb;
use ferry_shared::auth::client::AuthChannel;
use pb::agent_service_client::AgentServiceClient;
use pb::metrics_service_client::MetricsServiceClient;
use serde::Serialize;

use crate::metrics::{self, TotalsView};
use crate::output::{self, Format, Row, labels, timestamp};
use crate::paging::all_pages;

/// `ferryctl get agents`: every agent with its latest snapshot, then (tables)
/// the fleet's totals.
pub async fn list(channel: AuthChannel, out: Format) -> anyhow::Result<()> {
    let client = AgentServiceClient::new(channel.clone());
    let agents = all_pages(|page_token| {
        let mut client = client.clone();
        async move {
            client
                .list_agents(pb::ListAgentsRequest {
                    page_size: 0,
                    page_token,
                })
                .await
        }
    })
    .await?;
    let mut metrics = MetricsServiceClient::new(channel);
    let mut snapshots: HashMap<String, pb::MetricsSnapshot> = metrics
        .list_metrics(pb::ListMetricsRequest::default())
        .await?
        .into_inner()
        .snapshots
        .into_iter()
        .map(|s| (s.agent_id.clone(), s))
        .collect();
    let rows: Vec<AgentView> = agents
        .into_iter()
        .map(|a| {
            let snapshot = snapshots.remove(&a.agent_id);
            AgentView::with_metrics(a, snapshot)
        })
        .collect();
    output::list(out, &rows)?;
    if out == Format::Table {
        let totals = metrics
            .get_totals(pb::GetTotalsRequest::default())
            .await?
            .into_inner();
        let f = totals.fleet.unwrap_or_default();
        let depth: u64 = totals.bindings.iter().map(|b| b.outbox_depth).sum();
        outln!(
            "fleet: {} agents ({} connected), received {}, sent {}, dlq {}, in flight {}, depth {}",
            totals.agents,
            totals.agents_connected,
            f.received,
            f.sent,
            f.dead_lettered,
            f.in_flight,
            depth
        )?;
    }
    Ok(())
}

/// `ferryctl get agents --watch`: [`list`] every `seconds` until Ctrl-C;
/// clears the screen first when stdout is a terminal and the output a table
/// (a pipe gets each refresh after the previous one).
pub async fn watch(channel: AuthChannel, out: Format, seconds: u64) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    let clear = out == Format::Table && std::io::stdout().is_terminal();
    let mut ticker = tokio::time::interval(std::time::Duration::from_secs(seconds));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            interrupted = tokio::signal::ctrl_c() => return Ok(interrupted?),
            _ = ticker.tick() => {}
        }
        if clear {
            out!("\x1b[2J\x1b[H")?;
        }
        list(channel.clone(), out).await?;
        if !clear {
            outln!("")?;
        }
    }
}

/// `ferryctl describe agent`: one agent, the status of each configuration
/// pushed to it, and its latest snapshot when it sent one.
pub async fn describe(channel: AuthChannel, out: Format, agent_id: String) -> anyhow::Result<()> {
    let agent = AgentServiceClient::new(channel.clone())
        .get_agent(pb::GetAgentRequest { agent_id })
        .await?
        .into_inner()
        .agent
        .context("the server returned no agent")?;
    let snapshot = match MetricsServiceClient::new(channel)
        .get_agent_metrics(pb::GetAgentMetricsRequest {
            agent_id: agent.agent_id.clone(),
        })
        .await
    {
        Ok(response) => response.into_inner().snapshot,
        Err(status) if status.code() == tonic::Code::NotFound => None,
        Err(status) => return Err(status.into()),
    };
    let view = AgentView::with_metrics(agent, snapshot);
    output::object(out, &view, AgentView::pairs)
}

/// One agent.
#[derive(Debug, Serialize)]
struct AgentView {
    agent_id: String,
    connected: bool,
    labels: BTreeMap<String, String>,
    build_version: String,
    capabilities: Vec<String>,
    connected_at: String,
    last_seen_at: String,
    disconnected_at: String,
    configs: Vec<AgentConfigView>,
    /// From its latest metrics snapshot; `None` before its first one.
    metrics: Option<AgentMetricsView>,
}

/// One agent's latest metrics snapshot, summed over its bindings, with its
/// per-binding rows and sessions.
#[derive(Debug, Serialize)]
struct AgentMetricsView {
    captured_at: String,
    received: u64,
    sent: u64,
    dropped: u64,
    filtered: u64,
    expired: u64,
    dead_lettered: u64,
    in_flight: u64,
    outbox_depth: u64,
    bindings: Vec<TotalsView>,
    /// `bridge/route` of every route whose lease this agent holds.
    leases_held: Vec<String>,
    sessions: Vec<SessionView>,
}

/// One session of one agent.
#[derive(Debug, Serialize)]
struct SessionView {
    bridge_id: String,
    session_id: String,
    connected: bool,
    reconnects: u64,
}

impl From<pb::MetricsSnapshot> for AgentMetricsView {
    fn from(s: pb::MetricsSnapshot) -> Self {
        let leases_held = s
            .routes
            .iter()
            .filter(|route| route.lease_held)
            .map(|route| format!("{}/{}", route.bridge_id, route.route_id))
            .collect();
        let bindings = metrics::binding_rows(s.routes);
        let sum = |figure: fn(&TotalsView) -> u64| bindings.iter().map(figure).sum();
        AgentMetricsView {
            captured_at: timestamp(s.captured_at.as_ref()),
            received: sum(|b| b.received),
            sent: sum(|b| b.sent),
            dropped: sum(|b| b.dropped),
            filtered: sum(|b| b.filtered),
            expired: sum(|b| b.expired),
            dead_lettered: sum(|b| b.dead_lettered),
            in_flight: sum(|b| b.in_flight),
            outbox_depth: sum(|b| b.outbox_depth),
            leases_held,
            sessions: s
                .sessions
                .into_iter()
                .map(|s| SessionView {
                    bridge_id: s.bridge_id,
                    session_id: s.session_id,
                    connected: s.connected,
                    reconnects: s.reconnects,
                })
                .collect(),
            bindings,
        }
    }
}

impl AgentMetricsView {
    /// Its lines in `ferryctl describe agent`.
    fn pairs(&self) -> Vec<(&'static str, String)> {
        let sessions = output::table(
            &["BRIDGE", "SESSION", "CONNECTED", "RECONNECTS"],
            self.sessions.iter().map(|s| {
                vec![
                    s.bridge_id.clone(),
                    s.session_id.clone(),
                    s.connected.to_string(),
                    s.reconnects.to_string(),
                ]
            }),
        );
        vec![
            ("metrics at", self.captured_at.clone()),
            (
                "bindings",
                output::table(TotalsView::HEADERS, self.bindings.iter().map(Row::cells)),
            ),
            ("leases held", self.leases_held.join(",")),
            ("sessions", sessions),
        ]
    }
}

/// Where one configuration stands on one agent.
#[derive(Debug, Serialize)]
struct AgentConfigView {
    bridge_id: String,
    pushed_version: u64,
    acked_version: u64,
    nacked_version: u64,
    nack_error: String,
    nack_details: Vec<String>,
    updated_at: String,
}

impl From<pb::AgentInfo> for AgentView {
    fn from(a: pb::AgentInfo) -> Self {
        AgentView {
            agent_id: a.agent_id,
            connected: a.connected,
            labels: a.labels.into_iter().collect(),
            build_version: a.build_version,
            capabilities: a.capabilities,
            connected_at: timestamp(a.connected_at.as_ref()),
            last_seen_at: timestamp(a.last_seen_at.as_ref()),
            disconnected_at: timestamp(a.disconnected_at.as_ref()),
            metrics: None,
            configs: a
                .configs
                .into_iter()
                .map(|c| AgentConfigView {
                    bridge_id: c.bridge_id,
                    pushed_version: c.pushed_version,
                    acked_version: c.acked_version,
                    nacked_version: c.nacked_version,
                    nack_error: c.nack_error,
                    nack_details: c.nack_details,
                    updated_at: timestamp(c.updated_at.as_ref()),
                })
                .collect(),
        }
    }
}

impl AgentView {
    /// The agent with its latest metrics snapshot, if any.
    fn with_metrics(agent: pb::AgentInfo, snapshot: Option<pb::MetricsSnapshot>) -> Self {
        let mut view = AgentView::from(agent);
        view.metrics = snapshot.map(AgentMetricsView::from);
        view
    }

    fn pairs(&self) -> Vec<(&'static str, String)> {
        let configs = output::table(
            &["BRIDGE", "PUSHED", "RUNNING", "NACKED", "ERROR"],
            self.configs.iter().map(|c| {
                let mut error = c.nack_error.clone();
                for detail in &c.nack_details {
                    error.push_str("; ");
                    error.push_str(detail);
                }
                vec![
                    c.bridge_id.clone(),
                    c.pushed_version.to_string(),
                    c.acked_version.to_string(),
                    c.nacked_version.to_string(),
                    error,
                ]
            }),
        );
        let mut pairs = vec![
            ("agent", self.agent_id.clone()),
            ("connected", self.connected.to_string()),
            ("labels", labels(&self.labels)),
            ("build", self.build_version.clone()),
            ("capabilities", self.capabilities.join(",")),
            ("connected at", self.connected_at.clone()),
            ("last seen", self.last_seen_at.clone()),
            ("disconnected at", self.disconnected_at.clone()),
            ("configs", configs),
        ];
        match &self.metrics {
            Some(metrics) => pairs.extend(metrics.pairs()),
            None => pairs.push(("metrics", "(no snapshot yet)".to_owned())),
        }
        pairs
    }
}

impl Row for AgentView {
    const HEADERS: &'static [&'static str] = &[
        "AGENT",
        "CONNECTED",
        "LABELS",
        "CONFIGS",
        "RECEIVED",
        "SENT",
        "DLQ",
        "IN-FLIGHT",
        "DEPTH",
        "LAST SEEN",
    ];
    fn cells(&self) -> Vec<String> {
        let configs = self
            .configs
            .iter()
            .map(|c| {
                if c.nacked_version > 0 {
                    format!(
                        "{}@{} (nack {})",
                        c.bridge_id, c.acked_version, c.nacked_version
                    )
                } else {
                    format!("{}@{}", c.bridge_id, c.acked_version)
                }
            })
            .collect::<Vec<_>>()
            .join(",");
        let figures = match &self.metrics {
            Some(m) => [
                m.received,
                m.sent,
                m.dead_lettered,
                m.in_flight,
                m.outbox_depth,
            ]
            .map(|n| n.to_string()),
            None => std::array::from_fn(|_| "-".to_owned()),
        };
        let mut cells = vec![
            self.agent_id.clone(),
            self.connected.to_string(),
            labels(&self.labels),
            configs,
        ];
        cells.extend(figures);
        cells.push(self.last_seen_at.clone());
        cells
    }
}
