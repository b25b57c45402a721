//! The control plane and one managed agent, both in this process, and what
//! the quickstart asks the control plane: apply the bridge (as `ferryctl
//! apply` does), the agent's counters (as `ferryctl metrics` shows them) and
//! the lease holder (as `ferryctl get leases` shows it).
//!
//! The control plane keeps its state in SQLite in the temporary directory
//! and serves gRPC and `/metrics` on free loopback ports. The agent is the
//! same code as `ferry-agent run --control-plane URL --data-dir DIR --label
//! site=quickstart` ([`ferry_agent::control::managed`]), connected over
//! gRPC like any other agent.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use ferry_agent::control::managed;
use ferry_control_plane::server::{ControlPlane, Security};
use ferry_control_plane::services::Options;
use ferry_control_plane::state::open_state_store;
use ferry_shared::api::v1 as pb;
use ferry_shared::auth::client::ClientAuth;
use pb::config_service_client::ConfigServiceClient;
use pb::lease_service_client::LeaseServiceClient;
use pb::metrics_service_client::MetricsServiceClient;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// The agent's id.
pub const AGENT_ID: &str = "quickstart-agent";
/// The agent's label, matched by the bridge's selector.
pub const LABEL: (&str, &str) = ("site", "quickstart");
/// How often the agent sends its counters to the control plane: the view's
/// agent figures are at most this old, and readings start at most this long
/// after the agent runs the bridge (its snapshot says so).
pub const METRICS_INTERVAL: Duration = Duration::from_millis(250);

/// The running control plane and agent.
pub struct Fleet {
    /// The control plane's gRPC endpoint, `http://127.0.0.1:PORT`.
    pub endpoint: String,
    /// The control plane's Prometheus endpoint.
    pub metrics_url: String,
    /// The agent's admin listener (`/metrics`, `/readyz`).
    pub agent_admin: String,
    channel: Channel,
    agent_stop: CancellationToken,
    agent: JoinHandle<anyhow::Result<()>>,
    control_plane_stop: CancellationToken,
    control_plane: JoinHandle<()>,
}

/// One binding's figures as the agent last reported them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BindingFigures {
    /// The conservation counters.
    pub counters: pb::DeliveryCounters,
    /// Outbox records pending or claimed.
    pub depth: u64,
}

impl BindingFigures {
    /// `received = sent + dropped + filtered + expired + dead_lettered + in_flight`.
    pub fn conserved(&self) -> bool {
        let c = &self.counters;
        c.received == c.sent + c.dropped + c.filtered + c.expired + c.dead_lettered + c.in_flight
    }
}

/// A lease as `ferryctl get leases` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseHolder {
    /// `{bridge}/{route}`.
    pub key: String,
    /// The holder (agent id and a per-process suffix); empty when free.
    pub holder: String,
    /// The fencing version.
    pub version: u64,
}

impl Fleet {
    /// Starts the control plane (state under `dir/control-plane`) and the
    /// agent (data directory `agent_dir`).
    pub async fn start(dir: &Path, agent_dir: &Path) -> anyhow::Result<Self> {
        let state = format!("sqlite://{}", dir.join("control-plane/state.db").display());
        let store = open_state_store(&state)
            .await
            .with_context(|| format!("opening the control plane's state {state}"))?;
        let grpc = bind().await?;
        let http = bind().await?;
        let endpoint = format!("http://{}", grpc.local_addr()?);
        let metrics_url = format!("http://{}/metrics", http.local_addr()?);
        // The open development mode, on loopback only and for the life of
        // this process (ADR 0009); `print_ferryctl` says so.
        let control_plane = ControlPlane::new(store.clone(), Options::default())
            .with_security(Security::insecure());
        let control_plane_stop = control_plane.context().shutdown.clone();
        let http_stop = control_plane_stop.clone().cancelled_owned();
        let served = control_plane.serve(grpc, control_plane_stop.clone().cancelled_owned());
        let control_plane = tokio::spawn(async move {
            let http = ferry_control_plane::http::serve(http, None, store, http_stop);
            let (grpc, http) = tokio::join!(served, http);
            if let Err(error) = grpc {
                tracing::error!(%error, "the control plane failed");
            }
            if let Err(error) = http {
                tracing::error!(%error, "the control plane's /metrics failed");
            }
        });
        let channel = tonic::transport::Endpoint::from_shared(endpoint.clone())?.connect_lazy();

        let admin = bind().await?;
        let agent_admin = format!("http://{}", admin.local_addr()?);
        let settings = managed::Settings {
            endpoint: endpoint.clone(),
            data_dir: agent_dir.to_path_buf(),
            agent_id: AGENT_ID.to_owned(),
            labels: BTreeMap::from([(LABEL.0.to_owned(), LABEL.1.to_owned())]),
            metrics_interval: METRICS_INTERVAL,
            admin_listener: Some(admin),
            admin_tls: None,
            client: ClientAuth::default(),
        };
        let agent_stop = CancellationToken::new();
        let agent = tokio::spawn(managed::serve(
            settings,
            agent_stop.clone().cancelled_owned(),
        ));
        Ok(Self {
            endpoint,
            metrics_url,
            agent_admin,
            channel,
            agent_stop,
            agent,
            control_plane_stop,
            control_plane,
        })
    }

