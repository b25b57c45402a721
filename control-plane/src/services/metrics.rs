//! MetricsService: the latest snapshot of every agent (as stored by the
//! agent streams) and their fleet totals. [`fleet_totals`] is shared with the
//! Prometheus endpoint (`crate::http`).

use std::collections::BTreeMap;

use ferry_shared::api::v1 as pb;
use pb::metrics_service_server::MetricsService;
use prost::Message;
use tonic::{Request, Response, Status};

use super::Context;
use super::status::{require, state_status};
use crate::state::{MetricsRecord, StateStore};

/// The MetricsService implementation.
#[derive(Clone)]
pub struct MetricsServiceImpl {
    ctx: Context,
}

impl MetricsServiceImpl {
    /// The service over `ctx`.
    pub fn new(ctx: Context) -> Self {
        Self { ctx }
    }
}

fn decode(record: MetricsRecord) -> Result<pb::MetricsSnapshot, Status> {
    pb::MetricsSnapshot::decode(record.snapshot.as_slice()).map_err(|e| {
        Status::data_loss(format!(
            "metrics of agent {:?} do not decode: {e}",
            record.agent_id
        ))
    })
}

/// Keeps only the routes (and sessions) of `bridge_id`; everything when empty.
fn only_bridge(mut snapshot: pb::MetricsSnapshot, bridge_id: &str) -> pb::MetricsSnapshot {
    if !bridge_id.is_empty() {
        snapshot.routes.retain(|r| r.bridge_id == bridge_id);
        snapshot.sessions.retain(|s| s.bridge_id == bridge_id);
    }
    snapshot
}

/// The latest snapshot of every agent, optionally of one bridge only.
pub async fn snapshots(
    store: &dyn StateStore,
    bridge_id: &str,
) -> Result<Vec<pb::MetricsSnapshot>, Status> {
    let records = store.list_metrics().await.map_err(state_status)?;
    records
        .into_iter()
        .map(|r| decode(r).map(|s| only_bridge(s, bridge_id)))
        .collect()
}

fn add(into: &mut pb::DeliveryCounters, counters: &pb::DeliveryCounters) {
    into.received += counters.received;
    into.sent += counters.sent;
    into.dropped += counters.dropped;
    into.filtered += counters.filtered;
    into.expired += counters.expired;
    into.dead_lettered += counters.dead_lettered;
    into.in_flight += counters.in_flight;
}

/// Sums `snapshots` per route binding and over everything.
pub fn fleet_totals(
    snapshots: &[pb::MetricsSnapshot],
    agents_connected: u32,
) -> pb::GetTotalsResponse {
    let mut bindings: BTreeMap<(String, String, String), pb::BindingTotals> = BTreeMap::new();
    let mut fleet = pb::DeliveryCounters::default();
    for snapshot in snapshots {
        for route in &snapshot.routes {
            for binding in &route.bindings {
                let counters = binding.counters.unwrap_or_default();
                let key = (
                    route.bridge_id.clone(),
                    route.route_id.clone(),
                    binding.binding_id.clone(),
                );
                let totals = bindings.entry(key).or_insert_with(|| pb::BindingTotals {
                    bridge_id: route.bridge_id.clone(),
                    route_id: route.route_id.clone(),
                    binding_id: binding.binding_id.clone(),
                    counters: Some(pb::DeliveryCounters::default()),
                    outbox_depth: 0,
                });
                if let Some(sum) = totals.counters.as_mut() {
                    add(sum, &counters);
                }
                totals.outbox_depth += binding.outbox_depth;
                add(&mut fleet, &counters);
            }
        }
    }
    pb::GetTotalsResponse {
        bindings: bindings.into_values().collect(),
        fleet: Some(fleet),
        agents: u32::try_from(snapshots.len()).unwrap_or(u32::MAX),
        agents_connected,
    }
}

/// Agents whose stream is open, on any replica (from the state store).
pub async fn agents_connected(store: &dyn StateStore) -> Result<u32, Status> {
    let agents = store.list_agents().await.map_err(state_status)?;
    Ok(u32::try_from(agents.iter().filter(|a| a.connected).count()).unwrap_or(u32::MAX))
}

#[tonic::async_trait]
impl MetricsService for MetricsServiceImpl {
    async fn get_agent_metrics(
        &self,
        request: Request<pb::GetAgentMetricsRequest>,
    ) -> Result<Response<pb::GetAgentMetricsResponse>, Status> {
        let request = request.into_inner();
        require("agent_id", &request.agent_id)?;
        let record = self
            .ctx
            .store
            .get_metrics(&request.agent_id)
            .await
            .map_err(state_status)?;
        Ok(Response::new(pb::GetAgentMetricsResponse {
            snapshot: Some(decode(record)?),
        }))
    }

    async fn list_metrics(
        &self,
        request: Request<pb::ListMetricsRequest>,
    ) -> Result<Response<pb::ListMetricsResponse>, Status> {
        let bridge_id = request.into_inner().bridge_id;
        let snapshots = snapshots(self.ctx.store.as_ref(), &bridge_id).await?;
        Ok(Response::new(pb::ListMetricsResponse { snapshots }))
    }

    async fn get_totals(
        &self,
        request: Request<pb::GetTotalsRequest>,
    ) -> Result<Response<pb::GetTotalsResponse>, Status> {
        let bridge_id = request.into_inner().bridge_id;
        let mut snapshots = snapshots(self.ctx.store.as_ref(), &bridge_id).await?;
        if !bridge_id.is_empty() {
            snapshots.retain(|s| !s.routes.is_empty());
        }
        let connected = agents_connected(self.ctx.store.as_ref()).await?;
        Ok(Response::new(fleet_totals(&snapshots, connected)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(agent: &str, received: u64) -> pb::MetricsSnapshot {
        pb::MetricsSnapshot {
            agent_id: agent.into(),
            routes: vec![pb::RouteMetrics {
                bridge_id: "b".into(),
                route_id: "r".into(),
                bindings: vec![pb::BindingMetrics {
                    binding_id: "x".into(),
                    counters: Some(pb::DeliveryCounters {
                        received,
                        sent: received,
                        ..Default::default()
                    }),
                    outbox_depth: 1,
                    oldest_pending_age_ms: 0,
                }],
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn totals_sum_per_binding_and_fleet() {
        let totals = fleet_totals(&[snapshot("a1", 3), snapshot("a2", 4)], 1);
        assert_eq!(totals.bindings.len(), 1);
        assert_eq!(totals.bindings[0].counters.unwrap_or_default().received, 7);
        assert_eq!(totals.bindings[0].outbox_depth, 2);
        assert_eq!(totals.fleet.unwrap_or_default().sent, 7);
        assert_eq!((totals.agents, totals.agents_connected), (2, 1));
    }
}
