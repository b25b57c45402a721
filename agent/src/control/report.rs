//! The metrics snapshot a managed agent sends up its stream every
//! `--metrics-interval`: the conservation counters, outbox depth and oldest
//! pending age of every binding, the lease state of every route and the
//! state of every session, of the bridges it runs now.
//!
//! Invariants:
//! - a snapshot holds only bridges that run now (a withdrawn bridge's
//!   figures stay in the agent's own `/metrics`, not in the fleet's);
//! - counters are totals since the agent process started (`started_at`
//!   tells a restart apart), read from the same [`Metrics`] as the agent's
//!   `/metrics`, so both show the same figures;
//! - a route appears once, with every binding the agent counts for it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use ferry_shared::api::v1 as pb;
use tokio::sync::watch;

use super::bridges::BridgeHandle;
use crate::metrics::Metrics;

/// Takes the snapshots of one agent.
#[derive(Clone, Debug)]
pub struct Reporter {
    /// How often a snapshot is sent.
    pub interval: Duration,
    agent_id: String,
    started_at: SystemTime,
    metrics: Arc<Metrics>,
    bridges: watch::Receiver<BTreeMap<String, BridgeHandle>>,
}

impl Reporter {
    /// Snapshots of `metrics` for the bridges `bridges` lists, every
    /// `interval`; the agent process started now.
    pub fn new(
        agent_id: String,
        interval: Duration,
        metrics: Arc<Metrics>,
        bridges: watch::Receiver<BTreeMap<String, BridgeHandle>>,
    ) -> Self {
        Self {
            interval,
            agent_id,
            started_at: SystemTime::now(),
            metrics,
            bridges,
        }
    }

    /// The snapshot now.
    pub fn snapshot(&self) -> pb::MetricsSnapshot {
        let running = self.bridges.borrow().clone();
        snapshot(&self.agent_id, self.started_at, &self.metrics, &running)
    }
}

/// The snapshot of `metrics` for the bridges in `running`.
pub fn snapshot(
    agent_id: &str,
    started_at: SystemTime,
    metrics: &Metrics,
    running: &BTreeMap<String, BridgeHandle>,
) -> pb::MetricsSnapshot {
    let mut routes: BTreeMap<(String, String), pb::RouteMetrics> = BTreeMap::new();
    for (labels, counts) in metrics.snapshot() {
        let Some(r) = route(&mut routes, running, &labels.bridge, &labels.route) else {
            continue;
        };
        let oldest = counts.oldest_pending_age.unwrap_or_default().as_millis();
        r.bindings.push(pb::BindingMetrics {
            binding_id: labels.binding,
            counters: Some(pb::DeliveryCounters {
                received: counts.received,
                sent: counts.sent,
                dropped: counts.dropped,
                filtered: counts.filtered,
                expired: counts.expired,
                dead_lettered: counts.dead_lettered,
                in_flight: counts.in_flight,
            }),
            outbox_depth: counts.outbox_depth,
            oldest_pending_age_ms: u64::try_from(oldest).unwrap_or(u64::MAX),
        });
    }
    for (labels, held) in metrics.lease_states() {
        if let Some(r) = route(&mut routes, running, &labels.bridge, &labels.route) {
            r.lease_held = held;
        }
    }
    let sessions = metrics
        .session_states()
        .into_iter()
        .filter(|(labels, _)| running.contains_key(&labels.bridge))
        .map(|(labels, state)| pb::SessionMetrics {
            bridge_id: labels.bridge,
            session_id: labels.session,
            connected: state.connected,
            reconnects: state.reconnects,
        })
        .collect();
    pb::MetricsSnapshot {
        agent_id: agent_id.to_owned(),
        captured_at: Some(SystemTime::now().into()),
        started_at: Some(started_at.into()),
        routes: routes.into_values().collect(),
        sessions,
    }
}

/// The entry of route `id` of `bridge`, created on first use; `None` when
/// the bridge does not run here.
fn route<'a>(
    routes: &'a mut BTreeMap<(String, String), pb::RouteMetrics>,
    running: &BTreeMap<String, BridgeHandle>,
    bridge: &str,
    id: &str,
) -> Option<&'a mut pb::RouteMetrics> {
    let handle = running.get(bridge)?;
    let key = (bridge.to_owned(), id.to_owned());
    Some(routes.entry(key).or_insert_with(|| {
        pb::RouteMetrics {
            bridge_id: bridge.to_owned(),
            route_id: id.to_owned(),
            delivery_mode: handle
                .delivery_modes
                .get(id)
                .copied()
                .unwrap_or_default()
                .to_owned(),
            lease_held: false,
            bindings: Vec::new(),
        }
    }))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::metrics::Terminal;
    use crate::routes::Redrive;

    fn handle(bridge: &str) -> BridgeHandle {
        BridgeHandle {
            version: 1,
            redrive: Arc::new(Redrive::new(bridge.to_owned())),
            delivery_modes: BTreeMap::from([("main".to_owned(), "shared_outbox")]),
        }
    }

    #[test]
    fn a_snapshot_holds_the_running_bridges_only() {
        let metrics = Metrics::new();
        let binding = metrics.binding("b", "main", "to-out");
        binding.received(3);
        binding.finished(Terminal::Sent, 2, None);
        metrics.binding("b", "main", "to-log").received(1);
        metrics.route("b", "main").set_lease_held(true);
        metrics.session("b", "conn").set_connected(true, false);
        metrics.binding("gone", "main", "x").received(5);
        metrics.session("gone", "conn").set_connected(true, false);
        let running = BTreeMap::from([("b".to_owned(), handle("b"))]);

        let s = snapshot("a1", SystemTime::UNIX_EPOCH, &metrics, &running);
        assert_eq!(s.agent_id, "a1");
        assert_eq!(s.routes.len(), 1);
        let route = &s.routes[0];
        assert_eq!(
            (route.bridge_id.as_str(), route.route_id.as_str()),
            ("b", "main")
        );
        assert_eq!(route.delivery_mode, "shared_outbox");
        assert!(route.lease_held);
        let bindings: Vec<_> = route
            .bindings
            .iter()
            .map(|b| b.binding_id.as_str())
            .collect();
        assert_eq!(bindings, ["to-log", "to-out"]);
        let out = route.bindings[1].counters.unwrap_or_default();
        assert_eq!((out.received, out.sent, out.in_flight), (3, 2, 1));
        assert_eq!(s.sessions.len(), 1);
        assert!(s.sessions[0].connected);
        assert_eq!(s.sessions[0].bridge_id, "b");
    }
}
