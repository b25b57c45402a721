//! `ferry-agent run --control-plane URL`: a managed agent. Creates and locks
//! its data directory, starts the admin listener, runs the cached bridges
//! and keeps a `Connect` stream to the control plane
//! ([`ferry_agent::control`]) until SIGTERM / SIGINT, then ends the stream
//! and shuts every bridge down gracefully.
//!
//! `/readyz` has no control-plane condition: readiness says whether this
//! agent moves messages (its sessions are connected, its leases resolved),
//! and an agent running from its cache while the control plane is away
//! does. It is unready only until the cached bridges have been started.
//! The stream's state is in the log and in `ferryctl get agents`.
//! The local gRPC `DlqService` is not served: its stores belong to one
//! bridge, and a managed agent runs several that come and go.

use std::sync::Arc;

use anyhow::Context;
use ferry_agent::admin;
use ferry_agent::control::{self, bridges::Bridges, cache::ConfigCache, stream::Identity};
use ferry_agent::datadir;
use ferry_agent::health::Readiness;
use ferry_agent::metrics::Metrics;
use ferry_agent::runtime::Deps;
use tokio_util::sync::CancellationToken;

use super::{Signal, Signals, default_agent_id};
use crate::cli::RunArgs;

/// Runs a managed agent until a signal.
pub(super) async fn serve(args: &RunArgs) -> anyhow::Result<()> {
    let endpoint = args
        .control_plane
        .clone()
        .context("--control-plane is required without --config")?;
    let data_dir = args
        .data_dir
        .as_ref()
        .context("--data-dir is required with --control-plane")?;
    let agent_id = args.agent_id.clone().unwrap_or_else(default_agent_id);
    let data_dir = datadir::create(data_dir)?;
    // Before anything starts: a SIGHUP must never find the default action (exit).
    let mut signals = Signals::install()?;
    // Held until the process ends (the bridges own it).
    let lock = datadir::lock(std::slice::from_ref(&data_dir), &agent_id)?;
    let cache = ConfigCache::open(&data_dir)?;
    let metrics = Arc::new(Metrics::new());
    let readiness = Readiness::default();
    let listener = match args.admin_listen {
        Some(addr) => Some(admin::bind(addr).await?),
        None => None,
    };
    let deps = Deps {
        agent_id: agent_id.clone(),
        metrics: Arc::clone(&metrics),
        readiness: readiness.clone(),
        control_plane: Some(endpoint.clone()),
    };
    // Before the admin listener serves: not ready until the cache is run.
    let bridges = Bridges::new(deps, cache, data_dir.clone(), lock);
    let admin_stop = CancellationToken::new();
    let admin_task = match listener {
        Some(listener) => {
            let addr = listener.local_addr().context("admin listener address")?;
            tracing::info!(%addr, "admin listening");
            Some(tokio::spawn(admin::serve(
                listener,
                admin::router(metrics, readiness),
                admin_stop.clone().cancelled_owned(),
            )))
        }
        None => None,
    };
    let identity = Identity {
        agent_id: agent_id.clone(),
        labels: args.labels.iter().cloned().collect(),
    };
    tracing::info!(agent = %agent_id, control_plane = %endpoint, data_dir = %data_dir.display(), "managed agent starting");
    let stop = CancellationToken::new();
    let agent = tokio::spawn(control::run(
        endpoint,
        identity,
        bridges,
        std::time::Duration::from_millis(args.metrics_interval_ms),
        stop.clone(),
    ));
    while signals.next().await == Signal::Reload {
        tracing::info!(
            "SIGHUP ignored: a managed agent's configurations come from the control plane"
        );
    }
    tracing::info!("shutting down");
    stop.cancel();
    if let Err(error) = agent.await {
        tracing::error!(%error, "the managed agent's task failed");
    }
    admin_stop.cancel();
    if let Some(task) = admin_task {
        match task.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "admin listener failed"),
            Err(e) => tracing::warn!(error = %e, "admin task failed"),
        }
    }
    tracing::info!("stopped");
    Ok(())
}
