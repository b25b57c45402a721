//! `ferry-agent`: runs Ferry's receivers, routes, outbox writers and drainers near the brokers.
//!
//! Subcommands ([`cli`]): `validate FILE` runs the shared configuration loader and validator
//! on a file; `run --config FILE` runs the bridge standalone until SIGTERM or SIGINT ([`run`]).
#![forbid(unsafe_code)]

#[cfg(feature = "jemalloc")]
mod allocator;
mod cli;
mod run;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    match &cli.command {
        cli::Command::Validate(args) => cli::validate(args),
        cli::Command::Run(args) => run::main(args),
    }
}
