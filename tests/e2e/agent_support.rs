//! What the agent's end-to-end tests share: a configuration builder for a bridge from broker A
//! (topic `{run}/in`) to broker B, and waiting for the conservation law.

use ferry_shared::auth::client::{AuthChannel, ClientAuth};
use std::fmt::Write as _;
use std::time::Duration;

use ferry_shared::api::v1::dlq_service_client::DlqServiceClient;
use ferry_tests::agent::{Agent, BindingCounts};
use ferry_tests::mqtt::QoS;
use ferry_tests::{Collector, ids, wait};
use tonic::transport::Channel;

/// The shape of one test bridge.
pub struct Bridge {
    /// Unique prefix of topics and client ids.
    pub run: String,
    /// Broker A (source) URL.
    pub source: String,
    /// Broker B (destination) URL.
    pub destination: String,
    /// Directory of the SQLite stores.
    pub dir: std::path::PathBuf,
    /// Binding ids; binding `x` publishes to `{run}/out/x` on B.
    pub bindings: Vec<String>,
    /// `shared_outbox` (fan-out) or `direct_hold` (one binding).
    pub shared_outbox: bool,
    /// Lines added under the route's `policy:`.
    pub policy: Vec<String>,
    /// Lines added under the route's `session:` (shared_outbox).
    pub session: Vec<String>,
    /// Appended to a binding's topic (to make one binding's publishes larger).
    pub address_suffix: std::collections::HashMap<String, String>,
    /// Lines added under `stores.dlq.options` (e.g. `max_size_bytes: 65536`).
    pub dlq_options: Vec<String>,
    /// Lines of a `telemetry:` block (e.g. `otlp_endpoint: http://...`).
    pub telemetry: Vec<String>,
    /// The whole `stores:` block instead of SQLite stores in `dir` (`dlq_options` unused).
    pub stores: Option<String>,
    /// The receiver subscribes as a member of this MQTT v5 shared subscription group
    /// (`$share/{group}/{run}/in`) instead of with a plain subscription.
    pub share_group: Option<String>,
}

impl Bridge {
    pub fn new(source: &str, destination: &str, dir: &std::path::Path, bindings: &[&str]) -> Self {
        Self {
            run: ids::unique("e2e"),
            source: source.to_owned(),
            destination: destination.to_owned(),
            dir: dir.to_owned(),
            bindings: bindings.iter().map(|b| (*b).to_owned()).collect(),
            shared_outbox: true,
            policy: Vec::new(),
            session: vec![
                "drain_interval: 200ms".into(),
                "drain_batch_size: 100".into(),
                "lease_ttl: 3s".into(),
                "step_down_grace: 2s".into(),
            ],
            address_suffix: std::collections::HashMap::new(),
            dlq_options: Vec::new(),
            telemetry: Vec::new(),
            stores: None,
            share_group: None,
        }
    }

    /// The topic messages are published to on A.
    pub fn input(&self) -> String {
        format!("{}/in", self.run)
    }

    /// The topic binding `b` publishes to on B.
    pub fn output(&self, b: &str) -> String {
        let suffix = self.address_suffix.get(b).map_or("", String::as_str);
        format!("{}/out/{b}{suffix}", self.run)
    }

    /// The receiver's topic filter: the input topic, or its shared subscription.
    pub fn filter(&self) -> String {
        match &self.share_group {
            Some(group) => format!("$share/{group}/{}", self.input()),
            None => self.input(),
        }
    }

