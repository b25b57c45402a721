//! A `ferry-agent run` child process with its configuration file, admin port and metrics.
//!
//! [`Agent::start`] writes the YAML into the agent's directory, starts the binary with
//! `--admin-listen 127.0.0.1:PORT` and a fixed `--agent-id`, and [`Agent::wait_ready`] polls
//! `/readyz`. [`Agent::kill`] / [`Agent::restart`] simulate a crash (SIGKILL) and a restart
//! with the same configuration, id and port. [`Metrics`] parses `/metrics` into the
//! conservation counters per binding.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use anyhow::Context;

use crate::ports::free_port;
use crate::process::{ChildProcess, project_bin};
use crate::wait;

/// A `ferry-agent run` process.
pub struct Agent {
    config: PathBuf,
    port: u16,
    agent_id: String,
    process: Option<ChildProcess>,
    runs: u32,
    env: Vec<(String, String)>,
}

impl Agent {
    /// Writes `yaml` to `dir/bridge.yaml` and starts the agent on it.
    pub fn start(dir: &Path, yaml: &str) -> anyhow::Result<Self> {
        Self::start_with_env(dir, yaml, Vec::new())
    }

    /// [`Self::start`] with extra environment variables (e.g. [`crate::moto::Moto::env`]),
    /// kept for restarts.
    pub fn start_with_env(
        dir: &Path,
        yaml: &str,
        env: Vec<(String, String)>,
    ) -> anyhow::Result<Self> {
        let config = dir.join("bridge.yaml");
        std::fs::write(&config, yaml).with_context(|| format!("writing {}", config.display()))?;
        let mut agent = Self {
            config,
            port: free_port()?,
            agent_id: crate::ids::unique("agent"),
            process: None,
            runs: 0,
            env,
        };
        agent.launch()?;
        Ok(agent)
    }

    fn launch(&mut self) -> anyhow::Result<()> {
        let bin = project_bin("ferry-agent")?;
        let args = [
            "run".to_owned(),
            "--config".to_owned(),
            self.config.display().to_string(),
            "--admin-listen".to_owned(),
            format!("127.0.0.1:{}", self.port),
            "--agent-id".to_owned(),
            self.agent_id.clone(),
        ];
        let env = [("RUST_LOG", "info,ferry_agent=debug")]
            .into_iter()
            .chain(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        self.process = Some(ChildProcess::spawn(&bin, args, env)?);
        self.runs += 1;
        Ok(())
    }

    /// The admin address `127.0.0.1:PORT` (also the gRPC endpoint).
    pub fn admin_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The child process (for its output).
    pub fn process(&mut self) -> Option<&mut ChildProcess> {
        self.process.as_mut()
    }

    /// Waits until `/readyz` answers 200.
    pub async fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let port = self.port;
        let result = wait::until(timeout, "the agent to be ready", || {
            std::future::ready(http_get(port, "/readyz").is_ok_and(|(status, _)| status == 200))
        })
        .await;
        match result {
            Ok(()) => Ok(()),
            Err(e) => Err(e.context(self.tail())),
        }
    }

    /// The agent's stdout and stderr tails.
    pub fn tail(&self) -> String {
        self.process
            .as_ref()
            .map(ChildProcess::output_tail)
            .unwrap_or_default()
    }

    /// Everything the agent wrote to stdout and stderr so far (this run).
    pub fn output(&self) -> String {
        self.process
            .as_ref()
            .map(|p| format!("{}{}", p.stdout(), p.stderr()))
            .unwrap_or_default()
    }

    /// The current `/readyz` status and body (one line per unmet condition).
    pub fn readyz(&self) -> anyhow::Result<(u16, String)> {
        http_get(self.port, "/readyz")
    }

    /// The current `/metrics` text.
    pub fn metrics_text(&self) -> anyhow::Result<String> {
        let (status, body) = http_get(self.port, "/metrics")?;
        anyhow::ensure!(status == 200, "/metrics answered {status}");
        Ok(body)
    }

    /// The current `/metrics`, parsed.
    pub fn metrics(&self) -> anyhow::Result<Metrics> {
        let (status, body) = http_get(self.port, "/metrics")?;
        anyhow::ensure!(status == 200, "/metrics answered {status}");
        Ok(Metrics::parse(&body))
    }

