//! `ferry-control-plane`: serves Ferry's gRPC API (and, with
//! `--http-listen`, Prometheus `/metrics`) until SIGTERM or SIGINT.
//!
//! A failure to start (a state store that does not open, a port in use)
//! exits 1 with one line on stderr: `ferry-control-plane: <what and why>`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use ferry_control_plane::server::{ControlPlane, Security};
use ferry_control_plane::services::Options;
use ferry_control_plane::state::{StateUrl, open_state_store};
use ferry_shared::auth::flags::ServerSecurityArgs;
use ferry_shared::auth::tls::ServerTls;
use ferry_shared::config::ProcessEnv;
use ferry_shared::config::secret::mask_url;
use ferry_shared::os::{self, ListenError};
use ferry_shared::telemetry::{Telemetry, TelemetryArgs};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::info;
use tracing_subscriber::fmt::writer::BoxMakeWriter;

/// Examples under `ferry-control-plane --help`.
const EXAMPLES: &str = "\
Examples:
  # Development: state in ./ferry-data/state.db, Prometheus on :9090/metrics, no credentials
  ferry-control-plane --listen 127.0.0.1:50051 --http-listen 127.0.0.1:9090 --insecure
  # Production: TLS, bearer tokens and agent certificates, replicas on one PostgreSQL
  ferry-control-plane --listen 0.0.0.0:50051 --state postgres://ferry@db/ferry --tls-cert /etc/ferry/tls.crt --tls-key /etc/ferry/tls.key --client-ca /etc/ferry/ca.crt --tokens /etc/ferry/tokens.yaml";

