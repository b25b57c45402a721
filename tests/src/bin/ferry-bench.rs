//! `ferry-bench`: Ferry's agent beside Mosquitto's bridge, same machine, same run.
//!
//! ```sh
//! cargo build --release -p ferry-agent
//! cargo run --release -p ferry-tests --bin ferry-bench -- [--messages N] [--rate R] [--scenario S]
//! ```
//!
//! Runs, in order (each with fresh brokers): `fan-out` — bridge x3 and Ferry `shared_outbox` x3,
//! N messages flat out; `direct` — bridge x1 and Ferry `direct_hold`, flat out; `latency` —
//! bridge x3 and `shared_outbox` x3 at R messages per second. Prints a table of the runs (with
//! the agent's CPU µs per message) and the floors of issue 3. `--callgrind` instead runs only
//! the agent, under Callgrind, and prints its instructions per message. See
//! `docs/benchmarks.md`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use ferry_tests::bench::callgrind;
use ferry_tests::bench::ferry::{self, FerryRoute, FerryTuning};
use ferry_tests::bench::payload::Clock;
use ferry_tests::bench::publisher::Pace;
use ferry_tests::bench::report::{self, Verdict};
use ferry_tests::bench::scenario::{self, Contender, RunSpec, Settings};
use ferry_tests::otlp::TraceReceiver;

/// Benchmark Ferry's agent against Mosquitto's bridge between two local Mosquitto brokers.
#[derive(Debug, Parser)]
#[command(name = "ferry-bench")]
struct Cli {
    /// Messages per throughput run (published flat out).
    #[arg(long, default_value_t = 20_000)]
    messages: u64,
    /// Messages per second in the latency runs.
    #[arg(long, default_value_t = 1_000)]
    rate: u32,
    /// Length of the latency runs, in seconds.
    #[arg(long, default_value_t = 10)]
    rate_seconds: u64,
    /// Which comparisons to run (repeat the flag for several).
    #[arg(long, value_enum, default_values_t = [Scenario::All])]
    scenario: Vec<Scenario>,
    /// The ferry-agent binary (default: next to this executable, or $FERRY_BIN_DIR).
    #[arg(long)]
    agent: Option<PathBuf>,
    /// Only Mosquitto's bridge (for example while the agent cannot `run` yet).
    #[arg(long)]
    baseline_only: bool,
    /// Directory for the agent's SQLite files (default: the system temporary directory).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// The Ferry routes' `policy.max_in_flight`.
    #[arg(long, default_value_t = FerryTuning::default().max_in_flight)]
    max_in_flight: u32,
    /// The shared_outbox route's `policy.max_outbox_depth`.
    #[arg(long, default_value_t = FerryTuning::default().max_outbox_depth)]
    max_outbox_depth: u32,
    /// The shared_outbox route's `session.drain_batch_size`.
    #[arg(long, default_value_t = FerryTuning::default().drain_batch_size)]
    drain_batch_size: u32,
    /// An extra `mosquitto.conf` line for every broker (repeatable), e.g.
    /// `--broker-config "max_queued_messages 1000000"`.
    #[arg(long)]
    broker_config: Vec<String>,
    /// Keep each Ferry run's directory (configuration, agent output, SQLite files, /metrics).
    #[arg(long)]
    keep: bool,
    /// Longest wait for every message to arrive after the last publish, in seconds.
    #[arg(long, default_value_t = 120)]
    deliver_timeout: u64,
    /// Run only the agent, under `valgrind --tool=callgrind`, and report its instructions per
    /// message (fan-out and direct; no bridge, no floors).
    #[arg(long)]
    callgrind: bool,
    /// Messages per run with --callgrind (Callgrind is about fifty times slower).
    #[arg(long, default_value_t = 2_000)]
    callgrind_messages: u64,
    /// Tracing on: the agent exports every span (sampling 1.0) to an OTLP sink in this
    /// process that only counts them.
    #[arg(long)]
    trace: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Scenario {
    /// fan-out, direct and latency.
    All,
    /// Bridge x3 vs shared_outbox x3, flat out.
    FanOut,
    /// Bridge x1 vs direct_hold, flat out.
    Direct,
    /// Bridge x3 vs shared_outbox x3 at the fixed rate.
    Latency,
}

impl Cli {
    fn wants(&self, scenario: Scenario) -> bool {
        self.scenario.contains(&Scenario::All) || self.scenario.contains(&scenario)
    }

