//! `ferry quickstart`, from start to summary:
//!
//! 1. two embedded brokers, the upstream listener in front of the upstream
//!    one, the control plane and the managed agent ([`Stack`]);
//! 2. the bridge in `quickstart.yaml` applied through ConfigService; the
//!    subscriber on every destination; readings published once the agent
//!    runs the bridge;
//! 3. the live view every second, and the outage ([`Outage`]): the upstream
//!    listener down for a while, then back, and a line with its figures once
//!    every reading published before it came back has arrived everywhere;
//! 4. on SIGINT / SIGTERM (or after `--duration`): no more readings, a
//!    bounded wait for the outbox to drain, the summary, everything stopped.
//!
//! Every figure printed is counted in this run: by the publisher (PUBACKs),
//! the subscriber ([`crate::tally`]) or the agent (its metrics snapshots at
//! the control plane).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use ferry_shared::config::{ValidConfig, check_bytes, env::expand};
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::time::Instant;

use crate::brokers::{self, EmbeddedBroker};
use crate::fleet::{self, BindingFigures, Fleet};
use crate::listener::Listener;
use crate::outage::{DRAIN_TIMEOUT, Outage};
use crate::traffic::{self, Clock, Destination, Published, Publisher, Subscriber};
use crate::view::{self, Frame, Outcome, Row, Screen};

/// The bridge, with `${PLANT_BROKER}`, `${UPSTREAM_BROKER}` and
/// `${AGENT_DIR}` to fill in.
const BRIDGE: &str = include_str!("../quickstart.yaml");
/// How long the agent may take to run the bridge.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the outage is stepped and the drain checked.
const CHECK_INTERVAL: Duration = Duration::from_millis(100);
/// How often the view is refreshed.
const REFRESH_INTERVAL: Duration = Duration::from_secs(1);

/// What the command line asked for.
#[derive(Debug, Clone)]
pub struct Options {
    /// Readings per second.
    pub rate: f64,
    /// Stop after this long, as on SIGINT.
    pub duration: Option<Duration>,
    /// When the upstream listener goes down, after the first reading.
    pub outage_after: Duration,
    /// For how long; zero for no outage.
    pub outage_for: Duration,
    /// When the process started (for the time to the first delivery).
    pub started: std::time::Instant,
}

/// Runs the quickstart in `dir` (which the caller removes) until a signal or
/// the duration; prints the view and the summary on `screen`.
pub async fn run(options: &Options, dir: &Path, screen: &mut Screen) -> anyhow::Result<()> {
    let mut signals = Signals::install()?;
    let stack = Stack::start(dir).await?;
    let started = tokio::select! {
        started = stack.begin(dir, screen, options.rate) => started,
        name = signals.next() => {
            screen.event(&format!("{name} while starting: stopping"));
            stack.stop().await;
            return Ok(());
        }
    };
    let (bridge, destinations, traffic) = match started {
        Ok(started) => started,
        Err(error) => {
            stack.stop().await;
            return Err(error);
        }
    };
    print_ferryctl(screen, &stack.fleet.endpoint);
    let mut run = Running {
        stack,
        bridge,
        destinations,
        traffic,
        outage: Outage::planned(options.outage_after, options.outage_for),
        rate: options.rate,
        started: Some(options.started),
    };
    let name = run.watch(screen, &mut signals, options.duration).await?;
    screen.event(&format!(
        "{name}: no more readings; waiting up to {}s for the outbox to drain (Ctrl-C again to skip)",
        DRAIN_TIMEOUT.as_secs()
    ));
    let result = run.finish(screen, &mut signals).await;
    run.stop().await;
    result
}

/// The brokers, the upstream listener and the fleet.
struct Stack {
    plant: EmbeddedBroker,
    upstream: EmbeddedBroker,
    listener: Listener,
    fleet: Fleet,
}

impl Stack {
    async fn start(dir: &Path) -> anyhow::Result<Self> {
        let plant = EmbeddedBroker::start("plant").await?;
        let upstream = EmbeddedBroker::start("upstream").await?;
        let listener = Listener::start(upstream.addr()).await?;
        let fleet = Fleet::start(dir, &dir.join("agent")).await?;
        Ok(Self {
            plant,
            upstream,
            listener,
            fleet,
        })
    }

