//! The command line: `ferry-agent <command>`.
//!
//! Subcommands are a clap enum: `validate FILE`, and `run` standalone (`--config FILE`) or
//! managed (`--control-plane URL`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use ferry_shared::auth::client::ClientAuth;
use ferry_shared::auth::flags::ServerSecurityArgs;
use ferry_shared::config::{CheckError, LoadError, ProcessEnv, check_file};
use ferry_shared::telemetry::{Telemetry, TelemetryArgs};

/// Exit status of a configuration that did not load or did not validate.
pub const EXIT_INVALID: u8 = 2;

/// Examples under `ferry-agent --help`.
const EXAMPLES: &str = "\
Examples:
  ferry-agent validate deploy/examples/edge-sqlite.yaml
  FERRY_DATA_DIR=/tmp/ferry ferry-agent run --config deploy/examples/edge-sqlite.yaml \\
      --admin-listen 127.0.0.1:9464 --insecure
  ferry-agent run --control-plane http://127.0.0.1:50051 --data-dir /tmp/ferry-edge \\
      --agent-id edge-01 --label site=plant-1";

/// Examples under `ferry-agent run --help`.
const RUN_EXAMPLES: &str = "\
Examples:
  # Standalone, one bridge from a file; its SQLite stores in /tmp/ferry (created when missing)
  FERRY_DATA_DIR=/tmp/ferry ferry-agent run --config deploy/examples/edge-sqlite.yaml \\
      --admin-listen 127.0.0.1:9464 --insecure
  kill -HUP $(pidof ferry-agent)   # apply the edited file live

  # Managed: the bridges a control plane pushes to agents labelled site=plant-1
  ferry-agent run --control-plane http://127.0.0.1:50051 --data-dir /tmp/ferry-edge \\
      --agent-id edge-01 --label site=plant-1 --admin-listen 127.0.0.1:9465

  # Managed over mTLS: its certificate names it (SAN URI ferry://agent/edge-01)
  ferry-agent run --control-plane https://ferry-cp:50051 --data-dir /var/lib/ferry \\
      --agent-id edge-01 --ca-cert /etc/ferry/ca.crt \\
      --client-cert /etc/ferry/edge-01.crt --client-key /etc/ferry/edge-01.key";

/// Examples under `ferry-agent validate --help`.
const VALIDATE_EXAMPLES: &str = "\
Examples:
  ferry-agent validate deploy/examples/edge-sqlite.yaml   # prints ok, exits 0
  FERRY_DATA_DIR=/tmp/ferry ferry-agent validate deploy/examples/edge-sqlite.yaml
      # ${FERRY_DATA_DIR} in the file is expanded from the environment first";

/// Ferry's agent: receivers, routes, outbox, drainers and senders near the brokers.
#[derive(Debug, Parser)]
#[command(name = "ferry-agent", version, about, after_help = EXAMPLES)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The agent's subcommands.
#[derive(Debug, Subcommand)]
// Parsed once per process: the size of `RunArgs` does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Command {
    /// Check a bridge configuration file: `${VAR}` expansion, YAML, and every validation rule.
    /// Prints `ok` and exits 0 when it is valid; otherwise prints each problem on stderr and
    /// exits 2.
    #[command(after_help = VALIDATE_EXAMPLES)]
    Validate(ValidateArgs),
    /// Run until SIGTERM or SIGINT: one bridge from a configuration file (`--config`), or the
    /// bridges a control plane pushes (`--control-plane`, a managed agent). With `--config`, an
    /// invalid configuration exits 2 before any connection is opened; a store that cannot be
    /// opened, or a data directory locked by another running agent (`ferry-agent.lock` beside
    /// the SQLite stores), exits 1. A managed agent exits 1 when its data directory cannot be
    /// created or is locked; a pushed configuration it cannot run is refused (NACK), not fatal.
    /// Missing data directories (of the SQLite stores, `--data-dir`) are created, mode 0700.
    #[command(after_help = RUN_EXAMPLES)]
    Run(Box<RunArgs>),
}

