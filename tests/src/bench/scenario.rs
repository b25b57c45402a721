//! One measured run: fresh brokers, a contender between them, a publisher, the collectors.
//!
//! A run starts broker B and one collector per destination, then broker A (with Mosquitto's
//! bridge in its configuration, or plain with Ferry's agent started next to it). It publishes
//! warm-up probes until every destination has received one — so every connection and
//! subscription on the path is up — then arms the collectors and publishes the measured
//! messages. It waits until every destination holds every number, with a deadline and a stall
//! limit, samples the agent's memory meanwhile, reads the CPU time of the agent, of the
//! brokers and of `ferry-bench` itself at both ends of that window (see [`cpu`](super::cpu)),
//! and stops everything (also on error: every process is owned by a value whose `Drop` kills
//! it). Under Callgrind the agent's instructions are counted instead (see
//! [`callgrind`](super::callgrind)).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::time::{Instant, sleep};

use super::callgrind::{Counter, IDLE_BASELINE, Instructions};
use super::collector::{Collector, Tally};
use super::cpu::{self, CpuWindow, MachineCpu, MachineReading};
use super::ferry::{self, Agent, FerryRoute, FerryTuning, Store, StoreSite};
use super::latency::LatencySummary;
use super::payload::{Clock, PROBE};
use super::publisher::{Pace, Published, Publisher};
use super::rss::{Rss, RssSampler};
use super::{DESTINATIONS, MEASURED_TOPIC, PROBE_TOPIC, brokers};
use crate::{Moto, TestDatabase};

/// How long the warm-up may take (bridge connections retry after a second; the agent starts).
const WARM_UP_TIMEOUT: Duration = Duration::from_secs(30);
/// The same for an agent under Callgrind, which starts about fifty times slower.
const WARM_UP_TIMEOUT_UNDER_CALLGRIND: Duration = Duration::from_secs(180);
/// Time between two warm-up probes.
const PROBE_INTERVAL: Duration = Duration::from_millis(100);
/// A run fails when no destination receives anything new for this long.
const STALL_LIMIT: Duration = Duration::from_secs(20);
/// The same under Callgrind.
const STALL_LIMIT_UNDER_CALLGRIND: Duration = Duration::from_secs(120);
/// How often delivery progress is checked.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(20);

/// What moves the messages from A to B.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Contender {
    /// Mosquitto's bridge with this many connections (one per destination).
    Bridge { connections: usize },
    /// Ferry's agent with this route.
    Ferry(FerryRoute),
}

impl Contender {
    /// The destination prefixes this contender delivers to.
    pub fn destinations(&self) -> &'static [&'static str] {
        match self {
            Self::Bridge { connections } => &DESTINATIONS[..(*connections).min(DESTINATIONS.len())],
            Self::Ferry(FerryRoute::SharedOutbox) => &DESTINATIONS,
            Self::Ferry(FerryRoute::DirectHold) => &DESTINATIONS[..1],
        }
    }

    /// A short label: `bridge x3`, `ferry shared_outbox x3`, `ferry direct_hold`.
    pub fn label(&self) -> String {
        match self {
            Self::Bridge { connections } => format!("mosquitto bridge x{connections}"),
            Self::Ferry(FerryRoute::SharedOutbox) => {
                format!("ferry shared_outbox x{}", DESTINATIONS.len())
            }
            Self::Ferry(FerryRoute::DirectHold) => "ferry direct_hold x1".to_owned(),
        }
    }
}

/// One run to make.
#[derive(Debug, Clone, Copy)]
pub struct RunSpec {
    pub contender: Contender,
    pub messages: u64,
    pub pace: Pace,
    /// Where a `shared_outbox` route keeps its stores (the other runs use SQLite).
    pub store: Store,
}

impl RunSpec {
    /// The contender's label, with the store of a `shared_outbox` run:
    /// `ferry shared_outbox x3 postgres`.
    pub fn label(&self) -> String {
        match self.contender {
            Contender::Ferry(FerryRoute::SharedOutbox) => {
                format!("{} {}", self.contender.label(), self.store.name())
            }
            _ => self.contender.label(),
        }
    }

    /// The store this run's agent uses.
    pub fn store_used(&self) -> Store {
        match self.contender {
            Contender::Ferry(FerryRoute::SharedOutbox) => self.store,
            _ => Store::Sqlite,
        }
    }

    /// `flat out` or `1000/s`.
    pub fn pace_label(&self) -> String {
        match self.pace {
            Pace::FlatOut => "max".to_owned(),
            Pace::Rate(rate) => format!("{rate}/s"),
        }
    }
}