    /// Fills in the bridge, checks it here first (the control plane runs the
    /// same validator), applies it.
    async fn apply(&self, dir: &Path) -> anyhow::Result<ValidConfig> {
        let vars = HashMap::from([
            ("PLANT_BROKER", self.plant.url()),
            ("UPSTREAM_BROKER", brokers::url(self.listener.addr())),
            ("AGENT_DIR", dir.join("agent").display().to_string()),
        ]);
        let yaml = expand(BRIDGE, &|name: &str| vars.get(name).cloned())
            .context("filling in quickstart.yaml")?;
        let valid = check_bytes(yaml.as_bytes(), &|_: &str| None)
            .map_err(|e| anyhow::anyhow!("quickstart.yaml: {}", e.messages().join("; ")))?;
        self.fleet.apply(yaml).await?;
        Ok(valid)
    }

    /// Applies the bridge, says what runs where, and starts the traffic;
    /// returns the bridge id, its destinations and the traffic.
    async fn begin(
        &self,
        dir: &Path,
        screen: &mut Screen,
        rate: f64,
    ) -> anyhow::Result<(String, Vec<Destination>, Traffic)> {
        let bridge = self.apply(dir).await?;
        self.print(screen, dir, &bridge);
        let destinations = destinations(&bridge)?;
        let traffic = self.traffic(&bridge, &destinations, rate).await?;
        Ok((bridge.bridge_id().to_owned(), destinations, traffic))
    }

    fn print(&self, screen: &mut Screen, dir: &Path, bridge: &ValidConfig) {
        let f = &self.fleet;
        screen.event("Ferry quickstart: a control plane, two MQTT brokers and a managed agent, all in this process.");
        for (what, text) in [
            (
                "directory",
                format!("{} (removed at exit; --keep keeps it)", dir.display()),
            ),
            ("log", dir.join("ferry.log").display().to_string()),
            (
                "control plane",
                format!(
                    "{} (state in SQLite; Prometheus {})",
                    f.endpoint, f.metrics_url
                ),
            ),
            ("plant broker", format!("{} (rumqttd)", self.plant.url())),
            (
                "upstream broker",
                format!(
                    "{} (rumqttd); the agent reaches it through the upstream listener {}",
                    self.upstream.url(),
                    brokers::url(self.listener.addr())
                ),
            ),
            (
                "agent",
                format!(
                    "{} (managed, label {}={}; /metrics {}/metrics)",
                    fleet::AGENT_ID,
                    fleet::LABEL.0,
                    fleet::LABEL.1,
                    f.agent_admin
                ),
            ),
            ("bridge", describe(bridge)),
        ] {
            screen.event(&format!("  {what:<16} {text}"));
        }
    }

    /// Subscribes to every destination, waits until the agent runs the
    /// bridge, then starts publishing.
    async fn traffic(
        &self,
        bridge: &ValidConfig,
        destinations: &[Destination],
        rate: f64,
    ) -> anyhow::Result<Traffic> {
        let clock = Clock::start();
        let published = Arc::new(Published::default());
        let subscriber = tokio::time::timeout(
            START_TIMEOUT,
            Subscriber::start(
                self.upstream.addr().port(),
                destinations,
                clock,
                Arc::clone(&published),
            ),
        )
        .await
        .context("subscribing to the destinations on the upstream broker: timed out")??;
        let deadline = Instant::now() + START_TIMEOUT;
        while self.fleet.bridging(bridge.bridge_id()).await?.is_none() {
            anyhow::ensure!(
                !self.fleet.agent_stopped(),
                "the agent stopped while starting (see the log)"
            );
            anyhow::ensure!(
                Instant::now() < deadline,
                "the agent did not run the bridge within {}s (see the log)",
                START_TIMEOUT.as_secs()
            );
            tokio::time::sleep(CHECK_INTERVAL).await;
        }
        let publisher = Publisher::start(
            self.plant.addr().port(),
            rate,
            clock,
            Arc::clone(&published),
        );
        Ok(Traffic {
            clock,
            publishing: Instant::now(),
            published,
            publisher: Some(publisher),
            subscriber,
        })
    }

    async fn stop(mut self) {
        self.fleet.stop().await;
        self.listener.take_down().await;
    }
}

/// The publisher and the subscriber.
struct Traffic {
    clock: Clock,
    /// When the first reading was published.
    publishing: Instant,
    published: Arc<Published>,
    publisher: Option<Publisher>,
    subscriber: Subscriber,
}

/// A running quickstart.
struct Running {
    stack: Stack,
    bridge: String,
    destinations: Vec<Destination>,
    traffic: Traffic,
    outage: Outage,
    rate: f64,
    /// The process's start, until the first delivery is reported.
    started: Option<std::time::Instant>,
}

