//! The command line: `ferry-agent <command>`.
//!
//! Subcommands are a clap enum so that `run` (and others) can join `validate` later.

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
    /// Run a bridge from a configuration file until SIGTERM or SIGINT. An invalid
    /// configuration exits 2 before any connection is opened; a store that cannot be opened,
    /// or a data directory locked by another running agent (`ferry-agent.lock` beside the
    /// SQLite stores), exits 1.
    Run(RunArgs),
}

/// Arguments of `ferry-agent run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The bridge configuration file (YAML).
    #[arg(long, short = 'c')]
    pub config: PathBuf,
    /// Address of the admin listener: `/metrics`, `/healthz`, `/readyz` and the local gRPC
    /// `DlqService`, e.g. `127.0.0.1:9090`. No admin listener when unset.
    #[arg(long)]
    pub admin_listen: Option<std::net::SocketAddr>,
    /// This agent's id: the holder of partition leases, stable across restarts (a restarted
    /// agent with the same id fences out its previous run at once). Default: the host name.
    #[arg(long, env = "FERRY_AGENT_ID")]
    pub agent_id: Option<String>,
    /// Log filter (tracing `EnvFilter` syntax). Default: `info`, or `RUST_LOG` when set.
    #[arg(long)]
    pub log: Option<String>,
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
