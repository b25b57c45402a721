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
//! the agent's CPU µs per message, the brokers' and its own) and the floors of issue 3.
//! `--callgrind` instead runs only the agent, under Callgrind, and prints its instructions per
//! message. `--store` chooses the shared_outbox runs' stores (several: side by side, issue 19).
//! `ferry-bench relay` instead relays a PostgreSQL outbox table to JetStream and RabbitMQ,
//! Ferry beside a minimal relay (issue 20). See `docs/benchmarks.md`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use ferry_tests::bench::callgrind;
use ferry_tests::bench::ferry::{self, FerryRoute, FerryTuning, Store};
use ferry_tests::bench::payload::Clock;
use ferry_tests::bench::publisher::Pace;
use ferry_tests::bench::relay::target::Target;
use ferry_tests::bench::relay::{self, RelaySettings, RelaySpec, Relayer};
use ferry_tests::bench::report::{self, Verdict};
use ferry_tests::bench::scenario::{self, Contender, RunSpec, Settings};
use ferry_tests::otlp::TraceReceiver;

/// Benchmark Ferry's agent against Mosquitto's bridge between two local Mosquitto brokers.
#[derive(Debug, Parser)]
#[command(name = "ferry-bench")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
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
    /// Where the shared_outbox runs keep their outbox, lease and DLQ; several, comma-separated
    /// (`--store sqlite,postgres`), run each shared_outbox scenario once per store and print
    /// them side by side. postgres: a fresh database per run on $FERRY_TEST_PG; dynamodb: fresh
    /// tables on moto ($FERRY_VENV or $FERRY_TEST_MOTO_URL).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [StoreArg::Sqlite])]
    store: Vec<StoreArg>,
    /// The ferry-agent binary (default: next to this executable, or $FERRY_BIN_DIR).
    #[arg(long, global = true)]
    agent: Option<PathBuf>,
    /// Only Mosquitto's bridge (for example while the agent cannot `run` yet).
    #[arg(long)]
    baseline_only: bool,
    /// Directory for the agent's SQLite files (default: the system temporary directory).
    #[arg(long, global = true)]
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
    /// The agent reaches broker A through a Unix socket (`unix://`) instead of TCP, as an agent
    /// running beside its broker may; the bridge, the publisher and the collectors stay on TCP.
    #[arg(long)]
    source_socket: bool,
    /// Keep each Ferry run's directory (configuration, agent output, SQLite files, /metrics).
    #[arg(long, global = true)]
    keep: bool,
    /// Longest wait for every message to arrive after the last publish, in seconds.
    #[arg(long, global = true, default_value_t = 120)]
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

#[derive(Debug, Subcommand)]
enum Command {
    /// Relay an outbox table in PostgreSQL to NATS JetStream and RabbitMQ: Ferry's agent
    /// (postgres_table receiver, direct_hold) beside a minimal relay doing what seed 002's does,
    /// rows per second pre-filled and commit-to-delivery latency at a fixed rate (issue 20).
    Relay(RelayArgs),
}

#[derive(Debug, Args)]
struct RelayArgs {
    /// Rows pre-filled in one transaction for the throughput runs.
    #[arg(long, default_value_t = 10_000)]
    rows: u64,
    /// Rows per second written in the latency runs (each its own transaction).
    #[arg(long, default_value_t = 1_000)]
    rate: u32,
    /// Length of the latency runs, in seconds.
    #[arg(long, default_value_t = 10)]
    rate_seconds: u64,
    /// Destinations, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [TargetArg::Nats, TargetArg::Rabbitmq])]
    to: Vec<TargetArg>,
    /// Both relays' wait between polls that found nothing, in milliseconds.
    #[arg(long, default_value_t = 100)]
    poll_interval_ms: u64,
    /// Ferry's receiver `batch_size`.
    #[arg(long, default_value_t = 100)]
    batch_size: u32,
    /// Ferry's route `policy.max_in_flight`.
    #[arg(long, default_value_t = FerryTuning::default().max_in_flight)]
    max_in_flight: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum TargetArg {
    Nats,
    Rabbitmq,
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum StoreArg {
    Sqlite,
    Postgres,
    Dynamodb,
}

impl From<StoreArg> for Store {
    fn from(store: StoreArg) -> Self {
        match store {
            StoreArg::Sqlite => Store::Sqlite,
            StoreArg::Postgres => Store::Postgres,
            StoreArg::Dynamodb => Store::Dynamodb,
        }
    }
}

impl Cli {
    /// The stores asked for, each once, in the order given.
    fn stores(&self) -> Vec<Store> {
        let mut stores: Vec<Store> = Vec::new();
        for store in self.store.iter().map(|&s| Store::from(s)) {
            if !stores.contains(&store) {
                stores.push(store);
            }
        }
        stores
    }

    fn wants(&self, scenario: Scenario) -> bool {
        self.scenario.contains(&Scenario::All) || self.scenario.contains(&scenario)
    }

    fn runs(&self, with_ferry: bool) -> Vec<RunSpec> {
        if self.callgrind {
            return self.callgrind_runs();
        }
        let flat_out = |contender, store| RunSpec {
            contender,
            messages: self.messages,
            pace: Pace::FlatOut,
            store,
        };
        let paced = |contender, store| RunSpec {
            contender,
            messages: u64::from(self.rate) * self.rate_seconds,
            pace: Pace::Rate(self.rate),
            store,
        };
        let stores = self.stores();
        let mut runs = Vec::new();
        // The bridge, then Ferry once per store (the direct_hold route has no outbox: once).
        let mut group = |spec: &dyn Fn(Contender, Store) -> RunSpec,
                         bridge: usize,
                         route: FerryRoute| {
            runs.push(spec(
                Contender::Bridge {
                    connections: bridge,
                },
                Store::Sqlite,
            ));
            if !with_ferry {
                return;
            }
            match route {
                FerryRoute::SharedOutbox => runs.extend(
                    stores
                        .iter()
                        .map(|&store| spec(Contender::Ferry(route), store)),
                ),
                FerryRoute::DirectHold => runs.push(spec(Contender::Ferry(route), Store::Sqlite)),
            }
        };
        if self.wants(Scenario::FanOut) {
            group(&flat_out, 3, FerryRoute::SharedOutbox);
        }
        if self.wants(Scenario::Direct) {
            group(&flat_out, 1, FerryRoute::DirectHold);
        }
        if self.wants(Scenario::Latency) {
            group(&paced, 3, FerryRoute::SharedOutbox);
        }
        runs
    }

    /// The agent's flat-out runs, without the bridge (its instructions are not counted), on
    /// the first store asked for.
    fn callgrind_runs(&self) -> Vec<RunSpec> {
        let store = self.stores().first().copied().unwrap_or(Store::Sqlite);
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
            store,
        })
        .collect()
    }
}

