//! The command line: `ferry-agent <command>`.
//!
//! Subcommands are a clap enum: `validate FILE`, and `run` standalone (`--config FILE`) or
//! managed (`--control-plane URL`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use ferry_shared::config::{CheckError, ProcessEnv, check_file};

/// Exit status of a configuration that did not load or did not validate.
pub const EXIT_INVALID: u8 = 2;

/// Ferry's agent: receivers, routes, outbox, drainers and senders near the brokers.
#[derive(Debug, Parser)]
#[command(name = "ferry-agent", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The agent's subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Check a bridge configuration file: `${VAR}` expansion, YAML, and every validation rule.
    /// Prints `ok` and exits 0 when it is valid; otherwise prints each problem on stderr and
    /// exits 2.
    Validate(ValidateArgs),
    /// Run until SIGTERM or SIGINT: one bridge from a configuration file (`--config`), or the
    /// bridges a control plane pushes (`--control-plane`, a managed agent). With `--config`, an
    /// invalid configuration exits 2 before any connection is opened; a store that cannot be
    /// opened, or a data directory locked by another running agent (`ferry-agent.lock` beside
    /// the SQLite stores), exits 1. A managed agent exits 1 when its data directory cannot be
    /// created or is locked; a pushed configuration it cannot run is refused (NACK), not fatal.
    Run(RunArgs),
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
    /// Log filter (tracing `EnvFilter` syntax). Default: `info`, or `RUST_LOG` when set.
    #[arg(long)]
    pub log: Option<String>,
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
        Err(CheckError::Load(e)) => {
            eprintln!("{}: {e}", args.file.display());
            ExitCode::from(EXIT_INVALID)
        }
        Err(CheckError::Invalid(errors)) => {
            for e in &errors {
                eprintln!("{e}");
            }
            ExitCode::from(EXIT_INVALID)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_args(args: &[&str]) -> Result<RunArgs, clap::Error> {
        let cli = Cli::try_parse_from(std::iter::once("ferry-agent").chain(args.iter().copied()))?;
        match cli.command {
            Command::Run(run) => Ok(run),
            Command::Validate(_) => panic!("not run"),
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