/// Ferry's control plane: bridge configurations, agents, leases, dead
/// letters and metrics over gRPC.
#[derive(Debug, Parser)]
#[command(name = "ferry-control-plane", version, after_help = EXAMPLES)]
struct Args {
    /// Address the gRPC server listens on.
    #[arg(long, default_value = "127.0.0.1:50051", env = "FERRY_LISTEN")]
    listen: SocketAddr,
    /// Address of the HTTP listener serving Prometheus `/metrics` and
    /// `/healthz`; none when unset.
    #[arg(long, env = "FERRY_HTTP_LISTEN")]
    http_listen: Option<SocketAddr>,
    /// Directory of the embedded state (`state.db`) when `--state` is not
    /// given.
    #[arg(long, default_value = "./ferry-data", env = "FERRY_DATA_DIR")]
    data_dir: PathBuf,
    /// Where the state lives: `sqlite:///path/state.db` (default: `state.db`
    /// in `--data-dir`) or `postgres://user@host/db` (several replicas may
    /// share one PostgreSQL database).
    #[arg(long, env = "FERRY_STATE")]
    state: Option<String>,
    /// How often agents and the control plane exchange heartbeats, in
    /// milliseconds; an agent silent for three intervals is disconnected.
    #[arg(long, default_value_t = 10_000, env = "FERRY_HEARTBEAT_INTERVAL_MS")]
    heartbeat_interval_ms: u64,
    /// How long a DLQ redrive waits for the agent's answer, in milliseconds.
    #[arg(long, default_value_t = 30_000, env = "FERRY_COMMAND_TIMEOUT_MS")]
    command_timeout_ms: u64,
    /// Logging and span export.
    #[command(flatten)]
    telemetry: TelemetryArgs,
    /// TLS and credentials of both listeners.
    #[command(flatten)]
    security: ServerSecurityArgs,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let telemetry = match init_telemetry(&args.telemetry) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("ferry-control-plane: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let served = serve(args).await;
    telemetry.shutdown().await;
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferry-control-plane: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Logs on stdout (text or JSON); spans exported when an OTLP endpoint is
/// configured (`--otlp-endpoint` or `OTEL_EXPORTER_OTLP_ENDPOINT`).
fn init_telemetry(args: &TelemetryArgs) -> anyhow::Result<Telemetry> {
    let mut settings = args.settings("ferry-control-plane", None, &ProcessEnv)?;
    settings.log_writer = BoxMakeWriter::new(std::io::stdout);
    settings.ansi = std::io::IsTerminal::is_terminal(&std::io::stdout())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    Ok(ferry_shared::telemetry::init(settings)?)
}

async fn serve(args: Args) -> anyhow::Result<()> {
    if args.heartbeat_interval_ms == 0 {
        anyhow::bail!("--heartbeat-interval-ms must be positive");
    }

    let stop_watching = CancellationToken::new();
    let _stop_watching = stop_watching.clone().drop_guard();
    let (auth, tls) = args.security.load("control plane", stop_watching)?;
    let http_tls = tls.as_ref().map(ServerTls::rustls).transpose()?;

    let state_url = args
        .state
        .clone()
        .unwrap_or_else(|| format!("sqlite://{}", args.data_dir.join("state.db").display()));
    create_state_dir(&state_url)?;
    let store = open_state_store(&state_url)
        .await
        .with_context(|| format!("opening the state store {}", mask_url(&state_url)))?;
    info!(state = %mask_url(&state_url), "state store open");

    let listener = bind(args.listen, "gRPC listener", "--listen").await?;
    let local = listener.local_addr().context("reading the bound address")?;

    let options = Options {
        heartbeat_interval: Duration::from_millis(args.heartbeat_interval_ms),
        command_timeout: Duration::from_millis(args.command_timeout_ms),
        ..Options::default()
    };
    let control_plane =
        ControlPlane::new(store.clone(), options).with_security(Security { auth, tls });
    let shutdown = control_plane.context().shutdown.clone();

    let http = match args.http_listen {
        Some(addr) => {
            let listener = bind(addr, "HTTP listener", "--http-listen").await?;
            let bound = listener.local_addr().context("reading the bound address")?;
            info!(listen = %bound, "control plane serving /metrics");
            let stop = shutdown.clone().cancelled_owned();
            Some(tokio::spawn(ferry_control_plane::http::serve(
                listener, http_tls, store, stop,
            )))
        }
        None => None,
    };

    info!(listen = %local, "control plane serving gRPC");
    let served = control_plane.serve(listener, shutdown_signal()).await;
    shutdown.cancel();
    if let Some(http) = http {
        match http.await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::warn!(%error, "HTTP listener failed"),
            Err(error) => tracing::warn!(%error, "HTTP listener task failed"),
        }
    }
    served?;
    info!("control plane stopped");
    Ok(())
}

/// Creates the directory of an SQLite state file when it is missing (mode
/// 0700), so that a failure is reported as what it is: the directory, and
/// why it cannot be created.
fn create_state_dir(state_url: &str) -> anyhow::Result<()> {
    let Ok(StateUrl::Sqlite(file)) = StateUrl::parse(state_url) else {
        return Ok(());
    };
    if let Some(dir) = file.parent().filter(|dir| !dir.as_os_str().is_empty()) {
        os::create_private_dir(dir)?;
    }
    Ok(())
}

/// Binds `addr` for `what`; a refusal names the flag that chooses it.
async fn bind(
    addr: SocketAddr,
    what: &'static str,
    flag: &'static str,
) -> Result<TcpListener, ListenError> {
    TcpListener::bind(addr).await.map_err(|error| ListenError {
        addr,
        what,
        flag,
        error,
    })
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM; only SIGINT stops the server");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = terminate => {}
        result = tokio::signal::ctrl_c() => {
            if let Err(error) = result {
                tracing::warn!(%error, "cannot listen for SIGINT");
                std::future::pending::<()>().await;
            }
        }
    }
    info!("shutdown requested");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn help_ends_with_examples_that_parse() {
        let help = match Args::try_parse_from(["ferry-control-plane", "--help"]) {
            Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelp => e.to_string(),
            other => panic!("expected help, got {other:?}"),
        };
        assert!(help.contains("Examples:\n"), "{help}");
        let commands: Vec<&str> = EXAMPLES
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with("ferry-control-plane "))
            .collect();
        assert_eq!(commands.len(), 2, "{EXAMPLES}");
        for command in commands {
            assert!(help.contains(command), "{help}");
            if let Err(e) = Args::try_parse_from(command.split_whitespace()) {
                panic!("{command}: {e}");
            }
        }
    }
}