/// Arguments of `ferry-agent run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The bridge configuration file (YAML): a standalone agent.
    #[arg(long, short = 'c', required_unless_present = "control_plane", conflicts_with_all = ["control_plane", "labels", "data_dir"])]
    pub config: Option<PathBuf>,
    /// The control plane's gRPC endpoint, e.g. `http://ferry-cp:50051` (`https://` for TLS,
    /// verified against the system's roots): a managed agent, which runs every configuration
    /// whose selector matches its labels.
    #[arg(long, env = "FERRY_CONTROL_PLANE", requires = "data_dir")]
    pub control_plane: Option<String>,
    /// A label of this managed agent, `key=value`, matched by configuration selectors.
    /// Repeatable.
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// A managed agent's own directory (created when missing): the cache of every ACKed
    /// configuration (`configs/`), from which it starts when the control plane cannot be
    /// reached. Locked like a store directory: one agent per data directory. (No environment
    /// variable: `FERRY_DATA_DIR` is what example configurations expand in their store paths.)
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// How often a managed agent sends its metrics snapshot (counters, outbox depth, lease
    /// and session state) to the control plane, in milliseconds (like the control plane's
    /// `--heartbeat-interval-ms`).
    #[arg(long, env = "FERRY_METRICS_INTERVAL_MS", default_value_t = 5000, value_parser = clap::value_parser!(u64).range(1..))]
    pub metrics_interval_ms: u64,
    /// Address of the admin listener: `/metrics`, `/healthz`, `/readyz` and, with `--config`,
    /// the local gRPC `DlqService`, e.g. `127.0.0.1:9090`. No admin listener when unset.
    #[arg(long)]
    pub admin_listen: Option<std::net::SocketAddr>,
    /// This agent's id: the holder of partition leases and its name at the control plane,
    /// stable across restarts (a restarted agent with the same id fences out its previous run
    /// at once). Default: the host name.
    #[arg(long, env = "FERRY_AGENT_ID")]
    pub agent_id: Option<String>,
    /// Threads that run the agent's async work (its MQTT sessions, drains and listeners).
    /// Default: one per core but one, and at least one; each SQLite store's writer has a
    /// thread of its own beside them (ADR 0017).
    #[arg(long, env = "TOKIO_WORKER_THREADS", value_parser = clap::value_parser!(u16).range(1..))]
    pub worker_threads: Option<u16>,
    /// Logging and span export.
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
    /// TLS and credentials of the admin listener. With `--config` its gRPC `DlqService` needs
    /// `--tokens` and/or `--client-ca`, or `--insecure`; a managed agent's admin listener
    /// serves no RPC and takes only the TLS flags.
    #[command(flatten)]
    pub admin_security: ServerSecurityArgs,
    /// File holding the bearer token this agent presents to the control plane (on its stream,
    /// its lease and DLQ calls); or the token itself in `FERRY_TOKEN`.
    #[arg(long, env = "FERRY_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// PEM CA certificate the control plane's certificate must chain to (`https://`; default:
    /// the system's roots).
    #[arg(long, env = "FERRY_CA_CERT")]
    pub ca_cert: Option<PathBuf>,
    /// PEM client certificate for mTLS; it names this agent with the SAN URI
    /// `ferry://agent/AGENT_ID`.
    #[arg(long, env = "FERRY_CLIENT_CERT", requires = "client_key")]
    pub client_cert: Option<PathBuf>,
    /// PEM private key of `--client-cert`.
    #[arg(long, env = "FERRY_CLIENT_KEY", requires = "client_cert")]
    pub client_key: Option<PathBuf>,
}

impl RunArgs {
    /// The runtime's workers: `--worker-threads`, or one per core but one,
    /// and at least one. The SQLite writers' threads and, on an edge node,
    /// the broker need the last core: on two cores one worker took 5 % less
    /// CPU per fan-out message and 5–22 % less at 1 000 msg/s than two (ADR
    /// 0017, `docs/benchmarks.md`).
    pub fn worker_threads(&self) -> usize {
        self.worker_threads.map_or_else(
            || {
                std::thread::available_parallelism()
                    .map_or(1, |cores| cores.get().saturating_sub(1))
                    .max(1)
            },
            usize::from,
        )
    }

    /// What this agent presents to the control plane: the token of
    /// `--token-file` (else `FERRY_TOKEN`), the CA and the client certificate.
    pub fn client_auth(&self) -> anyhow::Result<ClientAuth> {
        let token = match &self.token_file {
            Some(path) => Some(ClientAuth::read_token_file(path)?),
            None => std::env::var("FERRY_TOKEN").ok(),
        };
        Ok(ClientAuth::new(
            token.as_deref(),
            self.ca_cert.as_deref(),
            self.client_cert.as_deref(),
            self.client_key.as_deref(),
        )?)
    }
}

/// Sets up logging and span export for `ferry-agent run` (inside the runtime).
pub fn telemetry(
    args: &RunArgs,
    config: Option<&ferry_shared::config::Telemetry>,
) -> anyhow::Result<Telemetry> {
    let settings = args
        .telemetry
        .settings("ferry-agent", config, &ProcessEnv)?;
    Ok(ferry_shared::telemetry::init(settings)?)
}

/// `key=value`, both sides non-empty.
fn parse_label(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.is_empty() && !v.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{text:?} is not key=value")),
    }
}

/// Arguments of `ferry-agent validate`.
#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// The configuration file (YAML). `${VAR}` references are expanded from the environment.
    pub file: PathBuf,
}

/// `ferry-agent validate FILE`.
pub fn validate(args: &ValidateArgs) -> ExitCode {
    match check_file(&args.file, &ProcessEnv) {
        Ok(_) => {
            println!("ok");
            ExitCode::SUCCESS
        }
        Err(e) => report_refused(&args.file, &e),
    }
}

