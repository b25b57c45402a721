//! `ferry-bench relay`: an application's outbox table in PostgreSQL relayed to NATS JetStream
//! and to RabbitMQ, by Ferry's agent (`postgres_table` receiver, `direct_hold` route) and by a
//! [`minimal`] relay that does what seed 002's does, in the same invocation (issue 20).
//!
//! Each run gets a fresh database with the outbox table ([`table`]) and a fresh stream or queue
//! whose consumer counts every row by number ([`target`]). The relay starts; a probe row is
//! written until it arrives (so every connection on the path is up); then the measured phase:
//!
//! - **flat out**: `rows` rows inserted in one transaction; rows per second = rows ÷ (last
//!   arrival − the commit's return). The relays poll every `poll_interval` when idle, so up to
//!   one interval of the window is waiting for the first poll, alike for both;
//! - **fixed rate**: `rate` rows per second for `rate_seconds`, each row its own transaction,
//!   stamped just before its INSERT is sent; latency = first arrival − stamp (commit-to-delivery,
//!   the commit included), p50 / p99 / max over every row.
//!
//! A run is complete when every row arrived (duplicates are counted, not required absent) and
//! every row has `sent_at` set: nothing relayed is left unmarked, nothing is lost. Ferry's
//! route is `direct_hold`: a row is marked sent once the destination took it, which is what the
//! minimal relay does; with `max_in_flight` sends outstanding at once where the minimal relay
//! has one.

pub mod minimal;
pub mod table;
pub mod target;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::time::{Instant, sleep};

use self::minimal::MinimalRelay;
use self::target::{Destination, Target};
use super::collector::Tally;
use super::ferry::{self, Agent};
use super::latency::LatencySummary;
use super::payload::Clock;
use super::publisher::Pace;
use crate::TestDatabase;

/// How long the warm-up may take.
const WARM_UP_TIMEOUT: Duration = Duration::from_secs(30);
/// Time between two warm-up probe rows.
const PROBE_INTERVAL: Duration = Duration::from_millis(200);
/// A run fails when nothing new arrives for this long.
const STALL_LIMIT: Duration = Duration::from_secs(20);
/// How often delivery progress is checked.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(20);

/// What relays the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Relayer {
    /// `ferry-agent run` with a `postgres_table` receiver and a `direct_hold` route.
    Ferry,
    /// The [`minimal`] relay (seed 002's loop).
    Minimal,
}

impl Relayer {
    fn label(self) -> &'static str {
        match self {
            Self::Ferry => "ferry direct_hold",
            Self::Minimal => "minimal relay",
        }
    }
}

/// One run to make.
#[derive(Debug, Clone, Copy)]
pub struct RelaySpec {
    pub target: Target,
    pub relayer: Relayer,
    pub rows: u64,
    /// `FlatOut`: the rows pre-filled in one transaction; `Rate`: written at that rate.
    pub pace: Pace,
}

/// Settings shared by every relay run.
#[derive(Debug, Clone)]
pub struct RelaySettings {
    /// The agent binary (None: the Ferry runs are skipped).
    pub agent: Option<PathBuf>,
    /// Both relays' wait between polls that found nothing (Ferry's `poll_interval`).
    pub poll_interval: Duration,
    /// Ferry's `batch_size` (rows claimed at once).
    pub batch_size: u32,
    /// Ferry's `policy.max_in_flight`.
    pub max_in_flight: u32,
    /// Where the agent's run directories go (default: the system temporary directory).
    pub data_dir: Option<PathBuf>,
    /// Keep each Ferry run's directory.
    pub keep: bool,
    /// Longest wait for every row after the last is written.
    pub deliver_timeout: Duration,
}

/// The outcome of a run.
#[derive(Debug, Clone)]
pub struct RelayResult {
    pub spec: RelaySpec,
    pub tally: Tally,
    /// Clock time the measured window starts: the pre-fill's commit, or the first write.
    pub start_ns: Option<u64>,
    /// Rows without `sent_at` at the end.
    pub unsent: Option<u64>,
    /// Why the run is incomplete, if it is.
    pub error: Option<String>,
}

