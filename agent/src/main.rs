//! `ferry-agent`: runs Ferry's receivers, routes, outbox writers and drainers near the brokers.
//!
//! Subcommands ([`cli`]): `validate FILE` runs the shared configuration loader and validator
//! on a file; `run --config FILE` runs the bridge standalone until SIGTERM or SIGINT ([`run`]).
#![forbid(unsafe_code)]

mod cli;
mod run;

use std::process::ExitCode;

use clap::Parser;

/// jemalloc, not the C library's `malloc` (ADR 0016): the agent's records and
/// messages are allocated on one thread and freed on another (the SQLite
/// writer, the Tokio workers), which empties glibc's per-thread caches; a
/// fan-out spent a fifth of its instructions in `malloc` and `free`. Its
/// settings are compiled in (`.cargo/config.toml`).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    match &cli.command {
        cli::Command::Validate(args) => cli::validate(args),
        cli::Command::Run(args) => run::main(args),
    }
}

#[cfg(test)]
mod tests {
    /// The settings of `.cargo/config.toml` reached the build: the memory
    /// figures of `docs/benchmarks.md` were measured with them, and jemalloc's
    /// defaults (an arena per core and a half, 32 KiB thread caches) cost the
    /// agent about 4 MiB more.
    #[test]
    fn jemalloc_runs_with_the_measured_settings() {
        if std::env::var_os("_RJEM_MALLOC_CONF").is_some() {
            return; // overridden on purpose
        }
        assert_eq!(
            tikv_jemalloc_ctl::opt::narenas::read().expect("opt.narenas"),
            1
        );
        assert_eq!(
            tikv_jemalloc_ctl::opt::tcache_max::read().expect("opt.tcache_max"),
            1024
        );
    }
}