/// The agent binary with a `run` command, or why there is none.
fn find_agent(explicit: Option<&std::path::Path>) -> Option<PathBuf> {
    match ferry::agent_binary(explicit) {
        Ok(binary) if ferry::has_run_command(&binary) => Some(binary),
        Ok(binary) => {
            eprintln!("{} has no `run` command yet", binary.display());
            None
        }
        Err(error) => {
            eprintln!("{error:#}");
            None
        }
    }
}

/// `ferry-bench relay`: per destination, Ferry then the minimal relay, flat out then at the
/// fixed rate.
async fn relay_main(cli: &Cli, args: &RelayArgs) -> ExitCode {
    let agent = find_agent(cli.agent.as_deref());
    if agent.is_none() {
        eprintln!("measuring the minimal relay only");
    }
    let settings = RelaySettings {
        agent: agent.clone(),
        poll_interval: Duration::from_millis(args.poll_interval_ms.max(1)),
        batch_size: args.batch_size,
        max_in_flight: args.max_in_flight,
        data_dir: cli.data_dir.clone(),
        keep: cli.keep,
        deliver_timeout: Duration::from_secs(cli.deliver_timeout),
    };
    let mut targets = Vec::new();
    for target in args.to.iter().map(|&t| match t {
        TargetArg::Nats => Target::Nats,
        TargetArg::Rabbitmq => Target::Rabbitmq,
    }) {
        if !targets.contains(&target) {
            targets.push(target);
        }
    }
    let relayers: &[Relayer] = if agent.is_some() {
        &[Relayer::Ferry, Relayer::Minimal]
    } else {
        &[Relayer::Minimal]
    };
    let paces = [
        (args.rows, Pace::FlatOut),
        (
            u64::from(args.rate) * args.rate_seconds,
            Pace::Rate(args.rate),
        ),
    ];
    let clock = Clock::new();
    let mut results = Vec::new();
    for &target in &targets {
        for &(rows, pace) in &paces {
            for &relayer in relayers {
                let spec = RelaySpec {
                    target,
                    relayer,
                    rows,
                    pace,
                };
                eprintln!("run: {spec:?}");
                let result = relay::run(spec, &settings, clock).await;
                if let Some(error) = &result.error {
                    eprintln!("  incomplete: {error}");
                }
                results.push(result);
            }
        }
    }
    println!();
    print!("{}", relay::report(&results));
    if results.iter().all(relay::RelayResult::complete) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Command::Relay(args)) = &cli.command {
        return relay_main(&cli, args).await;
    }
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
        let agent = find_agent(cli.agent.as_deref());
        if agent.is_none() {
            eprintln!("measuring the bridge only");
        }
        agent
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
        source_socket: cli.source_socket,
        callgrind: cli.callgrind,
        otlp_endpoint: sink.as_ref().map(|s| s.endpoint().to_owned()),
    };
    let clock = Clock::new();
    let mut results = Vec::new();
    for spec in cli.runs(agent.is_some()) {
        eprintln!(
            "run: {} {}, {} messages",
            spec.label(),
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
    if cli.source_socket {
        println!("The agent reached broker A through its Unix socket (--source-socket).\n");
    }
    print!("{}", report::runs_table(&results));
    let stores = report::stores_table(&results);
    if !stores.is_empty() {
        println!("\nshared_outbox x3 by store (issue 19):");
        print!("{stores}");
    }
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