impl RelayResult {
    /// Distinct rows per second from the window's start to the last arrival.
    pub fn throughput(&self) -> Option<f64> {
        let span = self.tally.last_ns?.checked_sub(self.start_ns?)?;
        (span > 0).then(|| self.tally.distinct as f64 * 1e9 / span as f64)
    }

    /// True when every row arrived and every row is marked sent.
    pub fn complete(&self) -> bool {
        self.error.is_none() && self.tally.missing() == 0 && self.unsent == Some(0)
    }
}

/// Makes one run; an error is recorded in the result, with whatever was measured.
pub async fn run(spec: RelaySpec, settings: &RelaySettings, clock: Clock) -> RelayResult {
    let mut result = RelayResult {
        spec,
        tally: Tally::default(),
        start_ns: None,
        unsent: None,
        error: None,
    };
    let destination = match Destination::create(spec.target, clock).await {
        Ok(destination) => destination,
        Err(error) => {
            result.error = Some(format!("{error:#}"));
            return result;
        }
    };
    if let Err(error) = measure(&mut result, &destination, settings, clock).await {
        result.error = Some(format!("{error:#}"));
    }
    result.tally = destination.tally().snapshot();
    destination.delete().await;
    result
}

/// Either relay, running.
enum Running {
    Ferry(Agent),
    Minimal(MinimalRelay),
}

impl Running {
    async fn check(&mut self) -> anyhow::Result<()> {
        match self {
            Self::Ferry(agent) => agent.check_running(),
            Self::Minimal(relay) => relay.check_running().await,
        }
    }

    async fn stop(self) -> anyhow::Result<()> {
        match self {
            Self::Ferry(agent) => agent.stop().await,
            Self::Minimal(relay) => relay.stop().await,
        }
    }
}

/// The body of [`run`]: everything it starts is stopped when it returns.
async fn measure(
    result: &mut RelayResult,
    destination: &Destination,
    settings: &RelaySettings,
    clock: Clock,
) -> anyhow::Result<()> {
    let spec = result.spec;
    let database = TestDatabase::create().await?;
    let app = table::create(&database).await?;
    let run_dir = super::scenario::tempdir(settings.data_dir.as_deref())?;
    let mut relay = match spec.relayer {
        Relayer::Ferry => {
            let binary = settings
                .agent
                .as_deref()
                .context("no ferry-agent with a `run` command")?;
            let (host, port) = database.server_address()?;
            let yaml = config(
                &format!("postgres://{host}:{port}/{}", database.name()),
                spec.target,
                &destination.address(),
                settings,
                run_dir.path(),
            );
            let config_path = run_dir.path().join("relay.yaml");
            std::fs::write(&config_path, yaml).context("writing the agent's configuration")?;
            ferry::validate(binary, &config_path)?;
            Running::Ferry(Agent::start(
                binary,
                &config_path,
                run_dir.path(),
                &[],
                false,
            )?)
        }
        Relayer::Minimal => Running::Minimal(
            MinimalRelay::start(
                &database,
                destination.publisher().await?,
                settings.poll_interval,
            )
            .await?,
        ),
    };
    let outcome = relay_rows(
        result,
        destination,
        &database,
        &app,
        &mut relay,
        settings,
        clock,
    )
    .await;
    let stopped = relay.stop().await;
    if settings.keep && spec.relayer == Relayer::Ferry {
        eprintln!("  kept {}", run_dir.keep().display());
    }
    outcome?;
    stopped
}