/// Prints why the configuration `file` was refused on stderr and returns
/// [`EXIT_INVALID`]: one line when it cannot be read (`ferry-agent: cannot
/// read configuration file X: permission denied`), `X: message` when it does
/// not parse, and one `path: message` line per rule it breaks.
pub fn report_refused(file: &Path, error: &CheckError) -> ExitCode {
    match error {
        CheckError::Load(e @ LoadError::Io { .. }) => eprintln!("ferry-agent: {e}"),
        CheckError::Load(e) => eprintln!("{}: {e}", file.display()),
        CheckError::Invalid(errors) => {
            for e in errors {
                eprintln!("{e}");
            }
        }
    }
    ExitCode::from(EXIT_INVALID)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_args(args: &[&str]) -> Result<RunArgs, clap::Error> {
        let cli = Cli::try_parse_from(std::iter::once("ferry-agent").chain(args.iter().copied()))?;
        match cli.command {
            Command::Run(run) => Ok(*run),
            Command::Validate(_) => panic!("not run"),
        }
    }

    /// The help text of `ferry-agent ARGS --help`.
    fn help(args: &[&str]) -> String {
        let argv = std::iter::once("ferry-agent")
            .chain(args.iter().copied())
            .chain(["--help"]);
        match Cli::try_parse_from(argv) {
            Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelp => e.to_string(),
            other => panic!("expected help, got {other:?}"),
        }
    }

    #[test]
    fn every_help_ends_with_examples() {
        let top = help(&[]);
        assert!(top.contains("Examples:\n  ferry-agent validate "), "{top}");
        assert!(top.contains("ferry-agent run --config "), "{top}");
        assert!(top.contains("ferry-agent run --control-plane "), "{top}");
        let run = help(&["run"]);
        assert!(run.contains("Examples:"), "{run}");
        assert!(
            run.contains("ferry-agent run --config deploy/examples/edge-sqlite.yaml"),
            "{run}"
        );
        assert!(run.contains("ferry-agent run --control-plane "), "{run}");
        let validate = help(&["validate"]);
        assert!(
            validate.contains("Examples:\n  ferry-agent validate "),
            "{validate}"
        );
    }

    /// Every `ferry-agent …` command of the examples is one the parser accepts.
    #[test]
    fn the_examples_parse() {
        for examples in [EXAMPLES, RUN_EXAMPLES, VALIDATE_EXAMPLES] {
            let joined = examples.replace("\\\n", " ");
            for line in joined.lines() {
                let command = line.split(" #").next().unwrap_or_default();
                let words: Vec<&str> = command
                    .split_whitespace()
                    .skip_while(|w| w.contains('='))
                    .collect();
                if words.first() == Some(&"ferry-agent")
                    && let Err(e) = Cli::try_parse_from(&words)
                {
                    panic!("{line}: {e}");
                }
            }
        }
    }

    #[test]
    fn worker_threads_default_to_every_core_but_one() {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let default = run_args(&["run", "-c", "b.yaml"]).expect("parsed");
        // (Unless the test runs with TOKIO_WORKER_THREADS set.)
        if default.worker_threads.is_none() {
            assert_eq!(default.worker_threads(), cores.saturating_sub(1).max(1));
        }
        let given = run_args(&["run", "-c", "b.yaml", "--worker-threads", "3"]).expect("parsed");
        assert_eq!(given.worker_threads(), 3);
        for refused in ["0", "-1", "two", "65536"] {
            let flag = format!("--worker-threads={refused}");
            let error = run_args(&["run", "-c", "b.yaml", &flag])
                .expect_err(refused)
                .to_string();
            assert!(error.contains("--worker-threads"), "{error}");
        }
    }

    #[test]
    fn exactly_one_of_config_and_control_plane() {
        assert!(run_args(&["run"]).is_err());
        assert!(run_args(&["run", "-c", "b.yaml", "--control-plane", "http://cp:1"]).is_err());
        assert!(run_args(&["run", "--control-plane", "http://cp:1"]).is_err());
        assert!(run_args(&["run", "-c", "b.yaml"]).is_ok());
        assert!(run_args(&["run", "-c", "b.yaml", "--data-dir", "d"]).is_err());
    }

    #[test]
    fn labels_are_key_value_pairs() {
        let args = run_args(&[
            "run",
            "--control-plane",
            "http://cp:1",
            "--data-dir",
            "/tmp/x",
            "--label",
            "site=a",
            "--label",
            "zone=b=c",
        ])
        .expect("valid arguments");
        assert_eq!(
            args.labels,
            vec![
                ("site".to_owned(), "a".to_owned()),
                ("zone".to_owned(), "b=c".to_owned())
            ]
        );
        assert!(
            run_args(&[
                "run",
                "--control-plane",
                "u",
                "--data-dir",
                "d",
                "--label",
                "x"
            ])
            .is_err()
        );
    }
}