    /// The configuration document.
    pub fn yaml(&self) -> String {
        let dir = self.dir.display();
        let mut y = format!(
            "bridge:\n  id: e2e\n\
             sessions:\n\
             \x20 - id: src\n    transport: mqtt\n    options:\n      session:\n        broker_url: {src}\n        client_id: {run}-in\n        keep_alive: 5\n\
             \x20 - id: dst\n    transport: mqtt\n    options:\n      session:\n        broker_url: {dst}\n        client_id: {run}-out\n        keep_alive: 5\n\
             {stores}\
             receivers:\n  - id: in\n    session_id: src\n    topics:\n      - topic: {filter}\n        qos: 1\n\
             senders:\n  - id: out\n    session_id: dst\n    options:\n      sender:\n        qos: 1\n\
             bindings:\n",
            src = self.source,
            dst = self.destination,
            run = self.run,
            filter = self.filter(),
            stores = self.stores.clone().unwrap_or_else(|| format!(
                "stores:\n\
                 \x20 outbox:\n    type: sqlite\n    options:\n      path: {dir}/outbox.db\n\
                 \x20 lease:\n    type: sqlite\n    options:\n      path: {dir}/lease.db\n\
                 \x20 dlq:\n    type: sqlite\n    options:\n      path: {dir}/dlq.db\n{}",
                self.dlq_options
                    .iter()
                    .map(|line| format!("      {line}\n"))
                    .collect::<String>(),
            )),
        );
        for b in &self.bindings {
            let _ = writeln!(
                y,
                "  - id: {b}\n    sender_id: out\n    address: {}",
                self.output(b)
            );
        }
        let mode = if self.shared_outbox {
            "shared_outbox\n    dispatch_mode: fan_out"
        } else {
            "direct_hold"
        };
        let _ = writeln!(
            y,
            "routes:\n  - id: r\n    receiver_id: in\n    delivery_mode: {mode}\n    bindings: [{}]",
            self.bindings.join(", ")
        );
        if !self.policy.is_empty() {
            y.push_str("    policy:\n");
            for line in &self.policy {
                let _ = writeln!(y, "      {line}");
            }
        }
        if self.shared_outbox {
            y.push_str("    session:\n      session_id: dst\n      sender_id: out\n");
            for line in &self.session {
                let _ = writeln!(y, "      {line}");
            }
        }
        if !self.telemetry.is_empty() {
            y.push_str("telemetry:\n");
            for line in &self.telemetry {
                let _ = writeln!(y, "  {line}");
            }
        }
        y
    }

    /// A collector on the destination broker for every binding's topic.
    pub async fn collector(&self) -> anyhow::Result<Collector> {
        Collector::start(
            &self.destination,
            &ids::unique("collector"),
            &format!("{}/out/#", self.run),
            QoS::AtLeastOnce,
        )
        .await
    }

    /// Starts an agent on this configuration and waits until it is ready.
    pub async fn start_agent(&self) -> anyhow::Result<Agent> {
        let mut agent = Agent::start(&self.dir, &self.yaml())?;
        agent.wait_ready(Duration::from_secs(20)).await?;
        Ok(agent)
    }
}

/// A client of the agent's local `DlqService` (on its admin listener).
/// A client of the agent's local DLQ service (open mode: no credential; the
/// type is the one the control plane's harness channel has too).
pub async fn dlq_client(agent: &Agent) -> anyhow::Result<DlqServiceClient<AuthChannel>> {
    let channel = Channel::from_shared(agent.admin_url())?.connect().await?;
    Ok(DlqServiceClient::new(ClientAuth::default().wrap(channel)))
}

/// Waits until no binding has messages in flight and the counters of every binding satisfy
/// the conservation law; returns them.
pub async fn quiesced(
    agent: &Agent,
    bindings: &[String],
    timeout: Duration,
) -> anyhow::Result<Vec<BindingCounts>> {
    wait::until_ok(
        timeout,
        "the conservation law with nothing in flight",
        || {
            let outcome = agent.metrics().and_then(|m| {
                let counts: Vec<BindingCounts> =
                    bindings.iter().map(|b| m.binding("r", b)).collect();
                for (b, c) in bindings.iter().zip(&counts) {
                    anyhow::ensure!(c.in_flight == 0, "{b}: {c:?}");
                    anyhow::ensure!(c.is_conserved(), "{b}: not conserved: {c:?}");
                }
                Ok(counts)
            });
            std::future::ready(outcome)
        },
    )
    .await
}