/// Warm-up, the measured phase, and the final check of the table.
async fn relay_rows(
    result: &mut RelayResult,
    destination: &Destination,
    database: &TestDatabase,
    app: &tokio_postgres::Client,
    relay: &mut Running,
    settings: &RelaySettings,
    clock: Clock,
) -> anyhow::Result<()> {
    let spec = result.spec;
    let tally = destination.tally();
    let deadline = Instant::now() + WARM_UP_TIMEOUT;
    while tally.probes() == 0 {
        if Instant::now() >= deadline {
            bail!("warm-up: no probe row arrived within {WARM_UP_TIMEOUT:?}");
        }
        relay.check().await?;
        destination.check_running()?;
        table::insert_probe(app).await?;
        sleep(PROBE_INTERVAL).await;
    }
    // Probes still in flight are counted as probes, not as rows.
    tally.arm(spec.rows);
    match spec.pace {
        Pace::FlatOut => {
            let committed = table::prefill(app, spec.rows, clock).await?;
            result.start_ns = Some(committed);
        }
        Pace::Rate(rate) => {
            result.start_ns = Some(clock.now_ns());
            table::write_paced(database, spec.rows, rate, clock).await?;
        }
    }
    let deadline = Instant::now() + settings.deliver_timeout;
    let mut last_progress = (0, Instant::now());
    while tally.distinct() < spec.rows {
        let now = Instant::now();
        let delivered = tally.distinct();
        if delivered > last_progress.0 {
            last_progress = (delivered, now);
        }
        if now >= deadline {
            bail!(
                "{delivered} of {} rows within {:?} of the last write",
                spec.rows,
                settings.deliver_timeout
            );
        }
        if now - last_progress.1 >= STALL_LIMIT {
            bail!(
                "delivery stalled at {delivered} of {} for {STALL_LIMIT:?}",
                spec.rows
            );
        }
        relay.check().await?;
        destination.check_running()?;
        sleep(PROGRESS_INTERVAL).await;
    }
    // A relay marks a row after the broker took it: the last marks may trail the last arrival.
    let deadline = Instant::now() + STALL_LIMIT;
    loop {
        let unsent = table::unsent(app).await?;
        result.unsent = Some(unsent);
        if unsent == 0 {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("{unsent} rows still not marked sent {STALL_LIMIT:?} after the last arrival");
        }
        relay.check().await?;
        sleep(PROGRESS_INTERVAL).await;
    }
}

/// The agent's YAML: the outbox table as source, one sender to `target`, one binding to
/// `address`, a `direct_hold` route; lease and DLQ in `dir` (SQLite).
pub fn config(
    table_url: &str,
    target: Target,
    address: &str,
    settings: &RelaySettings,
    dir: &Path,
) -> String {
    let dir = dir.display();
    let poll_ms = settings.poll_interval.as_millis();
    format!(
        "# Generated by ferry-bench relay.\n\
         bridge:\n  id: ferry-relay-bench\n\
         sessions:\n\
         \x20 - id: table\n    transport: postgres_table\n    options:\n      session:\n        url: {table_url}\n\
         \x20 - id: dst\n    transport: {transport}\n    options:\n      session:\n        url: {url}\n\
         stores:\n\
         \x20 lease:\n    type: sqlite\n    options:\n      path: {dir}/lease.db\n\
         \x20 dlq:\n    type: sqlite\n    options:\n      path: {dir}/dlq.db\n\
         receivers:\n\
         \x20 - id: rows\n    session_id: table\n    table: {table}\n    poll_interval: {poll_ms}ms\n    batch_size: {batch_size}\n\
         senders:\n  - id: out\n    session_id: dst\n\
         bindings:\n  - id: to-dst\n    sender_id: out\n    address: \"{address}\"\n\
         routes:\n\
         \x20 - id: relay\n    receiver_id: rows\n    delivery_mode: direct_hold\n    bindings: [to-dst]\n    \
         policy:\n      ack_after: target_accept\n      max_in_flight: {max_in_flight}\n",
        transport = target.name(),
        url = target.url(),
        table = table::TABLE,
        batch_size = settings.batch_size,
        max_in_flight = settings.max_in_flight,
    )
}

