//! The control plane's HTTP listener: `GET /metrics` in Prometheus text
//! format (the fleet's delivery counters summed over agents, per bridge,
//! route and binding; outbox depth; agents connected; and each agent's own
//! series from its latest snapshot, labelled `agent`: counters, outbox depth
//! and oldest age, lease held, session connected and reconnects) and
//! `GET /healthz`.
//!
//! The figures are rebuilt from the state store on every scrape, so every
//! replica reports the same fleet.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use ferry_shared::api::v1 as pb;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

use crate::services::metrics::{agents_connected, fleet_totals, snapshots};
use crate::state::StateStore;

/// Metric names and help texts, defined once. Counters get `_total` when
/// encoded.
mod names {
    pub const COUNTERS: [(&str, &str); 7] = [
        (
            "ferry_fleet_received",
            "Messages received, summed over agents.",
        ),
        (
            "ferry_fleet_sent",
            "Messages accepted by the destination, summed over agents.",
        ),
        (
            "ferry_fleet_dropped",
            "Messages dropped by policy, summed over agents.",
        ),
        (
            "ferry_fleet_filtered",
            "Messages discarded by a filter, summed over agents.",
        ),
        (
            "ferry_fleet_expired",
            "Messages expired before delivery, summed over agents.",
        ),
        (
            "ferry_fleet_dead_lettered",
            "Messages written to the DLQ, summed over agents.",
        ),
        (
            "ferry_fleet_in_flight",
            "Messages received and not yet settled, summed over agents.",
        ),
    ];
    pub const OUTBOX_DEPTH: (&str, &str) = (
        "ferry_fleet_outbox_depth",
        "Outbox records pending or claimed, summed over agents.",
    );
    pub const AGENTS: (&str, &str) = ("ferry_agents", "Agents that sent a metrics snapshot.");
    /// Per agent, from its latest snapshot.
    pub const AGENT_COUNTERS: [(&str, &str); 7] = [
        ("ferry_agent_received", "Messages received, on one agent."),
        (
            "ferry_agent_sent",
            "Messages accepted by the destination, on one agent.",
        ),
        (
            "ferry_agent_dropped",
            "Messages dropped by policy, on one agent.",
        ),
        (
            "ferry_agent_filtered",
            "Messages discarded by a filter, on one agent.",
        ),
        (
            "ferry_agent_expired",
            "Messages expired before delivery, on one agent.",
        ),
        (
            "ferry_agent_dead_lettered",
            "Messages written to the DLQ, on one agent.",
        ),
        (
            "ferry_agent_in_flight",
            "Messages received and not yet settled, on one agent.",
        ),
    ];
    pub const AGENT_OUTBOX_DEPTH: (&str, &str) = (
        "ferry_agent_outbox_depth",
        "Outbox records pending or claimed, on one agent.",
    );
    pub const AGENT_OLDEST_AGE: (&str, &str) = (
        "ferry_agent_outbox_oldest_pending_age_seconds",
        "Age of the oldest pending outbox record of a binding, on one agent.",
    );
    pub const AGENT_LEASE_HELD: (&str, &str) = (
        "ferry_agent_lease_held",
        "1 when the agent holds the route's partition lease.",
    );
    pub const AGENT_SESSION_CONNECTED: (&str, &str) = (
        "ferry_agent_session_connected",
        "1 while the agent's session is connected.",
    );
    pub const AGENT_SESSION_RECONNECTS: (&str, &str) = (
        "ferry_agent_session_reconnects",
        "Reconnections of the agent's session since the agent started.",
    );
    pub const AGENTS_CONNECTED: (&str, &str) =
        ("ferry_agents_connected", "Agents whose stream is open.");
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BindingLabels {
    bridge: String,
    route: String,
    binding: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AgentBindingLabels {
    agent: String,
    bridge: String,
    route: String,
    binding: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AgentRouteLabels {
    agent: String,
    bridge: String,
    route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AgentSessionLabels {
    agent: String,
    bridge: String,
    session: String,
}

/// Serves HTTP on `listener` (HTTPS with `tls`) until `shutdown` resolves.
/// `/metrics` and `/healthz` need no credential: they are for scrapers and
/// probes, and show figures, never configurations or messages.
pub async fn serve(
    listener: TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    store: Arc<dyn StateStore>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .with_state(store);
    ferry_shared::listener::serve(listener, tls, app, shutdown).await
}

async fn metrics(State(store): State<Arc<dyn StateStore>>) -> Response {
    match render(store.as_ref()).await {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(error) => (StatusCode::SERVICE_UNAVAILABLE, format!("{error}\n")).into_response(),
    }
}

/// The Prometheus text of the fleet's current figures.
pub async fn render(store: &dyn StateStore) -> anyhow::Result<String> {
    let snapshots = snapshots(store, "")
        .await
        .map_err(|s| anyhow::anyhow!("{}", s.message()))?;
    let connected = agents_connected(store)
        .await
        .map_err(|s| anyhow::anyhow!("{}", s.message()))?;
    Ok(encode_totals(
        &fleet_totals(&snapshots, connected),
        &snapshots,
    )?)
}

fn encode_totals(
    totals: &pb::GetTotalsResponse,
    snapshots: &[pb::MetricsSnapshot],
) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::default();
    register_agents(&mut registry, snapshots);
    let counters: Vec<Family<BindingLabels, Counter>> =
        counter_families(&mut registry, &names::COUNTERS);
    let depth = Family::<BindingLabels, Gauge>::default();
    registry.register(names::OUTBOX_DEPTH.0, names::OUTBOX_DEPTH.1, depth.clone());
    let agents = Gauge::<i64>::default();
    registry.register(names::AGENTS.0, names::AGENTS.1, agents.clone());
    let connected = Gauge::<i64>::default();
    registry.register(
        names::AGENTS_CONNECTED.0,
        names::AGENTS_CONNECTED.1,
        connected.clone(),
    );

    for binding in &totals.bindings {
        let labels = BindingLabels {
            bridge: binding.bridge_id.clone(),
            route: binding.route_id.clone(),
            binding: binding.binding_id.clone(),
        };
        let values = counter_values(binding.counters.unwrap_or_default());
        for (family, value) in counters.iter().zip(values) {
            family.get_or_create(&labels).inc_by(value);
        }
        depth
            .get_or_create(&labels)
            .set(i64::try_from(binding.outbox_depth).unwrap_or(i64::MAX));
    }
    agents.set(i64::from(totals.agents));
    connected.set(i64::from(totals.agents_connected));

    let mut text = String::new();
    encode(&mut text, &registry)?;
    Ok(text)
}

/// One counter family per `(name, help)`, registered, in the order of
/// [`counter_values`].
fn counter_families<L>(
    registry: &mut Registry,
    names: &[(&'static str, &'static str); 7],
) -> Vec<Family<L, Counter>>
where
    L: Clone
        + std::hash::Hash
        + Eq
        + prometheus_client::encoding::EncodeLabelSet
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    names
        .iter()
        .map(|(name, help)| {
            let family = Family::<L, Counter>::default();
            registry.register(*name, *help, family.clone());
            family
        })
        .collect()
}

/// The conservation counters in the order of `names::COUNTERS` and
/// `names::AGENT_COUNTERS`.
fn counter_values(c: pb::DeliveryCounters) -> [u64; 7] {
    [
        c.received,
        c.sent,
        c.dropped,
        c.filtered,
        c.expired,
        c.dead_lettered,
        c.in_flight,
    ]
}

/// Each agent's series, from its latest snapshot.
fn register_agents(registry: &mut Registry, snapshots: &[pb::MetricsSnapshot]) {
    let counters: Vec<Family<AgentBindingLabels, Counter>> =
        counter_families(registry, &names::AGENT_COUNTERS);
    let depth = Family::<AgentBindingLabels, Gauge>::default();
    let (name, help) = names::AGENT_OUTBOX_DEPTH;
    registry.register(name, help, depth.clone());
    let oldest = Family::<AgentBindingLabels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    let (name, help) = names::AGENT_OLDEST_AGE;
    registry.register(name, help, oldest.clone());
    let lease = Family::<AgentRouteLabels, Gauge>::default();
    let (name, help) = names::AGENT_LEASE_HELD;
    registry.register(name, help, lease.clone());
    let connected = Family::<AgentSessionLabels, Gauge>::default();
    let (name, help) = names::AGENT_SESSION_CONNECTED;
    registry.register(name, help, connected.clone());
    let reconnects = Family::<AgentSessionLabels, Counter>::default();
    let (name, help) = names::AGENT_SESSION_RECONNECTS;
    registry.register(name, help, reconnects.clone());

    for snapshot in snapshots {
        let agent = &snapshot.agent_id;
        for route in &snapshot.routes {
            let route_labels = AgentRouteLabels {
                agent: agent.clone(),
                bridge: route.bridge_id.clone(),
                route: route.route_id.clone(),
            };
            lease
                .get_or_create(&route_labels)
                .set(i64::from(route.lease_held));
            for binding in &route.bindings {
                let labels = AgentBindingLabels {
                    agent: agent.clone(),
                    bridge: route.bridge_id.clone(),
                    route: route.route_id.clone(),
                    binding: binding.binding_id.clone(),
                };
                let values = counter_values(binding.counters.unwrap_or_default());
                for (family, value) in counters.iter().zip(values) {
                    family.get_or_create(&labels).inc_by(value);
                }
                depth
                    .get_or_create(&labels)
                    .set(i64::try_from(binding.outbox_depth).unwrap_or(i64::MAX));
                // Milliseconds to seconds; exact enough for an age.
                #[allow(clippy::cast_precision_loss)]
                let age = binding.oldest_pending_age_ms as f64 / 1000.0;
                oldest.get_or_create(&labels).set(age);
            }
        }
        for session in &snapshot.sessions {
            let labels = AgentSessionLabels {
                agent: agent.clone(),
                bridge: session.bridge_id.clone(),
                session: session.session_id.clone(),
            };
            connected
                .get_or_create(&labels)
                .set(i64::from(session.connected));
            reconnects.get_or_create(&labels).inc_by(session.reconnects);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn encodes_counters_per_binding() {
        let totals = pb::GetTotalsResponse {
            bindings: vec![pb::BindingTotals {
                bridge_id: "b".into(),
                route_id: "r".into(),
                binding_id: "x".into(),
                counters: Some(pb::DeliveryCounters {
                    received: 5,
                    sent: 4,
                    in_flight: 1,
                    ..Default::default()
                }),
                outbox_depth: 1,
            }],
            fleet: None,
            agents: 2,
            agents_connected: 1,
        };
        let snapshot = pb::MetricsSnapshot {
            agent_id: "a1".into(),
            routes: vec![pb::RouteMetrics {
                bridge_id: "b".into(),
                route_id: "r".into(),
                lease_held: true,
                bindings: vec![pb::BindingMetrics {
                    binding_id: "x".into(),
                    counters: totals.bindings[0].counters,
                    outbox_depth: 1,
                    oldest_pending_age_ms: 1500,
                }],
                ..Default::default()
            }],
            sessions: vec![pb::SessionMetrics {
                bridge_id: "b".into(),
                session_id: "conn".into(),
                connected: true,
                reconnects: 2,
            }],
            ..Default::default()
        };
        let text = encode_totals(&totals, &[snapshot]).unwrap();
        for line in [
            r#"ferry_agent_sent_total{agent="a1",bridge="b",route="r",binding="x"} 4"#,
            r#"ferry_agent_outbox_oldest_pending_age_seconds{agent="a1",bridge="b",route="r",binding="x"} 1.5"#,
            r#"ferry_agent_lease_held{agent="a1",bridge="b",route="r"} 1"#,
            r#"ferry_agent_session_reconnects_total{agent="a1",bridge="b",session="conn"} 2"#,
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        assert!(
            text.contains(r#"ferry_fleet_received_total{bridge="b",route="r",binding="x"} 5"#),
            "{text}"
        );
        assert!(text.contains("ferry_agents_connected 1"), "{text}");
    }
}
