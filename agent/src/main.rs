//! `ferry-agent`: runs Ferry's receivers, routes, outbox writers and drainers near the brokers.
//!
//! For now the binary has one subcommand, `validate FILE`, which runs the shared configuration
//! loader and validator (`ferry_shared::config`) on a file; see [`cli`].
#![forbid(unsafe_code)]

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    match &cli.command {
        cli::Command::Validate(args) => cli::validate(args),
    }
}
