//! `ferry-agent run --control-plane URL`: a managed agent
//! ([`ferry_agent::control::managed`]) until SIGTERM / SIGINT; SIGHUP is
//! logged and ignored (the configurations come from the control plane).

use anyhow::Context;
use ferry_agent::admin;
use ferry_agent::control::managed::{self, Settings};

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
        .clone()
        .context("--data-dir is required with --control-plane")?;
    // Before anything starts: a SIGHUP must never find the default action (exit).
    let mut signals = Signals::install()?;
    let admin_listener = match args.admin_listen {
        Some(addr) => Some(admin::bind(addr).await?),
        None => None,
    };
    let settings = Settings {
        endpoint,
        data_dir,
        agent_id: args.agent_id.clone().unwrap_or_else(default_agent_id),
        labels: args.labels.iter().cloned().collect(),
        metrics_interval: std::time::Duration::from_millis(args.metrics_interval_ms),
        admin_listener,
        admin_tls: args
            .admin_security
            .tls()?
            .map(|tls| tls.rustls())
            .transpose()?,
        client: args.client_auth()?,
    };
    let shutdown = async move {
        while signals.next().await == Signal::Reload {
            tracing::info!(
                "SIGHUP ignored: a managed agent's configurations come from the control plane"
            );
        }
    };
    managed::serve(settings, shutdown).await
}
