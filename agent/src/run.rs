//! `ferry-agent run`: load and validate the configuration (exit 2 on a problem, before any
//! connection), start the bridge and the admin listener, wait for SIGTERM / SIGINT, shut down
//! gracefully, exit 0. With `--control-plane`, the bridges come from the control plane instead
//! ([`managed`]).

mod managed;

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use ferry_agent::admin;
use ferry_agent::datadir;
use ferry_agent::health::Readiness;
use ferry_agent::metrics::Metrics;
use ferry_agent::runtime::{Bridge, Deps};
use ferry_shared::config::{CheckError, ProcessEnv, ValidConfig, check_file};
use tokio_util::sync::CancellationToken;

use crate::cli::{EXIT_INVALID, RunArgs};

/// `ferry-agent run`.
pub fn main(args: &RunArgs) -> ExitCode {
    init_logging(args.log.as_deref());
    let Some(config) = &args.config else {
        return block_on(managed::serve(args));
    };
    let valid = match check_file(config, &ProcessEnv) {
        Ok(valid) => valid,
        Err(CheckError::Load(e)) => {
            eprintln!("{}: {e}", config.display());
            return ExitCode::from(EXIT_INVALID);
        }
        Err(CheckError::Invalid(errors)) => {
            for e in &errors {
                eprintln!("{e}");
            }
            return ExitCode::from(EXIT_INVALID);
        }
    };
    block_on(serve(args, valid))
}

/// Runs `serve` on a multi-threaded runtime; an error exits 1.
fn block_on(serve: impl Future<Output = anyhow::Result<()>>) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "ferry-agent failed");
            eprintln!("ferry-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(args: &RunArgs, valid: ValidConfig) -> anyhow::Result<()> {
    let agent_id = args.agent_id.clone().unwrap_or_else(default_agent_id);
    // Before any store is opened; held until this function returns.
    let locks = datadir::lock(&datadir::sqlite_dirs(&valid), &agent_id)?;
    for dir in locks.dirs() {
        tracing::debug!(dir = %dir.display(), "data directory locked");
    }
    let metrics = Arc::new(Metrics::new());
    let readiness = Readiness::default();
    // Bind first: a taken port is an error before any broker connection.
    let listener = match args.admin_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding the admin listener on {addr}"))?,
        ),
        None => None,
    };
    let deps = Deps {
        agent_id: agent_id.clone(),
        metrics: Arc::clone(&metrics),
        readiness: readiness.clone(),
    };
    let bridge = Bridge::start(&valid, deps)
        .await
        .context("starting the bridge")?;
    let admin_stop = CancellationToken::new();
    let admin_task = match listener {
        Some(listener) => {
            let addr = listener.local_addr().context("admin listener address")?;
            let mut router = admin::router(Arc::clone(&metrics), readiness);
            if let Some(dlq) = bridge.dlq() {
                router = admin::with_grpc(router, dlq, bridge.redrive());
            }
            tracing::info!(%addr, "admin listening");
            Some(tokio::spawn(admin::serve(
                listener,
                router,
                admin_stop.clone().cancelled_owned(),
            )))
        }
        None => None,
    };
    tracing::info!(bridge = %valid.bridge_id(), agent = %agent_id, "bridge running");
    wait_for_signal().await?;
    tracing::info!(grace = ?bridge.grace(), "shutting down");
    bridge.shutdown().await;
    admin_stop.cancel();
    if let Some(task) = admin_task {
        match task.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "admin listener failed"),
            Err(e) => tracing::warn!(error = %e, "admin task failed"),
        }
    }
    tracing::info!("stopped");
    drop(locks);
    Ok(())
}

async fn wait_for_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM"),
        _ = int.recv() => tracing::info!("SIGINT"),
    }
    Ok(())
}

fn default_agent_id() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "ferry-agent".to_owned())
}

fn init_logging(filter: Option<&str>) {
    use tracing_subscriber::EnvFilter;
    let filter = match filter {
        Some(f) => EnvFilter::new(f),
        None => EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
    };
    // Colour only for a person at a terminal: not in files, pipes or
    // journald, and never when `NO_COLOR` is set (no-color.org).
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .init();
}