impl Running {
    /// The view and the outage until a signal or `duration`; returns what
    /// ended it.
    async fn watch(
        &mut self,
        screen: &mut Screen,
        signals: &mut Signals,
        duration: Option<Duration>,
    ) -> anyhow::Result<&'static str> {
        let end = duration.map(|d| Instant::now() + d);
        let mut check = tokio::time::interval(CHECK_INTERVAL);
        let mut refresh = tokio::time::interval(REFRESH_INTERVAL);
        loop {
            tokio::select! {
                name = signals.next() => return Ok(name),
                () = sleep_until(end) => return Ok("--duration reached"),
                _ = check.tick() => {
                    self.first_delivery(screen);
                    self.step_outage(screen).await?;
                }
                _ = refresh.tick() => self.refresh(screen).await,
            }
        }
    }

    /// Says, once, how long after the process started the first reading
    /// had arrived at every destination.
    fn first_delivery(&mut self, screen: &mut Screen) {
        let Some(started) = self.started else { return };
        let everywhere =
            (0..self.destinations.len()).all(|i| self.traffic.subscriber.tally(i).distinct() > 0);
        if everywhere {
            screen.event(&format!(
                "first reading delivered to every destination {} after start",
                view::duration_text(started.elapsed())
            ));
            self.started = None;
        }
    }

    /// Stops publishing, brings the upstream listener back if it is down,
    /// waits for the drain (bounded), prints the summary.
    async fn finish(&mut self, screen: &mut Screen, signals: &mut Signals) -> anyhow::Result<()> {
        if let Some(publisher) = self.traffic.publisher.take() {
            publisher.stop().await?;
        }
        if !self.stack.listener.is_up() {
            self.outage
                .cut_short(&mut self.stack.listener, screen)
                .await?;
        }
        let published = self.published();
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        let mut check = tokio::time::interval(CHECK_INTERVAL);
        let mut refresh = tokio::time::interval(REFRESH_INTERVAL);
        let figures = loop {
            tokio::select! {
                name = signals.next() => {
                    screen.event(&format!("{name} again: not waiting for the drain"));
                    break self.stack.fleet.figures(&self.bridge).await.unwrap_or_default();
                }
                _ = check.tick() => {
                    self.step_outage(screen).await?;
                    if let Some(figures) = self.drained(published).await {
                        break figures;
                    }
                    if Instant::now() > deadline {
                        screen.event(&format!("not drained after {}s", DRAIN_TIMEOUT.as_secs()));
                        break self.stack.fleet.figures(&self.bridge).await.unwrap_or_default();
                    }
                }
                _ = refresh.tick() => self.refresh(screen).await,
            }
        };
        self.refresh(screen).await;
        screen.keep();
        self.summary(screen, published, &figures);
        Ok(())
    }

    async fn stop(self) {
        self.traffic.subscriber.stop().await;
        self.stack.stop().await;
    }

    /// Readings the plant broker acknowledged.
    fn published(&self) -> u64 {
        self.traffic.published.acknowledged()
    }

    /// The agent's figures once every reading below `published` arrived at
    /// every destination and the agent reports each of them received and
    /// nothing in flight.
    async fn drained(&self, published: u64) -> Option<BTreeMap<String, BindingFigures>> {
        let arrived = (0..self.destinations.len())
            .all(|i| self.traffic.subscriber.tally(i).has_all_below(published));
        if !arrived {
            return None;
        }
        let figures = self.stack.fleet.figures(&self.bridge).await.ok()?;
        let settled = self.destinations.iter().all(|d| {
            figures
                .get(&d.binding)
                .is_some_and(|f| f.counters.received >= published && f.counters.in_flight == 0)
        });
        settled.then_some(figures)
    }

    async fn refresh(&mut self, screen: &mut Screen) {
        let figures = match self.stack.fleet.figures(&self.bridge).await {
            Ok(figures) => figures,
            Err(error) => {
                tracing::warn!(error = format!("{error:#}"), "reading the agent's figures");
                BTreeMap::new()
            }
        };
        let lease = match self.stack.fleet.leases(&self.bridge).await {
            Ok(leases) => leases.into_iter().next(),
            Err(error) => {
                tracing::warn!(error = format!("{error:#}"), "reading the leases");
                None
            }
        };
        let rows: Vec<Row> = self
            .destinations
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let mut tally = self.traffic.subscriber.tally(i);
                Row {
                    binding: d.binding.clone(),
                    arrived: tally.distinct(),
                    duplicates: tally.duplicates(),
                    agent: figures.get(&d.binding).copied(),
                    latency: tally.take_window(),
                }
            })
            .collect();
        self.outage
            .saw_depth(rows.iter().filter_map(|r| r.agent.map(|a| a.depth)).max());
        screen.frame(&Frame {
            elapsed: self.traffic.clock.elapsed(),
            published: self.published(),
            rate: self.rate,
            upstream_up: self.stack.listener.is_up(),
            rows,
            lease,
        });
    }

    async fn step_outage(&mut self, screen: &mut Screen) -> anyhow::Result<()> {
        let published = self.traffic.published.queued();
        let subscriber = &self.traffic.subscriber;
        let arrived_below =
            |seq: u64| (0..self.destinations.len()).all(|i| subscriber.tally(i).has_all_below(seq));
        let duplicates: u64 = (0..self.destinations.len())
            .map(|i| subscriber.tally(i).duplicates())
            .sum();
        self.outage
            .step(
                &mut self.stack.listener,
                screen,
                self.traffic.publishing.elapsed(),
                published,
                duplicates,
                arrived_below,
            )
            .await
    }

    fn summary(
        &self,
        screen: &mut Screen,
        published: u64,
        figures: &BTreeMap<String, BindingFigures>,
    ) {
        let queued = self.traffic.published.queued();
        let mut head = format!(
            "summary: published {published} readings in {:.1}s",
            self.traffic.clock.elapsed().as_secs_f64()
        );
        if queued > published {
            head.push_str(&format!(
                " ({} more sent but not acknowledged by the plant broker)",
                queued - published
            ));
        }
        screen.event(&head);
        for (i, d) in self.destinations.iter().enumerate() {
            let tally = self.traffic.subscriber.tally(i);
            screen.event(&view::outcome_line(&Outcome {
                binding: d.binding.clone(),
                distinct: tally.distinct(),
                duplicates: tally.duplicates(),
                missing: tally.missing(published),
                foreign: tally.foreign(),
                agent: figures.get(&d.binding).copied(),
            }));
        }
    }
}

