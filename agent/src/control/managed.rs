//! A whole managed agent in one call: what `ferry-agent run --control-plane
//! URL` runs, and what `ferry quickstart` runs in its own process. Creates
//! and locks the data directory, starts the admin listener (if given), runs
//! the cached bridges and keeps a `Connect` stream to the control plane
//! ([`super::run`]) until `shutdown` resolves, then ends the stream and
//! shuts every bridge down gracefully.
//!
//! `/readyz` has no control-plane condition: readiness says whether this
//! agent moves messages (its sessions are connected, its leases resolved),
//! and an agent running from its cache while the control plane is away
//! does. It is unready only until the cached bridges have been started.
//! The stream's state is in the log and in `ferryctl get agents`.
//! The local gRPC `DlqService` is not served: its stores belong to one
//! bridge, and a managed agent runs several that come and go. So its admin
//! listener serves no RPC and needs no credentials, only TLS if asked.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use ferry_shared::auth::client::ClientAuth;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::bridges::Bridges;
use super::cache::ConfigCache;
use super::stream::Identity;
use crate::admin;
use crate::datadir;
use crate::health::Readiness;
use crate::metrics::Metrics;
use crate::runtime::Deps;

/// What a managed agent is told at start.
#[derive(Debug)]
pub struct Settings {
    /// The control plane's gRPC endpoint, e.g. `http://ferry-cp:50051`.
    pub endpoint: String,
    /// Its own directory (created when missing): the configuration cache,
    /// locked for this agent.
    pub data_dir: PathBuf,
    /// Its id: the lease holder and its name at the control plane.
    pub agent_id: String,
    /// Its labels, matched by configuration selectors.
    pub labels: BTreeMap<String, String>,
    /// How often it sends its metrics snapshot to the control plane.
    pub metrics_interval: Duration,
    /// The admin listener (`/metrics`, `/healthz`, `/readyz`), already bound
    /// so that a taken port is the caller's error before anything starts.
    pub admin_listener: Option<TcpListener>,
    /// TLS of the admin listener (`--tls-cert`, `--tls-key`); plain when `None`.
    pub admin_tls: Option<Arc<rustls::ServerConfig>>,
    /// What the agent presents to the control plane (token, certificate).
    pub client: ClientAuth,
}

/// Runs a managed agent until `shutdown` resolves. Errors only before the
/// agent runs (data directory, lock, cache); afterwards problems are logged
/// and retried.
pub async fn serve(
    settings: Settings,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let Settings {
        endpoint,
        data_dir,
        agent_id,
        labels,
        metrics_interval,
        admin_listener,
        admin_tls,
        client,
    } = settings;
    // Mode 0700, one line naming the directory when it cannot be created.
    let data_dir = datadir::create(&data_dir)?;
    // Held until the process ends (the bridges own it).
    let lock = datadir::lock(std::slice::from_ref(&data_dir), &agent_id)?;
    let cache = ConfigCache::open(&data_dir)?;
    let metrics = Arc::new(Metrics::new());
    let readiness = Readiness::default();
    let deps = Deps {
        agent_id: agent_id.clone(),
        metrics: Arc::clone(&metrics),
        readiness: readiness.clone(),
        control_plane: Some(endpoint.clone()),
        client: client.clone(),
    };
    // Before the admin listener serves: not ready until the cache is run.
    let bridges = Bridges::new(deps, cache, data_dir.clone(), lock);
    let admin = admin_listener
        .map(|listener| {
            admin::Running::start(listener, admin_tls, admin::router(metrics, readiness))
        })
        .transpose()
        .context("admin listener")?;
    let identity = Identity {
        agent_id: agent_id.clone(),
        labels,
        client,
    };
    tracing::info!(agent = %agent_id, control_plane = %endpoint, data_dir = %data_dir.display(), "managed agent starting");
    let stop = CancellationToken::new();
    let agent = tokio::spawn(super::run(
        endpoint,
        identity,
        bridges,
        metrics_interval,
        stop.clone(),
    ));
    shutdown.await;
    tracing::info!("shutting down");
    stop.cancel();
    if let Err(error) = agent.await {
        tracing::error!(%error, "the managed agent's task failed");
    }
    if let Some(admin) = admin {
        admin.stop().await;
    }
    tracing::info!("stopped");
    Ok(())
}