    /// Applies `yaml` for the agents labelled [`LABEL`], as `ferryctl apply
    /// -f FILE --selector site=quickstart` does; returns the version.
    pub async fn apply(&self, yaml: String) -> anyhow::Result<u64> {
        let response = ConfigServiceClient::new(self.channel.clone())
            .apply_config(pb::ApplyConfigRequest {
                document: Some(pb::apply_config_request::Document::Yaml(yaml.into_bytes())),
                selector: Some(pb::LabelSelector {
                    match_labels: [(LABEL.0.to_owned(), LABEL.1.to_owned())].into(),
                }),
                expected_version: None,
                change_note: "ferry quickstart".to_owned(),
            })
            .await
            .map_err(|status| anyhow::anyhow!("{}", status.message()))
            .context("applying the quickstart bridge")?;
        let config = response
            .into_inner()
            .config
            .context("the control plane returned no configuration")?;
        Ok(config.version)
    }

    /// The agent's latest snapshot, once it runs `bridge` with every session
    /// connected and every lease held; `None` before.
    pub async fn bridging(&self, bridge: &str) -> anyhow::Result<Option<pb::MetricsSnapshot>> {
        let answer = MetricsServiceClient::new(self.channel.clone())
            .get_agent_metrics(pb::GetAgentMetricsRequest {
                agent_id: AGENT_ID.to_owned(),
            })
            .await;
        let snapshot = match answer {
            Ok(response) => response.into_inner().snapshot,
            Err(status) if status.code() == tonic::Code::NotFound => None,
            Err(status) => return Err(status).context("reading the agent's metrics"),
        };
        Ok(snapshot.filter(|s| {
            let sessions = s.sessions.iter().filter(|x| x.bridge_id == bridge);
            let routes = s.routes.iter().filter(|r| r.bridge_id == bridge);
            sessions.clone().count() > 0
                && sessions.clone().all(|x| x.connected)
                && routes.clone().count() > 0
                && routes
                    .clone()
                    .all(|r| r.delivery_mode != "shared_outbox" || r.lease_held)
        }))
    }

    /// Every binding of `bridge` with the counters the agent last reported,
    /// as `ferryctl metrics` shows them (fleet totals: one agent here).
    pub async fn figures(&self, bridge: &str) -> anyhow::Result<BTreeMap<String, BindingFigures>> {
        let totals = MetricsServiceClient::new(self.channel.clone())
            .get_totals(pb::GetTotalsRequest {
                bridge_id: bridge.to_owned(),
            })
            .await
            .context("reading the fleet's totals")?
            .into_inner();
        Ok(totals
            .bindings
            .into_iter()
            .map(|b| {
                let figures = BindingFigures {
                    counters: b.counters.unwrap_or_default(),
                    depth: b.outbox_depth,
                };
                (b.binding_id, figures)
            })
            .collect())
    }

    /// The leases of `bridge`, as `ferryctl get leases` lists them.
    pub async fn leases(&self, bridge: &str) -> anyhow::Result<Vec<LeaseHolder>> {
        let leases = LeaseServiceClient::new(self.channel.clone())
            .list_leases(pb::ListLeasesRequest {
                key_prefix: format!("{bridge}/"),
                page_size: 0,
                page_token: String::new(),
            })
            .await
            .context("listing the leases")?
            .into_inner()
            .leases;
        Ok(leases
            .into_iter()
            .map(|l| LeaseHolder {
                key: l.key,
                holder: l.holder,
                version: l.version,
            })
            .collect())
    }

    /// Whether the agent stopped by itself, which it does only when it
    /// cannot start (its data directory, lock or cache; see the log).
    pub fn agent_stopped(&self) -> bool {
        self.agent.is_finished()
    }

    /// Stops the agent (it ends its stream and releases its leases), then
    /// the control plane.
    pub async fn stop(self) {
        self.agent_stop.cancel();
        match self.agent.await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::error!(error = format!("{error:#}"), "the agent failed"),
            Err(error) => tracing::error!(%error, "the agent's task failed"),
        }
        self.control_plane_stop.cancel();
        if let Err(error) = self.control_plane.await {
            tracing::error!(%error, "the control plane's task failed");
        }
    }
}

/// A listener on a free loopback port.
async fn bind() -> anyhow::Result<TcpListener> {
    TcpListener::bind(("127.0.0.1", 0))
        .await
        .context("binding a loopback port")
}
