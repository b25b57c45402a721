//! `ferry-agent run`: load and validate the configuration (exit 2 on a problem, before any
//! connection), start the bridge and the admin listener, wait for SIGTERM / SIGINT, shut down
//! gracefully, exit 0. SIGHUP reads the file again and applies it as a live change
//! ([`Bridge::apply`]); a file that does not load or validate is logged and ignored. With
//! `--control-plane`, the bridges come from the control plane instead ([`managed`]).

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

use crate::cli::{RunArgs, report_refused};

/// `ferry-agent run`.
pub fn main(args: &RunArgs) -> ExitCode {
    let Some(config) = &args.config else {
        return block_on(args, None, managed::serve(args));
    };
    let valid = match check_file(config, &ProcessEnv) {
        Ok(valid) => valid,
        Err(e) => return report_refused(config, &e),
    };
    let telemetry = valid.config().telemetry.clone();
    block_on(args, Some(&telemetry), serve(args, config, valid))
}

/// Sets up telemetry (the file's `telemetry:` block when standalone, then
/// the `OTEL_*` variables and the flags) and runs `serve` on a
/// multi-threaded runtime; the spans still queued are flushed before exit.
/// An error exits 1 with one line (the error and its causes,
/// `: `-separated).
fn block_on(
    args: &RunArgs,
    config: Option<&ferry_shared::config::Telemetry>,
    serve: impl Future<Output = anyhow::Result<()>>,
) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.worker_threads())
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let served = runtime.block_on(async {
        let telemetry = crate::cli::telemetry(args, config)?;
        #[cfg(feature = "jemalloc")]
        crate::allocator::warn_unless_measured();
        let served = serve.await;
        telemetry.shutdown().await;
        served
    });
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferry-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(args: &RunArgs, config: &std::path::Path, valid: ValidConfig) -> anyhow::Result<()> {
    let agent_id = args.agent_id.clone().unwrap_or_else(default_agent_id);
    // Created and locked before any store is opened; held until this function returns.
    let mut locks = vec![datadir::lock(&datadir::sqlite_dirs(&valid)?, &agent_id)?];
    for dir in locks.iter().flat_map(|l| l.dirs()) {
        tracing::debug!(dir = %dir.display(), "data directory locked");
    }
    // Before the bridge starts: a SIGHUP must never find the default action (exit).
    let mut signals = Signals::install()?;
    let metrics = Arc::new(Metrics::new());
    let readiness = Readiness::default();
    // Bind, then credentials: a taken port or a missing credential is an
    // error before any broker connection.
    let stop_watching = tokio_util::sync::CancellationToken::new();
    let _stop_watching = stop_watching.clone().drop_guard();
    let listener = match args.admin_listen {
        Some(addr) => {
            let listener = admin::bind(addr).await?;
            let (auth, tls) = args
                .admin_security
                .load("admin", stop_watching)
                .context("admin listener")?;
            let tls = tls.map(|tls| tls.rustls()).transpose()?;
            Some((listener, auth, tls))
        }
        None => None,
    };
    let deps = Deps {
        agent_id: agent_id.clone(),
        metrics: Arc::clone(&metrics),
        readiness: readiness.clone(),
        control_plane: None,
        client: args.client_auth()?,
    };
    let mut bridge = Bridge::start(&valid, deps)
        .await
        .context("starting the bridge")?;
    let admin = match listener {
        Some((listener, auth, tls)) => {
            let mut router = admin::router(Arc::clone(&metrics), readiness);
            if let Some(dlq) = bridge.dlq() {
                router = admin::with_grpc(router, dlq, bridge.redrive(), auth)?;
            }
            Some(admin::Running::start(listener, tls, router).context("admin listener")?)
        }
        None => None,
    };
    tracing::info!(bridge = %valid.bridge_id(), agent = %agent_id, "bridge running");
    while signals.next().await == Signal::Reload {
        reload(config, &agent_id, &mut bridge, &mut locks).await;
    }
    tracing::info!(grace = ?bridge.grace(), "shutting down");
    bridge.shutdown().await;
    if let Some(admin) = admin {
        admin.stop().await;
    }
    tracing::info!("stopped");
    drop(locks);
    Ok(())
}

/// SIGHUP: the file is read and validated again; a valid new version is applied as a diff.
/// Nothing changes when it does not load or validate, or cannot be applied.
async fn reload(
    path: &std::path::Path,
    agent_id: &str,
    bridge: &mut Bridge,
    locks: &mut Vec<datadir::DataDirLocks>,
) {
    let new = match check_file(path, &ProcessEnv) {
        Ok(new) => new,
        Err(CheckError::Load(e)) => {
            tracing::error!(file = %path.display(), error = %e, "SIGHUP: cannot load the configuration; the running version keeps going");
            return;
        }
        Err(CheckError::Invalid(errors)) => {
            for e in &errors {
                tracing::error!(file = %path.display(), error = %e, "SIGHUP: invalid configuration");
            }
            tracing::error!(
                errors = errors.len(),
                "SIGHUP: configuration ignored; the running version keeps going"
            );
            return;
        }
    };
    // A store moved to a new directory: lock it before it is opened (held until exit).
    let held: Vec<std::path::PathBuf> = locks
        .iter()
        .flat_map(|l| l.dirs().map(std::path::Path::to_path_buf))
        .collect();
    let fresh: Vec<std::path::PathBuf> = match datadir::sqlite_dirs(&new) {
        Ok(dirs) => dirs.into_iter().filter(|d| !held.contains(d)).collect(),
        Err(e) => {
            tracing::error!(error = %e, "SIGHUP: cannot create a new data directory; the running version keeps going");
            return;
        }
    };
    if !fresh.is_empty() {
        match datadir::lock(&fresh, agent_id) {
            Ok(l) => locks.push(l),
            Err(e) => {
                tracing::error!(error = %e, "SIGHUP: cannot lock a new data directory; the running version keeps going");
                return;
            }
        }
    }
    match bridge.apply(&new).await {
        Ok(report) if report.diff.is_empty() => {
            tracing::info!("SIGHUP: configuration unchanged");
        }
        Ok(_) => {}
        Err(e) => {
            tracing::error!(error = %e, "SIGHUP: cannot apply the configuration; the running version keeps going");
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Signal {
    Stop,
    Reload,
}

/// The signals `run` answers: SIGTERM and SIGINT stop, SIGHUP reloads.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
            hup: signal(SignalKind::hangup()).context("installing the SIGHUP handler")?,
        })
    }

    async fn next(&mut self) -> Signal {
        tokio::select! {
            _ = self.term.recv() => { tracing::info!("SIGTERM"); Signal::Stop }
            _ = self.int.recv() => { tracing::info!("SIGINT"); Signal::Stop }
            _ = self.hup.recv() => { tracing::info!("SIGHUP: reloading the configuration"); Signal::Reload }
        }
    }
}

fn default_agent_id() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "ferry-agent".to_owned())
}
