//! What ferryctl shows of each API message: plain serializable structs, so
//! tables, JSON and YAML all print the same fields.

use std::collections::BTreeMap;

use ferry_shared::api::v1 as pb;
use serde::Serialize;

use crate::output::{Row, labels, timestamp};

/// One route of a configuration document.
#[derive(Debug, Serialize)]
pub struct RouteView {
    pub id: String,
    pub receiver: String,
    pub delivery_mode: String,
    pub dispatch_mode: String,
    pub bindings: Vec<String>,
}

impl RouteView {
    /// The routes of a stored document. `${VAR:-default}` takes its default,
    /// as when the control plane validated it.
    pub fn from_document(yaml: &str) -> anyhow::Result<Vec<Self>> {
        let no_variables = |_: &str| None;
        let config = ferry_shared::config::load_str(yaml, &no_variables)
            .map_err(|e| anyhow::anyhow!("the stored configuration does not parse: {e}"))?;
        Ok(config
            .routes
            .into_iter()
            .map(|route| RouteView {
                id: route.id,
                receiver: route.receiver_id,
                delivery_mode: route.delivery_mode.as_str().to_owned(),
                dispatch_mode: match route.dispatch_mode {
                    ferry_shared::config::DispatchMode::Single => "single",
                    ferry_shared::config::DispatchMode::FanOut => "fan_out",
                }
                .to_owned(),
                bindings: route.bindings,
            })
            .collect())
    }
}

impl Row for RouteView {
    const HEADERS: &'static [&'static str] =
        &["ROUTE", "RECEIVER", "DELIVERY", "DISPATCH", "BINDINGS"];
    fn cells(&self) -> Vec<String> {
        vec![
            self.id.clone(),
            self.receiver.clone(),
            self.delivery_mode.clone(),
            self.dispatch_mode.clone(),
            self.bindings.join(","),
        ]
    }
}

/// One configuration version.
#[derive(Debug, Serialize)]
pub struct ConfigView {
    pub bridge_id: String,
    pub version: u64,
    pub selector: BTreeMap<String, String>,
    pub created_at: String,
    pub change_note: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub yaml: String,
}

impl ConfigView {
    pub fn new(config: pb::BridgeConfig, with_yaml: bool) -> Self {
        ConfigView {
            bridge_id: config.bridge_id,
            version: config.version,
            selector: config
                .selector
                .map(|s| s.match_labels.into_iter().collect())
                .unwrap_or_default(),
            created_at: timestamp(config.created_at.as_ref()),
            change_note: config.change_note,
            yaml: if with_yaml {
                config.yaml
            } else {
                String::new()
            },
        }
    }

    pub fn pairs(&self) -> Vec<(&'static str, String)> {
        vec![
            ("bridge", self.bridge_id.clone()),
            ("version", self.version.to_string()),
            ("selector", labels(&self.selector)),
            ("created", self.created_at.clone()),
            ("note", self.change_note.clone()),
            ("document", self.yaml.clone()),
        ]
    }
}

impl Row for ConfigView {
    const HEADERS: &'static [&'static str] = &["BRIDGE", "VERSION", "SELECTOR", "CREATED"];
    fn cells(&self) -> Vec<String> {
        vec![
            self.bridge_id.clone(),
            self.version.to_string(),
            labels(&self.selector),
            self.created_at.clone(),
        ]
    }
}

/// One entry of a configuration's history.
#[derive(Debug, Serialize)]
pub struct VersionView {
    pub version: u64,
    pub created_at: String,
    pub digest: String,
    pub change_note: String,
}

impl From<pb::ConfigVersion> for VersionView {
    fn from(v: pb::ConfigVersion) -> Self {
        VersionView {
            version: v.version,
            created_at: timestamp(v.created_at.as_ref()),
            digest: v.digest,
            change_note: v.change_note,
        }
    }
}

impl Row for VersionView {
    const HEADERS: &'static [&'static str] = &["VERSION", "CREATED", "DIGEST", "NOTE"];
    fn cells(&self) -> Vec<String> {
        vec![
            self.version.to_string(),
            self.created_at.clone(),
            self.digest.chars().take(12).collect(),
            self.change_note.clone(),
        ]
    }
}

