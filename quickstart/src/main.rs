//! `ferry`: Ferry's front door. `ferry quickstart` runs a control plane, two
//! embedded MQTT brokers and one managed agent in this one process, applies
//! a bridge that fans sensor readings out to three destinations through a
//! SQLite outbox, publishes readings, stages an upstream outage and shows
//! what happens, live, until Ctrl-C ([`run`]).
#![forbid(unsafe_code)]

mod brokers;
mod fleet;
mod listener;
mod outage;
mod run;
mod tally;
mod traffic;
mod view;

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

/// Ferry: a message bridge for the edge.
#[derive(Debug, Parser)]
#[command(name = "ferry", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Watch Ferry work, with nothing installed: a control plane, two MQTT brokers (plant and
    /// upstream) and a managed agent in this process; sensor readings fanned out to three
    /// destinations through a SQLite outbox; an upstream outage midway. Ctrl-C stops it, prints
    /// a summary and removes everything it created.
    #[command(
        after_help = "Example:\n  cargo run --release --bin ferry -- quickstart\n  \
        ferry quickstart --rate 50 --outage-after 5s --outage-for 3s --duration 20s"
    )]
    Quickstart(QuickstartArgs),
}

#[derive(Debug, Args)]
struct QuickstartArgs {
    /// Readings published per second.
    #[arg(long, default_value_t = 20.0, value_parser = parse_rate)]
    rate: f64,
    /// Stop after this long, as on Ctrl-C (`30s`, `2m`). Default: until Ctrl-C.
    #[arg(long, value_parser = parse_duration)]
    duration: Option<Duration>,
    /// When the upstream listener goes down, counted from the first reading.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    outage_after: Duration,
    /// How long the upstream listener stays down; `0s` for no outage.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    outage_for: Duration,
    /// Keep the temporary directory (state, outbox, log) and print its path.
    #[arg(long)]
    keep: bool,
    /// Log filter for the log file in the temporary directory (tracing `EnvFilter` syntax).
    /// The embedded brokers' own log is off by default: rumqttd reports every client
    /// disconnect as an error (`--log info` shows it).
    #[arg(long, default_value = "info,rumqttd=off")]
    log: String,
}

fn main() -> ExitCode {
    let started = std::time::Instant::now();
    match Cli::parse().command {
        Command::Quickstart(args) => quickstart(&args, started),
    }
}

fn quickstart(args: &QuickstartArgs, started: std::time::Instant) -> ExitCode {
    let dir = match tempfile::Builder::new()
        .prefix("ferry-quickstart-")
        .tempdir()
    {
        Ok(dir) => dir,
        Err(error) => {
            eprintln!(
                "ferry quickstart: cannot create a temporary directory: {error} (set TMPDIR to a writable directory)"
            );
            return ExitCode::FAILURE;
        }
    };
    let mut screen = view::Screen::stdout();
    let outcome = (|| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?;
        let options = run::Options {
            rate: args.rate,
            duration: args.duration,
            outage_after: args.outage_after,
            outage_for: args.outage_for,
            started,
        };
        let outcome = runtime.block_on(async {
            let telemetry = init_telemetry(dir.path(), &args.log)?;
            let outcome = run::run(&options, dir.path(), &mut screen).await;
            telemetry.shutdown().await;
            outcome
        });
        // Every task (and with it every store) ends before the directory goes.
        runtime.shutdown_timeout(Duration::from_secs(2));
        outcome
    })();
    let path = dir.path().display().to_string();
    if args.keep {
        let _kept = dir.keep();
        screen.event(&format!("kept {path}"));
    } else {
        match dir.close() {
            Ok(()) => screen.event(&format!("removed {path}")),
            Err(error) => eprintln!("ferry quickstart: removing {path}: {error}"),
        }
    }
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("ferry quickstart: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Logs go to `ferry.log` in `dir`: the live view owns the terminal. Spans
/// are exported when `OTEL_EXPORTER_OTLP_ENDPOINT` names a collector.
fn init_telemetry(dir: &Path, filter: &str) -> anyhow::Result<ferry_shared::telemetry::Telemetry> {
    let file = std::fs::File::create(dir.join("ferry.log"))?;
    let mut settings = ferry_shared::telemetry::Settings::new("ferry-quickstart")
        .with_env(&ferry_shared::config::ProcessEnv)?;
    settings.log_filter = Some(filter.to_owned());
    settings.log_writer =
        tracing_subscriber::fmt::writer::BoxMakeWriter::new(std::sync::Mutex::new(file));
    settings.ansi = false;
    Ok(ferry_shared::telemetry::init(settings)?)
}

fn parse_rate(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(rate) if (0.1..=10_000.0).contains(&rate) => Ok(rate),
        _ => Err(format!(
            "{text:?} is not a rate between 0.1 and 10000 readings per second"
        )),
    }
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    text.parse::<ferry_shared::config::Duration>()
        .map(Duration::from)
        .map_err(|e| format!("{text:?}: {e} (for example 500ms, 10s, 2m)"))
}