/// Settings shared by every run.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The agent binary (None: Ferry runs are skipped).
    pub agent: Option<PathBuf>,
    pub tuning: FerryTuning,
    /// Where the agent's SQLite files go (a temporary directory below it per run).
    pub data_dir: Option<PathBuf>,
    /// Longest wait for delivery after the last publish.
    pub deliver_timeout: Duration,
    /// Keep each Ferry run's directory (configuration, agent output, SQLite files, final
    /// `/metrics`) instead of deleting it.
    pub keep: bool,
    /// Extra `mosquitto.conf` lines for every broker.
    pub broker_config: Vec<String>,
    /// The agent reaches broker A on its Unix socket (`unix://`) instead of TCP, as an agent
    /// beside its broker may; the bridge, the publisher and the collectors stay on TCP.
    pub source_socket: bool,
    /// Run the agent under Callgrind and count its instructions (its run directory is kept).
    pub callgrind: bool,
    /// Export the agent's spans (every trace sampled) to this OTLP endpoint; no tracing when
    /// unset.
    pub otlp_endpoint: Option<String>,
}

impl Settings {
    /// How long the warm-up and a stall may last.
    fn patience(&self) -> (Duration, Duration) {
        if self.callgrind {
            (WARM_UP_TIMEOUT_UNDER_CALLGRIND, STALL_LIMIT_UNDER_CALLGRIND)
        } else {
            (WARM_UP_TIMEOUT, STALL_LIMIT)
        }
    }
}

/// What one destination received in a run.
#[derive(Debug, Clone)]
pub struct DestinationResult {
    pub name: &'static str,
    pub tally: Tally,
    /// Distinct messages per second, from the first publish to the last arrival.
    pub throughput: Option<f64>,
    pub latency: Option<LatencySummary>,
}

/// The outcome of a run.
#[derive(Debug, Clone)]
pub struct RunResult {
    pub spec: RunSpec,
    pub published: Option<Published>,
    pub destinations: Vec<DestinationResult>,
    /// The agent's memory (Ferry runs, not under Callgrind).
    pub rss: Option<Rss>,
    /// The agent's CPU time over the measured window (Ferry runs, not under Callgrind).
    pub cpu: Option<CpuWindow>,
    /// Brokers A and B's and `ferry-bench`'s CPU time over the same window (every run not
    /// under Callgrind).
    pub machine_cpu: Option<MachineCpu>,
    /// The agent's instructions (Ferry runs under Callgrind).
    pub instructions: Option<Instructions>,
    /// Why the run is incomplete, if it is.
    pub error: Option<String>,
}

impl RunResult {
    /// Messages per second the publisher got acknowledged by broker A.
    pub fn publish_rate(&self) -> Option<f64> {
        let published = self.published?;
        rate(
            self.spec.messages,
            published.acked_ns.checked_sub(published.first_ns)?,
        )
    }

    /// The result for `name`, if that destination was measured.
    pub fn destination(&self, name: &str) -> Option<&DestinationResult> {
        self.destinations.iter().find(|d| d.name == name)
    }

    /// True when every destination received every message.
    pub fn complete(&self) -> bool {
        self.error.is_none()
            && !self.destinations.is_empty()
            && self.destinations.iter().all(|d| d.tally.missing() == 0)
    }
}

/// Makes one run; an error is recorded in the result, with whatever was measured.
pub async fn run(spec: RunSpec, settings: &Settings, clock: Clock) -> RunResult {
    let mut result = RunResult {
        spec,
        published: None,
        destinations: Vec::new(),
        rss: None,
        cpu: None,
        machine_cpu: None,
        instructions: None,
        error: None,
    };
    let mut collectors = Vec::new();
    if let Err(error) = measure(&mut result, &mut collectors, settings, clock).await {
        result.error = Some(format!("{error:#}"));
    }
    let first_ns = result.published.map(|p| p.first_ns);
    result.destinations = collectors
        .iter()
        .zip(spec.contender.destinations())
        .map(|(collector, &name)| {
            let tally = collector.tally();
            let throughput = first_ns
                .zip(tally.last_ns)
                .and_then(|(first, last)| rate(tally.distinct, last.checked_sub(first)?));
            let latency = tally.latency();
            DestinationResult {
                name,
                tally,
                throughput,
                latency,
            }
        })
        .collect();
    result
}

