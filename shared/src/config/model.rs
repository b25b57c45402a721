//! The document: one bridge, as the YAML spells it.
//!
//! Every struct denies unknown fields, so a misspelt key is an error rather than a silently
//! ignored setting. Defaults are named functions, listed in `docs/configuration.md`.

use serde::Deserialize;

use super::route::Route;
use super::store::Stores;
use super::transport::{Binding, Receiver, Sender, Session};

/// One bridge configuration document: the unit the control plane versions and pushes.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BridgeConfig {
    /// The bridge's identity.
    pub bridge: Bridge,
    /// Connections to brokers and services that receivers and senders use.
    #[serde(default)]
    pub sessions: Vec<Session>,
    /// The outbox, lease and dead-letter stores. Each is optional; routes that need one say so
    /// during validation.
    #[serde(default)]
    pub stores: Stores,
    /// Where messages come from: MQTT topic filters or an SQS queue, on a session.
    #[serde(default)]
    pub receivers: Vec<Receiver>,
    /// Publishers on a session; bindings name them.
    #[serde(default)]
    pub senders: Vec<Sender>,
    /// Destinations: a sender plus an address (topic, queue name or queue URL).
    #[serde(default)]
    pub bindings: Vec<Binding>,
    /// Receiver → bindings, with delivery mode, policy and drain settings.
    #[serde(default)]
    pub routes: Vec<Route>,
    /// Tracing export (Ferry's addition to the reference shape).
    #[serde(default)]
    pub telemetry: Telemetry,
}

/// The `bridge:` block.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bridge {
    /// The bridge id: part of every partition key (`{bridge}/{route}`) and metric label.
    pub id: String,
}

/// The `telemetry:` block: OpenTelemetry export of the traces Ferry records.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Telemetry {
    /// OTLP/gRPC collector endpoint (`http://` or `https://`). Unset: no export, traces stay in
    /// the local log.
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
    /// `service.name` of the exported spans.
    #[serde(default = "default_service_name")]
    pub service_name: String,
    /// Fraction of new traces to sample, from 0.0 to 1.0 (parent-based: a message that arrives
    /// with a sampled `traceparent` is always traced).
    #[serde(default = "default_sampling_ratio")]
    pub sampling_ratio: f64,
    /// Extra OpenTelemetry resource attributes of the exported spans (`deployment.environment`,
    /// `host.name`, ...), added to `service.name`.
    #[serde(default)]
    pub resource_attributes: std::collections::BTreeMap<String, String>,
}

/// Default `telemetry.service_name`.
pub fn default_service_name() -> String {
    "ferry-agent".to_owned()
}

/// Default `telemetry.sampling_ratio`: every trace.
pub fn default_sampling_ratio() -> f64 {
    1.0
}

impl Default for Telemetry {
    fn default() -> Self {
        Telemetry {
            otlp_endpoint: None,
            service_name: default_service_name(),
            sampling_ratio: default_sampling_ratio(),
            resource_attributes: std::collections::BTreeMap::new(),
        }
    }
}