/// One agent.
#[derive(Debug, Serialize)]
pub struct AgentView {
    pub agent_id: String,
    pub connected: bool,
    pub labels: BTreeMap<String, String>,
    pub build_version: String,
    pub capabilities: Vec<String>,
    pub connected_at: String,
    pub last_seen_at: String,
    pub disconnected_at: String,
    pub configs: Vec<AgentConfigView>,
    /// From its latest metrics snapshot; `None` before its first one.
    pub metrics: Option<AgentMetricsView>,
}

/// One agent's latest metrics snapshot, summed over its bindings, with its
/// per-binding rows and sessions.
#[derive(Debug, Default, Serialize)]
pub struct AgentMetricsView {
    pub captured_at: String,
    pub received: u64,
    pub sent: u64,
    pub dropped: u64,
    pub filtered: u64,
    pub expired: u64,
    pub dead_lettered: u64,
    pub in_flight: u64,
    pub outbox_depth: u64,
    pub bindings: Vec<TotalsView>,
    /// `bridge/route` of every route whose lease this agent holds.
    pub leases_held: Vec<String>,
    pub sessions: Vec<SessionView>,
}

/// One session of one agent.
#[derive(Debug, Serialize)]
pub struct SessionView {
    pub bridge_id: String,
    pub session_id: String,
    pub connected: bool,
    pub reconnects: u64,
}

impl From<pb::MetricsSnapshot> for AgentMetricsView {
    fn from(s: pb::MetricsSnapshot) -> Self {
        let mut view = AgentMetricsView {
            captured_at: timestamp(s.captured_at.as_ref()),
            ..Default::default()
        };
        for route in s.routes {
            if route.lease_held {
                view.leases_held
                    .push(format!("{}/{}", route.bridge_id, route.route_id));
            }
            for b in route.bindings {
                let c = b.counters.unwrap_or_default();
                view.received += c.received;
                view.sent += c.sent;
                view.dropped += c.dropped;
                view.filtered += c.filtered;
                view.expired += c.expired;
                view.dead_lettered += c.dead_lettered;
                view.in_flight += c.in_flight;
                view.outbox_depth += b.outbox_depth;
                view.bindings.push(TotalsView::new(
                    route.bridge_id.clone(),
                    route.route_id.clone(),
                    b.binding_id,
                    c,
                    b.outbox_depth,
                ));
            }
        }
        view.sessions = s
            .sessions
            .into_iter()
            .map(|s| SessionView {
                bridge_id: s.bridge_id,
                session_id: s.session_id,
                connected: s.connected,
                reconnects: s.reconnects,
            })
            .collect();
        view
    }
}

impl AgentMetricsView {
    /// Its lines in `ferryctl describe agent`.
    fn pairs(&self) -> Vec<(&'static str, String)> {
        let sessions = crate::output::table(
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
                crate::output::table(TotalsView::HEADERS, self.bindings.iter().map(Row::cells)),
            ),
            ("leases held", self.leases_held.join(",")),
            ("sessions", sessions),
        ]
    }
}

/// Where one configuration stands on one agent.
#[derive(Debug, Serialize)]
pub struct AgentConfigView {
    pub bridge_id: String,
    pub pushed_version: u64,
    pub acked_version: u64,
    pub nacked_version: u64,
    pub nack_error: String,
    pub nack_details: Vec<String>,
    pub updated_at: String,
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
    pub fn with_metrics(agent: pb::AgentInfo, snapshot: Option<pb::MetricsSnapshot>) -> Self {
        let mut view = AgentView::from(agent);
        view.metrics = snapshot.map(AgentMetricsView::from);
        view
    }