/// The runs, one line each, then Ferry against the minimal relay per destination.
pub fn report(results: &[RelayResult]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<10} {:<18} {:>6} {:>13} {:>5} {:>9} {:>8} {:>8} {:>8} {:>7}",
        "to", "relay", "pace", "delivered", "dup", "rows/s", "p50 ms", "p99 ms", "max ms", "unsent"
    );
    for r in results {
        let latency = r.tally.latency();
        let ms = |pick: fn(&LatencySummary) -> Duration| {
            latency.map_or("-".to_owned(), |l| {
                format!("{:.2}", pick(&l).as_secs_f64() * 1e3)
            })
        };
        let _ = writeln!(
            out,
            "{:<10} {:<18} {:>6} {:>13} {:>5} {:>9} {:>8} {:>8} {:>8} {:>7}",
            r.spec.target.name(),
            r.spec.relayer.label(),
            pace_label(r.spec.pace),
            format!("{}/{}", r.tally.distinct, r.tally.expected()),
            r.tally.duplicates,
            r.throughput().map_or("-".to_owned(), |t| format!("{t:.0}")),
            ms(|l| l.p50),
            ms(|l| l.p99),
            ms(|l| l.max),
            r.unsent.map_or("-".to_owned(), |u| u.to_string()),
        );
        if let Some(error) = &r.error {
            let first_line = error.lines().next().unwrap_or_default();
            let _ = writeln!(
                out,
                "{:<10} {:<18} INCOMPLETE: {first_line}",
                r.spec.target.name(),
                r.spec.relayer.label()
            );
        }
    }
    let _ = writeln!(out, "\nferry / minimal relay (same run):");
    let _ = writeln!(
        out,
        "{:<10} {:>14} {:>14} {:>14}",
        "to", "rows/s ratio", "p50 ratio", "p99 ratio"
    );
    let mut targets: Vec<Target> = Vec::new();
    for r in results {
        if !targets.contains(&r.spec.target) {
            targets.push(r.spec.target);
        }
    }
    for target in targets {
        let find = |relayer: Relayer, flat_out: bool| {
            results.iter().find(|r| {
                r.spec.target == target
                    && r.spec.relayer == relayer
                    && (r.spec.pace == Pace::FlatOut) == flat_out
                    && r.complete()
            })
        };
        let ratio = |ferry: Option<f64>, minimal: Option<f64>| {
            ferry
                .zip(minimal)
                .filter(|(_, base)| *base > 0.0)
                .map_or("-".to_owned(), |(f, base)| format!("{:.3}x", f / base))
        };
        let throughput = |relayer| find(relayer, true).and_then(RelayResult::throughput);
        let latency = |relayer, pick: fn(&LatencySummary) -> Duration| {
            find(relayer, false)
                .and_then(|r| r.tally.latency())
                .map(|l| pick(&l).as_secs_f64())
        };
        let _ = writeln!(
            out,
            "{:<10} {:>14} {:>14} {:>14}",
            target.name(),
            ratio(throughput(Relayer::Ferry), throughput(Relayer::Minimal)),
            ratio(
                latency(Relayer::Ferry, |l| l.p50),
                latency(Relayer::Minimal, |l| l.p50)
            ),
            ratio(
                latency(Relayer::Ferry, |l| l.p99),
                latency(Relayer::Minimal, |l| l.p99)
            ),
        );
    }
    out
}

/// `max` or `1000/s`.
fn pace_label(pace: Pace) -> String {
    match pace {
        Pace::FlatOut => "max".to_owned(),
        Pace::Rate(rate) => format!("{rate}/s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_relay_configuration_is_valid() {
        let settings = RelaySettings {
            agent: None,
            poll_interval: Duration::from_millis(100),
            batch_size: 100,
            max_in_flight: 100,
            data_dir: None,
            keep: false,
            deliver_timeout: Duration::from_secs(60),
        };
        for (target, address) in [
            (Target::Nats, "bench_1.events"),
            (Target::Rabbitmq, "/bench-1"),
        ] {
            let yaml = config(
                "postgres://127.0.0.1:5432/ferry_bench",
                target,
                address,
                &settings,
                Path::new("/tmp/x"),
            );
            let no_env = |_: &str| None;
            let checked = ferry_shared::config::check_bytes(yaml.as_bytes(), &no_env)
                .map(drop)
                .map_err(|error| error.messages());
            assert_eq!(checked, Ok(()), "{yaml}");
            assert!(yaml.contains("poll_interval: 100ms"), "{yaml}");
        }
    }
}