/// The body of [`run`]: everything it starts is dropped (stopped) when it returns.
async fn measure(
    result: &mut RunResult,
    collectors: &mut Vec<Collector>,
    settings: &Settings,
    clock: Clock,
) -> anyhow::Result<()> {
    let spec = result.spec;
    let prefixes = spec.contender.destinations();
    let destination = brokers::start_destination(&settings.broker_config)
        .await
        .context("starting broker B")?;
    for &prefix in prefixes {
        let collector = Collector::start(prefix, &destination.url(), &format!("{prefix}/#"), clock)
            .await
            .with_context(|| format!("subscribing to {prefix}/# on broker B"))?;
        collectors.push(collector);
    }
    let bridge = match spec.contender {
        Contender::Bridge { .. } => Some((destination.port(), prefixes)),
        Contender::Ferry(_) => None,
    };
    let source = brokers::start_source(bridge, &settings.broker_config, settings.source_socket)
        .await
        .context("starting broker A")?;

    let run_dir = tempdir(settings.data_dir.as_deref())?;
    // Declared before the agent, so it is dropped (the database with it) after the agent.
    let mut database = None;
    let run_dir = KeptDir {
        dir: Some(run_dir),
        keep: (settings.keep || settings.callgrind)
            && matches!(spec.contender, Contender::Ferry(_)),
    };
    let mut agent = match spec.contender {
        Contender::Bridge { .. } => None,
        Contender::Ferry(route) => {
            let binary = settings
                .agent
                .as_deref()
                .context("no ferry-agent with a `run` command")?;
            let config_path = run_dir.path().join("bridge.yaml");
            let (site, env) = prepare_stores(spec.store_used(), run_dir.path(), &mut database)
                .await
                .with_context(|| format!("preparing the {} stores", spec.store_used().name()))?;
            let source_url = source.unix_url().unwrap_or_else(|| source.url());
            let mut yaml = ferry::config(
                route,
                settings.tuning,
                &source_url,
                &destination.url(),
                &site,
                prefixes,
            );
            if let Some(endpoint) = &settings.otlp_endpoint {
                yaml.push_str(&format!(
                    "telemetry:\n  otlp_endpoint: {endpoint}\n  sampling_ratio: 1.0\n"
                ));
            }
            std::fs::write(&config_path, yaml).context("writing the agent's configuration")?;
            ferry::validate(binary, &config_path)?;
            Some(Agent::start(
                binary,
                &config_path,
                run_dir.path(),
                &env,
                settings.callgrind,
            )?)
        }
    };
    let pid = agent.as_ref().map(Agent::pid);
    let (sampled, mut counter) = match pid {
        Some(pid) if settings.callgrind => (None, Some(Counter::new(pid, run_dir.path()))),
        Some(pid) => (Some((pid, RssSampler::start(pid))), None),
        None => (None, None),
    };
    let (warm_up_timeout, stall_limit) = settings.patience();

    let mut publisher =
        Publisher::connect(&source.url(), &crate::ids::unique("ferry-bench-pub"), clock).await?;
    warm_up(&publisher, collectors, agent.as_mut(), warm_up_timeout).await?;

    let idle = match &mut counter {
        Some(counter) => {
            counter.zero().await?;
            sleep(IDLE_BASELINE).await;
            Some(counter.dump().await?.0)
        }
        None => None,
    };
    for collector in collectors.iter() {
        collector.arm(spec.messages);
    }
    if let Some(counter) = &mut counter {
        counter.zero().await?;
    }
    let cpu_before = sampled.as_ref().and_then(|(pid, _)| cpu::cpu_time(*pid));
    // Not under Callgrind: the agent, fifty times slower, would change what the others do.
    let machine = match (source.pid(), destination.pid()) {
        (Some(a), Some(b)) if !settings.callgrind => MachineReading::start(a, b),
        _ => None,
    };
    let ack_timeout = settings.deliver_timeout + publish_duration(spec);
    let published = publisher
        .run(MEASURED_TOPIC, spec.messages, spec.pace, ack_timeout)
        .await?;
    result.published = Some(published);
    let delivered = wait_delivered(
        collectors,
        spec.messages,
        settings.deliver_timeout,
        stall_limit,
        agent.as_mut(),
    )
    .await;
    // CPU per message only for a complete run: an incomplete one's window ends at a stall or
    // the deadline, and dividing its idle seconds by the messages would mean nothing.
    if delivered.is_ok() {
        result.machine_cpu = machine.and_then(|m| m.finish(spec.messages));
    }
    if let Some((pid, sampler)) = sampled {
        let cpu_after = cpu::cpu_time(pid).filter(|_| delivered.is_ok());
        result.cpu = cpu_before
            .zip(cpu_after)
            .map(|(before, after)| CpuWindow::between(before, after, spec.messages));
        result.rss = Some(sampler.finish());
    }
    delivered?;
    if let (Some(counter), Some(idle)) = (&mut counter, idle) {
        let (window, part) = counter.dump().await?;
        result.instructions = Some(Instructions {
            idle,
            window,
            messages: spec.messages,
            part,
        });
        eprintln!(
            "  profile of the window: callgrind_annotate {}",
            counter.part_path(part).display()
        );
    }

    publisher.disconnect().await;
    if let Some(agent) = agent.take() {
        if settings.keep {
            agent.save_metrics(&run_dir.path().join("metrics.txt"));
        }
        agent.stop().await?;
    }
    Ok(())
}