    fn runs(&self, with_ferry: bool) -> Vec<RunSpec> {
        if self.callgrind {
            return self.callgrind_runs();
        }
        let flat_out = |contender| RunSpec {
            contender,
            messages: self.messages,
            pace: Pace::FlatOut,
        };
        let paced = |contender| RunSpec {
            contender,
            messages: u64::from(self.rate) * self.rate_seconds,
            pace: Pace::Rate(self.rate),
        };
        let mut runs = Vec::new();
        let mut pair = |bridge: RunSpec, ferry: RunSpec| {
            runs.push(bridge);
            if with_ferry {
                runs.push(ferry);
            }
        };
        if self.wants(Scenario::FanOut) {
            pair(
                flat_out(Contender::Bridge { connections: 3 }),
                flat_out(Contender::Ferry(FerryRoute::SharedOutbox)),
            );
        }
        if self.wants(Scenario::Direct) {
            pair(
                flat_out(Contender::Bridge { connections: 1 }),
                flat_out(Contender::Ferry(FerryRoute::DirectHold)),
            );
        }
        if self.wants(Scenario::Latency) {
            pair(
                paced(Contender::Bridge { connections: 3 }),
                paced(Contender::Ferry(FerryRoute::SharedOutbox)),
            );
        }
        runs
    }

    /// The agent's flat-out runs, without the bridge (its instructions are not counted).
    fn callgrind_runs(&self) -> Vec<RunSpec> {
        [
            (Scenario::FanOut, FerryRoute::SharedOutbox),
            (Scenario::Direct, FerryRoute::DirectHold),
        ]
        .into_iter()
        .filter(|(scenario, _)| self.wants(*scenario))
        .map(|(_, route)| RunSpec {
            contender: Contender::Ferry(route),
            messages: self.callgrind_messages,
            pace: Pace::FlatOut,
        })
        .collect()
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    if cli.callgrind {
        if cli.baseline_only {
            eprintln!("--callgrind measures the agent: it cannot be combined with --baseline-only");
            return ExitCode::FAILURE;
        }
        if cli.callgrind_runs().is_empty() {
            eprintln!(
                "--callgrind counts the flat-out runs only: add --scenario fan-out or --scenario direct"
            );
            return ExitCode::FAILURE;
        }
        if let Err(error) = callgrind::check_installed() {
            eprintln!("{error:#}");
            return ExitCode::FAILURE;
        }
    }
    let agent = if cli.baseline_only {
        None
    } else {
        match ferry::agent_binary(cli.agent.as_deref()) {
            Ok(binary) if ferry::has_run_command(&binary) => Some(binary),
            Ok(binary) => {
                eprintln!(
                    "{} has no `run` command yet: measuring the bridge only",
                    binary.display()
                );
                None
            }
            Err(error) => {
                eprintln!("{error:#}: measuring the bridge only");
                None
            }
        }
    };
    let sink = if cli.trace {
        match TraceReceiver::start_counting().await {
            Ok(sink) => Some(sink),
            Err(error) => {
                eprintln!("cannot start the OTLP sink: {error:#}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        None
    };
    let settings = Settings {
        agent: agent.clone(),
        tuning: FerryTuning {
            max_in_flight: cli.max_in_flight,
            max_outbox_depth: cli.max_outbox_depth,
            drain_batch_size: cli.drain_batch_size,
        },
        data_dir: cli.data_dir.clone(),
        deliver_timeout: Duration::from_secs(cli.deliver_timeout),
        keep: cli.keep,
        broker_config: cli.broker_config.clone(),
        callgrind: cli.callgrind,
        otlp_endpoint: sink.as_ref().map(|s| s.endpoint().to_owned()),
    };
    let clock = Clock::new();
    let mut results = Vec::new();
    for spec in cli.runs(agent.is_some()) {
        eprintln!(
            "run: {} {}, {} messages",
            spec.contender.label(),
            spec.pace_label(),
            spec.messages
        );
        let result = scenario::run(spec, &settings, clock).await;
        if let Some(error) = &result.error {
            eprintln!("  incomplete: {error}");
        }
        results.push(result);
    }

    println!();
    print!("{}", report::runs_table(&results));
    if let Some(sink) = &sink {
        println!("\nspans received by the OTLP sink: {}", sink.count());
    }
    if cli.callgrind {
        return if results.iter().all(|r| r.instructions.is_some()) {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    println!();
    let floors = report::floors(&results);
    print!("{}", report::floors_table(&floors));
    if agent.is_none() {
        println!("\nFerry half pending: no ferry-agent with a `run` command was found.");
    }
    let missed = floors
        .iter()
        .any(|f| f.binding && f.verdict == Verdict::Fail);
    if missed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
