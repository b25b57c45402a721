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