    /// SIGKILL: a crash.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        if let Some(p) = self.process.as_mut() {
            p.sigkill()?;
        }
        Ok(())
    }

    /// SIGSTOP: the agent freezes (a long GC pause, a stopped VM) until [`Self::cont`].
    pub fn stop(&mut self) -> anyhow::Result<()> {
        self.process
            .as_mut()
            .context("the agent is not running")?
            .signal("STOP")
    }

    /// SIGCONT after [`Self::stop`].
    pub fn cont(&mut self) -> anyhow::Result<()> {
        self.process
            .as_mut()
            .context("the agent is not running")?
            .signal("CONT")
    }

    /// Starts the agent again (same configuration, id and admin port) after [`Self::kill`]
    /// or an exit.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill()?;
        self.launch()
    }

    /// SIGTERM, then waits for the exit.
    pub async fn terminate(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        let p = self.process.as_mut().context("the agent is not running")?;
        p.terminate(timeout).await
    }

    /// How many times the agent process was started.
    pub fn runs(&self) -> u32 {
        self.runs
    }
}

/// A plain HTTP/1.1 GET on 127.0.0.1:`port`; returns status and body.
pub fn http_get(port: u16, path: &str) -> anyhow::Result<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let status = response
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .context("no HTTP status")?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// One binding's conservation counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BindingCounts {
    /// `ferry_messages_received_total`.
    pub received: u64,
    /// `ferry_messages_sent_total`.
    pub sent: u64,
    /// `ferry_messages_dropped_total`.
    pub dropped: u64,
    /// `ferry_messages_filtered_total`.
    pub filtered: u64,
    /// `ferry_messages_expired_total`.
    pub expired: u64,
    /// `ferry_messages_dead_lettered_total`.
    pub dead_lettered: u64,
    /// `ferry_messages_in_flight`.
    pub in_flight: i64,
}

impl BindingCounts {
    /// `received = sent + dropped + filtered + expired + dead_lettered + in_flight`.
    pub fn is_conserved(&self) -> bool {
        i128::from(self.received)
            == i128::from(
                self.sent + self.dropped + self.filtered + self.expired + self.dead_lettered,
            ) + i128::from(self.in_flight)
    }
}

/// The `/metrics` text, parsed: every sample by name and labels.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    samples: BTreeMap<(String, String), f64>,
}

impl Metrics {
    /// Parses the Prometheus / OpenMetrics text format (samples only).
    pub fn parse(text: &str) -> Self {
        let mut samples = BTreeMap::new();
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let (series, value) = match line.rsplit_once(' ') {
                Some(x) => x,
                None => continue,
            };
            let (name, labels) = match series.split_once('{') {
                Some((n, l)) => (n, l.trim_end_matches('}')),
                None => (series, ""),
            };
            if let Ok(v) = value.parse::<f64>() {
                samples.insert((name.to_owned(), labels.to_owned()), v);
            }
        }
        Self { samples }
    }

    /// The value of `name` whose labels include `binding="…"` (and `route`, if given).
    pub fn get(&self, name: &str, route: &str, binding: &str) -> f64 {
        let want_b = format!("binding=\"{binding}\"");
        let want_r = format!("route=\"{route}\"");
        self.samples
            .iter()
            .find(|((n, l), _)| n == name && l.contains(&want_b) && l.contains(&want_r))
            .map_or(0.0, |(_, v)| *v)
    }

    /// The value of `name` whose labels include `route="…"` (0 when absent): a per-route
    /// metric.
    pub fn route(&self, name: &str, route: &str) -> f64 {
        let want = format!("route=\"{route}\"");
        self.samples
            .iter()
            .find(|((n, l), _)| n == name && l.contains(&want))
            .map_or(0.0, |(_, v)| *v)
    }

    /// The value of `name` whose labels include `session="…"` (0 when absent).
    pub fn session(&self, name: &str, session: &str) -> f64 {
        let want = format!("session=\"{session}\"");
        self.samples
            .iter()
            .find(|((n, l), _)| n == name && l.contains(&want))
            .map_or(0.0, |(_, v)| *v)
    }

    /// The conservation counters of one binding.
    pub fn binding(&self, route: &str, binding: &str) -> BindingCounts {
        let c = |name: &str| self.get(name, route, binding) as u64;
        BindingCounts {
            received: c("ferry_messages_received_total"),
            sent: c("ferry_messages_sent_total"),
            dropped: c("ferry_messages_dropped_total"),
            filtered: c("ferry_messages_filtered_total"),
            expired: c("ferry_messages_expired_total"),
            dead_lettered: c("ferry_messages_dead_lettered_total"),
            in_flight: self.get("ferry_messages_in_flight", route, binding) as i64,
        }
    }
}