    pub fn pairs(&self) -> Vec<(&'static str, String)> {
        let configs = crate::output::table(
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

/// One lease.
#[derive(Debug, Serialize)]
pub struct LeaseView {
    pub key: String,
    pub holder: String,
    pub version: u64,
    pub expires_at: String,
    pub acquired_at: String,
}

impl From<pb::Lease> for LeaseView {
    fn from(l: pb::Lease) -> Self {
        LeaseView {
            key: l.key,
            holder: l.holder,
            version: l.version,
            expires_at: timestamp(l.expires_at.as_ref()),
            acquired_at: timestamp(l.acquired_at.as_ref()),
        }
    }
}

impl Row for LeaseView {
    const HEADERS: &'static [&'static str] = &["KEY", "HOLDER", "VERSION", "EXPIRES"];
    fn cells(&self) -> Vec<String> {
        vec![
            self.key.clone(),
            self.holder.clone(),
            self.version.to_string(),
            self.expires_at.clone(),
        ]
    }
}

/// The name operators see for a DLQ reason.
pub fn reason_name(reason: i32) -> &'static str {
    match pb::DlqReason::try_from(reason) {
        Ok(pb::DlqReason::PermanentError) => "permanent_error",
        Ok(pb::DlqReason::ReplayExhausted) => "replay_exhausted",
        Ok(pb::DlqReason::Expired) => "expired",
        Ok(pb::DlqReason::Oversized) => "oversized",
        Ok(pb::DlqReason::Unspecified) | Err(_) => "unspecified",
    }
}

/// One dead letter.
#[derive(Debug, Serialize)]
pub struct DlqEntryView {
    pub id: String,
    pub bridge_id: String,
    pub route_id: String,
    pub binding_id: String,
    pub address: String,
    pub reason: &'static str,
    pub last_error: String,
    pub attempts: u32,
    pub dead_lettered_at: String,
    pub first_attempt_at: String,
    pub last_attempt_at: String,
    pub agent_id: String,
    pub message_id: String,
    pub headers: Vec<(String, String)>,
    /// The payload as text when it is UTF-8, otherwise its size.
    pub payload: String,
}

impl From<pb::DlqEntry> for DlqEntryView {
    fn from(e: pb::DlqEntry) -> Self {
        let envelope = e.envelope.unwrap_or_default();
        let payload = match String::from_utf8(envelope.payload) {
            Ok(text) => text,
            Err(bytes) => format!("<{} bytes, not UTF-8>", bytes.as_bytes().len()),
        };
        DlqEntryView {
            id: e.id,
            bridge_id: e.bridge_id,
            route_id: e.route_id,
            binding_id: e.binding_id,
            address: e.address,
            reason: reason_name(e.reason),
            last_error: e.last_error,
            attempts: e.attempts,
            dead_lettered_at: timestamp(e.dead_lettered_at.as_ref()),
            first_attempt_at: timestamp(e.first_attempt_at.as_ref()),
            last_attempt_at: timestamp(e.last_attempt_at.as_ref()),
            agent_id: e.agent_id,
            message_id: envelope.id,
            headers: envelope
                .headers
                .into_iter()
                .map(|h| (h.key, h.value))
                .collect(),
            payload,
        }
    }
}

impl DlqEntryView {
    pub fn pairs(&self) -> Vec<(&'static str, String)> {
        let headers = self
            .headers
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect::<Vec<_>>()
            .join("\n");
        vec![
            ("id", self.id.clone()),
            ("bridge", self.bridge_id.clone()),
            ("route", self.route_id.clone()),
            ("binding", self.binding_id.clone()),
            ("address", self.address.clone()),
            ("reason", self.reason.to_owned()),
            ("last error", self.last_error.clone()),
            ("attempts", self.attempts.to_string()),
            ("dead-lettered", self.dead_lettered_at.clone()),
            ("first attempt", self.first_attempt_at.clone()),
            ("last attempt", self.last_attempt_at.clone()),
            ("agent", self.agent_id.clone()),
            ("message id", self.message_id.clone()),
            ("headers", headers),
            ("payload", self.payload.clone()),
        ]
    }
}

impl Row for DlqEntryView {
    const HEADERS: &'static [&'static str] = &[
        "ID",
        "ROUTE",
        "BINDING",
        "REASON",
        "ATTEMPTS",
        "DEAD-LETTERED",
        "ERROR",
    ];
    fn cells(&self) -> Vec<String> {
        vec![
            self.id.clone(),
            format!("{}/{}", self.bridge_id, self.route_id),
            self.binding_id.clone(),
            self.reason.to_owned(),
            self.attempts.to_string(),
            self.dead_lettered_at.clone(),
            self.last_error.clone(),
        ]
    }
}

/// One redrive outcome.
#[derive(Debug, Serialize)]
pub struct RedriveView {
    pub id: String,
    pub ok: bool,
    pub error: String,
}

impl Row for RedriveView {
    const HEADERS: &'static [&'static str] = &["ID", "REDRIVEN", "ERROR"];
    fn cells(&self) -> Vec<String> {
        vec![self.id.clone(), self.ok.to_string(), self.error.clone()]
    }
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
    pub fn new(
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

/// One binding's figures on one agent (`ferryctl metrics --by-agent`).
#[derive(Debug, Serialize)]
pub struct AgentBindingView {
    pub agent_id: String,
    #[serde(flatten)]
    pub figures: TotalsView,
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