/// Makes `store` ready for one run: SQLite files in `dir`, a fresh PostgreSQL database (kept in
/// `database`, which drops it), or a unique table prefix on the moto server. Returns where the
/// stores are and the environment the agent needs to reach them (moto's credentials).
async fn prepare_stores(
    store: Store,
    dir: &Path,
    database: &mut Option<TestDatabase>,
) -> anyhow::Result<(StoreSite, Vec<(&'static str, String)>)> {
    Ok(match store {
        Store::Sqlite => (StoreSite::Sqlite(dir.to_owned()), Vec::new()),
        Store::Postgres => {
            let url = database.insert(TestDatabase::create().await?).url()?;
            (StoreSite::Postgres { url }, Vec::new())
        }
        Store::Dynamodb => {
            let moto = Moto::shared().await?;
            let site = StoreSite::Dynamodb {
                endpoint: moto.endpoint().to_owned(),
                prefix: crate::ids::unique("ferry-bench"),
            };
            (site, moto.env())
        }
    })
}

/// Publishes probes until every collector has received one.
async fn warm_up(
    publisher: &Publisher,
    collectors: &[Collector],
    mut agent: Option<&mut Agent>,
    timeout: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while collectors.iter().any(|c| c.probes() == 0) {
        if Instant::now() >= deadline {
            let waiting: Vec<&str> = collectors
                .iter()
                .filter(|c| c.probes() == 0)
                .map(Collector::name)
                .collect();
            let tail = agent.map(|a| a.output_tail()).unwrap_or_default();
            bail!("warm-up: no probe reached {waiting:?} within {timeout:?}\n{tail}");
        }
        if let Some(agent) = agent.as_deref_mut() {
            agent.check_running()?;
        }
        publisher.send(PROBE_TOPIC, PROBE.to_vec()).await?;
        sleep(PROBE_INTERVAL).await;
    }
    Ok(())
}

/// Waits until every collector holds all of `0..messages`; fails on the deadline, on a stall,
/// or when the agent exits.
async fn wait_delivered(
    collectors: &[Collector],
    messages: u64,
    timeout: Duration,
    stall_limit: Duration,
    mut agent: Option<&mut Agent>,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    let mut last_progress = (0, Instant::now());
    loop {
        let delivered: u64 = collectors.iter().map(Collector::distinct).sum();
        let expected = messages * collectors.len() as u64;
        if delivered >= expected {
            return Ok(());
        }
        let now = Instant::now();
        if delivered > last_progress.0 {
            last_progress = (delivered, now);
        }
        if now >= deadline {
            bail!("{delivered} of {expected} deliveries within {timeout:?} of the last publish");
        }
        if now - last_progress.1 >= stall_limit {
            bail!("delivery stalled at {delivered} of {expected} for {stall_limit:?}");
        }
        if let Some(collector) = collectors.iter().find(|c| !c.is_running()) {
            bail!("the subscriber on {} lost its connection", collector.name());
        }
        if let Some(agent) = agent.as_deref_mut() {
            agent.check_running()?;
        }
        sleep(PROGRESS_INTERVAL).await;
    }
}

/// How long publishing should take at the run's pace (zero flat out).
fn publish_duration(spec: RunSpec) -> Duration {
    match spec.pace {
        Pace::FlatOut => Duration::ZERO,
        Pace::Rate(rate) => Duration::from_secs(spec.messages / u64::from(rate.max(1)) + 1),
    }
}

/// A fresh directory for one run, below `parent` (created if needed) or the system's temporary
/// directory.
pub fn tempdir(parent: Option<&Path>) -> anyhow::Result<tempfile::TempDir> {
    let mut builder = tempfile::Builder::new();
    builder.prefix("ferry-bench-");
    match parent {
        Some(parent) => {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
            builder.tempdir_in(parent)
        }
        None => builder.tempdir(),
    }
    .context("creating the run's directory")
}

/// The run's directory, kept (and its path printed) when asked.
struct KeptDir {
    dir: Option<tempfile::TempDir>,
    keep: bool,
}

impl KeptDir {
    fn path(&self) -> &Path {
        self.dir
            .as_ref()
            .map_or(Path::new("."), tempfile::TempDir::path)
    }
}

impl Drop for KeptDir {
    fn drop(&mut self) {
        if let Some(dir) = self.dir.take().filter(|_| self.keep) {
            eprintln!("  kept {}", dir.keep().display());
        }
    }
}

/// `count` per second over `span_ns` nanoseconds.
fn rate(count: u64, span_ns: u64) -> Option<f64> {
    (span_ns > 0).then(|| count as f64 * 1e9 / span_ns as f64)
}
