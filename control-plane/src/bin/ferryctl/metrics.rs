//! Fleet counters (`MetricsService`): `ferryctl metrics`, totals per route
//! binding or one row per agent and binding; and the binding row that
//! `describe agent` shows too.

use ferry_shared::api::v1 as pb;
use ferry_shared::auth::client::AuthChannel;
use pb::metrics_service_client::MetricsServiceClient;
use serde::Serialize;

use crate::output::{self, Format, Row};

/// `ferryctl metrics`: fleet totals per route binding, or (`by_agent`) one
/// row per agent and binding, from the agents' latest snapshots.
pub async fn show(
    channel: AuthChannel,
    out: Format,
    bridge: Option<String>,
    by_agent: bool,
) -> anyhow::Result<()> {
    let mut client = MetricsServiceClient::new(channel);
    let bridge_id = bridge.unwrap_or_default();
    if by_agent {
        let snapshots = client
            .list_metrics(pb::ListMetricsRequest { bridge_id })
            .await?
            .into_inner()
            .snapshots;
        let rows: Vec<AgentBindingView> = snapshots
            .into_iter()
            .flat_map(|s| {
                let agent = s.agent_id;
                binding_rows(s.routes)
                    .into_iter()
                    .map(move |figures| AgentBindingView {
                        agent_id: agent.clone(),
                        figures,
                    })
            })
            .collect();
        return output::list(out, &rows);
    }
    let totals = client
        .get_totals(pb::GetTotalsRequest { bridge_id })
        .await?
        .into_inner();
    let rows: Vec<TotalsView> = totals
        .bindings
        .into_iter()
        .map(|b| {
            TotalsView::new(
                b.bridge_id,
                b.route_id,
                b.binding_id,
                b.counters.unwrap_or_default(),
                b.outbox_depth,
            )
        })
        .collect();
    output::list(out, &rows)?;
    if out == Format::Table {
        outln!(
            "agents: {} ({} connected)",
            totals.agents,
            totals.agents_connected
        )?;
    }
    Ok(())
}

/// One row per route binding of one agent's snapshot.
pub fn binding_rows(routes: Vec<pb::RouteMetrics>) -> Vec<TotalsView> {
    routes
        .into_iter()
        .flat_map(|route| {
            route.bindings.into_iter().map(move |b| {
                TotalsView::new(
                    route.bridge_id.clone(),
                    route.route_id.clone(),
                    b.binding_id,
                    b.counters.unwrap_or_default(),
                    b.outbox_depth,
                )
            })
        })
        .collect()
}

/// Summed counters of one route binding.
#[derive(Debug, Serialize)]
pub struct TotalsView {
    pub bridge_id: String,
    pub route_id: String,
    pub binding_id: String,
    pub received: u64,
    pub sent: u64,
    pub dropped: u64,
    pub filtered: u64,
    pub expired: u64,
    pub dead_lettered: u64,
    pub in_flight: u64,
    pub outbox_depth: u64,
}

impl TotalsView {
    fn new(
        bridge_id: String,
        route_id: String,
        binding_id: String,
        c: pb::DeliveryCounters,
        outbox_depth: u64,
    ) -> Self {
        TotalsView {
            bridge_id,
            route_id,
            binding_id,
            received: c.received,
            sent: c.sent,
            dropped: c.dropped,
            filtered: c.filtered,
            expired: c.expired,
            dead_lettered: c.dead_lettered,
            in_flight: c.in_flight,
            outbox_depth,
        }
    }
}

impl Row for TotalsView {
    const HEADERS: &'static [&'static str] = &[
        "BRIDGE",
        "ROUTE",
        "BINDING",
        "RECEIVED",
        "SENT",
        "DROPPED",
        "FILTERED",
        "EXPIRED",
        "DLQ",
        "IN-FLIGHT",
        "DEPTH",
    ];
    fn cells(&self) -> Vec<String> {
        vec![
            self.bridge_id.clone(),
            self.route_id.clone(),
            self.binding_id.clone(),
            self.received.to_string(),
            self.sent.to_string(),
            self.dropped.to_string(),
            self.filtered.to_string(),
            self.expired.to_string(),
            self.dead_lettered.to_string(),
            self.in_flight.to_string(),
            self.outbox_depth.to_string(),
        ]
    }
}

/// One binding's figures on one agent (`ferryctl metrics --by-agent`).
#[derive(Debug, Serialize)]
struct AgentBindingView {
    agent_id: String,
    #[serde(flatten)]
    figures: TotalsView,
}

impl Row for AgentBindingView {
    const HEADERS: &'static [&'static str] = &[
        "AGENT",
        "BRIDGE",
        "ROUTE",
        "BINDING",
        "RECEIVED",
        "SENT",
        "DROPPED",
        "FILTERED",
        "EXPIRED",
        "DLQ",
        "IN-FLIGHT",
        "DEPTH",
    ];
    fn cells(&self) -> Vec<String> {
        let mut cells = vec![self.agent_id.clone()];
        cells.extend(self.figures.cells());
        cells
    }
}