/// The route's bindings with their topics, in the order of the route.
fn destinations(bridge: &ValidConfig) -> anyhow::Result<Vec<Destination>> {
    let route = bridge
        .config()
        .routes
        .first()
        .context("quickstart.yaml has no route")?;
    Ok(bridge
        .route_bindings(route)
        .map(|b| Destination {
            binding: b.id.clone(),
            topic: b.address.clone(),
        })
        .collect())
}

/// `quickstart v1: sensors/# → events/sensors, … through a SQLite outbox`.
fn describe(bridge: &ValidConfig) -> String {
    let topics: Vec<&str> = bridge
        .config()
        .bindings
        .iter()
        .map(|b| b.address.as_str())
        .collect();
    format!(
        "{} (quickstart/quickstart.yaml): {} → {}, fanned out through a SQLite outbox",
        bridge.bridge_id(),
        traffic::TOPIC,
        topics.join(", ")
    )
}

fn print_ferryctl(screen: &mut Screen, endpoint: &str) {
    screen.event(&format!(
        "The control plane at {endpoint} runs in the open development mode (--insecure): no credentials, loopback only, gone when this process ends."
    ));
    screen.event("Try ferryctl against this control plane while it runs (another terminal):");
    let ferryctl = ferryctl_command();
    for (args, what) in [
        ("get agents", "the agent, the version it runs, its counters"),
        ("get configs", "the bridge and its version"),
        (
            "get leases",
            "who drains the outbox, and the fencing version",
        ),
        ("metrics", "the counters per destination"),
        (
            "get dlq",
            "dead letters (none, unless something failed for good)",
        ),
        ("history quickstart", "every version of the bridge"),
    ] {
        screen.event(&format!(
            "  {ferryctl} --endpoint {endpoint} {args:<20} # {what}"
        ));
    }
}

/// How to run ferryctl from here: the binary beside this one when it was
/// built, otherwise through cargo.
fn ferryctl_command() -> String {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.join("ferryctl")))
        .filter(|path| path.is_file());
    match beside {
        Some(path) => {
            let cwd = std::env::current_dir().unwrap_or_default();
            path.strip_prefix(&cwd)
                .unwrap_or(&path)
                .display()
                .to_string()
        }
        None => "cargo run -q --release --bin ferryctl --".to_owned(),
    }
}

async fn sleep_until(end: Option<Instant>) {
    match end {
        Some(end) => tokio::time::sleep_until(end).await,
        None => std::future::pending().await,
    }
}

/// SIGINT and SIGTERM.
struct Signals {
    int: Signal,
    term: Signal,
}

impl Signals {
    fn install() -> anyhow::Result<Self> {
        Ok(Self {
            int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
            term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
        })
    }

    /// The next signal's name.
    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.int.recv() => "SIGINT",
            _ = self.term.recv() => "SIGTERM",
        }
    }
}
