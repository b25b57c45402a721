//! Ferry's agent between A and B: its configuration and its process.
//!
//! The configuration follows `deploy/examples/durable-sensor-ingest.yaml`: a session per broker,
//! a receiver on `sensors/#` at QoS 1, one MQTT sender on B at QoS 1, one binding per
//! destination (`{prefix}/sensors`), SQLite outbox (`synchronous: full`), lease and DLQ in the
//! run's directory. The route is either `shared_outbox` with `fan_out` to three bindings or
//! `direct_hold` to one. A `shared_outbox` run may keep its three stores on PostgreSQL or
//! DynamoDB instead ([`Store`], `ferry-bench --store`, issue 19): a shared outbox needs a shared
//! lease, so the three move together.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};

use super::SOURCE_FILTER;
use crate::ChildProcess;

/// How long the agent may take to exit after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);
/// The same under Callgrind, which runs it about fifty times slower.
const STOP_TIMEOUT_UNDER_CALLGRIND: Duration = Duration::from_secs(120);

/// The route under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FerryRoute {
    /// `shared_outbox`, `fan_out` to every destination.
    SharedOutbox,
    /// `direct_hold` to the first destination.
    DirectHold,
}

/// Which backend holds the `shared_outbox` route's outbox, lease and dead letters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    /// SQLite files in the run's directory (`synchronous: full`): Ferry's edge default.
    Sqlite,
    /// A fresh PostgreSQL database per run (`ferry_tests::postgres`), dropped after it.
    Postgres,
    /// Fresh tables on the moto server (`ferry_tests::moto`), made by the agent
    /// (`create_tables: true`).
    Dynamodb,
}

impl Store {
    /// The `type` the configuration names it by.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sqlite => "sqlite",
            Self::Postgres => "postgres",
            Self::Dynamodb => "dynamodb",
        }
    }
}

/// Where one run's stores are: what the `stores:` block names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreSite {
    /// SQLite files in this directory.
    Sqlite(PathBuf),
    /// This PostgreSQL database (`postgres://…`).
    Postgres { url: String },
    /// Tables `{prefix}-outbox`, `-lease` and `-dlq` at this DynamoDB endpoint.
    Dynamodb { endpoint: String, prefix: String },
}

impl StoreSite {
    /// The `stores:` block: the same backend for the outbox, the lease and the DLQ.
    fn yaml(&self) -> String {
        let block = |kind: &str, options: &dyn Fn(&str) -> String| {
            ["outbox", "lease", "dlq"]
                .iter()
                .map(|store| {
                    format!(
                        "  {store}:\n    type: {kind}\n    options:\n{}",
                        options(store)
                    )
                })
                .collect::<String>()
        };
        let stores = match self {
            Self::Sqlite(dir) => {
                let dir = dir.display();
                block("sqlite", &|store| {
                    // Written out for the outbox, as in the example (it is every store's default).
                    let synchronous = if store == "outbox" {
                        "      synchronous: full\n"
                    } else {
                        ""
                    };
                    format!("      path: {dir}/{store}.db\n{synchronous}")
                })
            }
            Self::Postgres { url } => block("postgres", &|_| format!("      url: {url}\n")),
            Self::Dynamodb { endpoint, prefix } => block("dynamodb", &|store| {
                format!(
                    "      table_name: {prefix}-{store}\n      region: {}\n      \
                     endpoint_url: {endpoint}\n      create_tables: true\n",
                    crate::moto::REGION
                )
            }),
        };
        format!("stores:\n{stores}")
    }
}

/// Route settings the benchmark can vary (the defaults are the example's, which are Ferry's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FerryTuning {
    /// `policy.max_in_flight`.
    pub max_in_flight: u32,
    /// `policy.max_outbox_depth` (shared_outbox).
    pub max_outbox_depth: u32,
    /// `session.drain_batch_size` (shared_outbox).
    pub drain_batch_size: u32,
}

impl Default for FerryTuning {
    fn default() -> Self {
        Self {
            max_in_flight: 100,
            max_outbox_depth: 10_000,
            drain_batch_size: 50,
        }
    }
}

/// The agent's YAML for `route` from broker `source_url` to `destination_url`, with its stores
/// at `stores`, delivering to `prefixes` (only the first for `direct_hold`).
pub fn config(
    route: FerryRoute,
    tuning: FerryTuning,
    source_url: &str,
    destination_url: &str,
    stores: &StoreSite,
    prefixes: &[&str],
) -> String {
    let prefixes = match route {
        FerryRoute::SharedOutbox => prefixes,
        FerryRoute::DirectHold => &prefixes[..prefixes.len().min(1)],
    };
    let bindings: String = prefixes
        .iter()
        .map(|prefix| {
            format!("  - id: to-{prefix}\n    sender_id: to-b\n    address: {prefix}/sensors\n")
        })
        .collect();
    let binding_ids = prefixes
        .iter()
        .map(|prefix| format!("to-{prefix}"))
        .collect::<Vec<_>>()
        .join(", ");
    let FerryTuning {
        max_in_flight,
        max_outbox_depth,
        drain_batch_size,
    } = tuning;
    let route = match route {
        FerryRoute::SharedOutbox => format!(
            "  - id: sensor-ingest\n    receiver_id: sensors-in\n    delivery_mode: shared_outbox\n    \
             dispatch_mode: fan_out\n    bindings: [{binding_ids}]\n    policy:\n      \
             ack_after: outbox_persist\n      max_in_flight: {max_in_flight}\n      \
             max_outbox_depth: {max_outbox_depth}\n    session:\n      session_id: broker-b\n      \
             sender_id: to-b\n      drain_interval: 1s\n      drain_batch_size: {drain_batch_size}\n"
        ),
        FerryRoute::DirectHold => format!(
            "  - id: sensor-direct\n    receiver_id: sensors-in\n    delivery_mode: direct_hold\n    \
             bindings: [{binding_ids}]\n    policy:\n      ack_after: target_accept\n      \
             max_in_flight: {max_in_flight}\n"
        ),
    };
    format!(
        "# Generated by ferry-bench.\n\
         bridge:\n  id: ferry-bench\n\
         sessions:\n\
         \x20 - id: broker-a\n    transport: mqtt\n    options:\n      session:\n        \
         broker_url: {source_url}\n        client_id: ferry-bench-in\n\
         \x20 - id: broker-b\n    transport: mqtt\n    options:\n      session:\n        \
         broker_url: {destination_url}\n        client_id: ferry-bench-out\n\
         {stores}\
         receivers:\n\
         \x20 - id: sensors-in\n    session_id: broker-a\n    topics:\n      - topic: \"{SOURCE_FILTER}\"\n        qos: 1\n\
         senders:\n\
         \x20 - id: to-b\n    session_id: broker-b\n    options:\n      sender:\n        qos: 1\n\
         bindings:\n{bindings}\
         routes:\n{route}",
        stores = stores.yaml(),
    )
}

/// The `ferry-agent` binary: `explicit`, else `$FERRY_BIN_DIR/ferry-agent`, else the one next to
/// this executable (`target/release/` when run with `cargo run --release`).
pub fn agent_binary(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    let path = match (explicit, std::env::var_os("FERRY_BIN_DIR")) {
        (Some(path), _) => path.to_path_buf(),
        (None, Some(dir)) => PathBuf::from(dir).join("ferry-agent"),
        (None, None) => std::env::current_exe()
            .context("locating ferry-bench")?
            .with_file_name("ferry-agent"),
    };
    if !path.is_file() {
        bail!(
            "{} not found: build it with `cargo build --release -p ferry-agent`, or pass --agent",
            path.display()
        );
    }
    Ok(path)
}

/// Whether `binary` has the `run` command (it prints its help and exits 0).
pub fn has_run_command(binary: &Path) -> bool {
    Command::new(binary)
        .args(["run", "--help"])
        .output()
        .is_ok_and(|output| output.status.success())
}

/// Checks a configuration with `ferry-agent validate` (available before `run` is).
pub fn validate(binary: &Path, config: &Path) -> anyhow::Result<()> {
    let output = Command::new(binary)
        .arg("validate")
        .arg(config)
        .output()
        .with_context(|| format!("running {} validate", binary.display()))?;
    if !output.status.success() {
        bail!(
            "the generated configuration is invalid:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

/// A running agent.
pub struct Agent {
    process: ChildProcess,
    admin_port: u16,
    stop_timeout: Duration,
}

impl Agent {
    /// Starts `binary run --config {config} --admin-listen 127.0.0.1:{free port} --agent-id
    /// ferry-bench`, with its output in `dir` and `env` added to its environment; under Callgrind
    /// (its dumps in `dir` too) when `callgrind` is set.
    pub fn start(
        binary: &Path,
        config: &Path,
        dir: &Path,
        env: &[(&str, String)],
        callgrind: bool,
    ) -> anyhow::Result<Self> {
        let admin_port = crate::free_port()?;
        let admin = SocketAddr::from((Ipv4Addr::LOCALHOST, admin_port));
        let mut command = if callgrind {
            super::callgrind::command(binary, dir)
        } else {
            Command::new(binary)
        };
        command
            .arg("run")
            .arg("--config")
            .arg(config)
            .arg("--admin-listen")
            .arg(admin.to_string())
            .arg("--agent-id")
            .arg("ferry-bench")
            .envs(env.iter().map(|(key, value)| (key, value)));
        let process = ChildProcess::spawn_command(command, "ferry-agent", dir)?;
        Ok(Self {
            process,
            admin_port,
            stop_timeout: if callgrind {
                STOP_TIMEOUT_UNDER_CALLGRIND
            } else {
                STOP_TIMEOUT
            },
        })
    }

    /// The process id (for RSS and CPU sampling; Callgrind's, which is the agent's).
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Fails with the end of the agent's output if it has exited.
    pub fn check_running(&mut self) -> anyhow::Result<()> {
        if self.process.is_running() {
            return Ok(());
        }
        bail!("ferry-agent exited early\n{}", self.process.output_tail())
    }

    /// SIGTERM, then waits for the exit; fails (with its output) unless it exits 0 in time.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        let status = self.process.terminate(self.stop_timeout).await?;
        if !status.success() {
            bail!(
                "ferry-agent exited with {status} after SIGTERM\n{}",
                self.process.output_tail()
            );
        }
        Ok(())
    }

    /// Writes the agent's `/metrics` to `path` (best effort: a diagnostic, not a figure).
    pub fn save_metrics(&self, path: &Path) {
        match crate::agent::http_get(self.admin_port, "/metrics") {
            Ok((_, body)) => {
                if let Err(error) = std::fs::write(path, body) {
                    eprintln!("  writing {}: {error}", path.display());
                }
            }
            Err(error) => eprintln!("  reading the agent's /metrics: {error:#}"),
        }
    }

    /// The end of the agent's output.
    pub fn output_tail(&self) -> String {
        self.process.output_tail()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fan_out_config_names_every_binding() {
        let yaml = config(
            FerryRoute::SharedOutbox,
            FerryTuning::default(),
            "tcp://127.0.0.1:1",
            "tcp://127.0.0.1:2",
            &StoreSite::Sqlite(PathBuf::from("/tmp/x")),
            &["events", "audit", "analytics"],
        );
        assert!(yaml.contains("bindings: [to-events, to-audit, to-analytics]"));
        assert!(yaml.contains("synchronous: full"));
        assert!(yaml.contains("address: analytics/sensors"));
    }

    #[test]
    fn direct_hold_config_has_one_binding() {
        let yaml = config(
            FerryRoute::DirectHold,
            FerryTuning::default(),
            "tcp://127.0.0.1:1",
            "tcp://127.0.0.1:2",
            &StoreSite::Sqlite(PathBuf::from("/tmp/x")),
            &["events", "audit", "analytics"],
        );
        assert!(yaml.contains("bindings: [to-events]"));
        assert!(!yaml.contains("to-audit"));
        assert!(!yaml.contains("session_id: broker-b\n      sender_id"));
    }

    /// The fan-out configuration with `stores`, as the agent's validator sees it.
    fn check(stores: &StoreSite) -> Result<(), Vec<String>> {
        let yaml = config(
            FerryRoute::SharedOutbox,
            FerryTuning::default(),
            "tcp://127.0.0.1:1",
            "tcp://127.0.0.1:2",
            stores,
            &["events", "audit", "analytics"],
        );
        let no_env = |_: &str| None;
        ferry_shared::config::check_bytes(yaml.as_bytes(), &no_env)
            .map(drop)
            .map_err(|error| error.messages())
    }

    #[test]
    fn sqlite_and_postgres_stores_make_a_valid_configuration() {
        let sqlite = StoreSite::Sqlite(PathBuf::from("/tmp/x"));
        assert_eq!(check(&sqlite), Ok(()));
        let postgres = StoreSite::Postgres {
            url: "postgres://postgres@127.0.0.1:5432/ferry_bench".to_owned(),
        };
        assert_eq!(check(&postgres), Ok(()));
    }

    /// The DynamoDB block names three fresh tables and asks the agent to create them, and
    /// passes the validator.
    #[test]
    fn the_dynamodb_block_names_three_fresh_tables() {
        let site = StoreSite::Dynamodb {
            endpoint: "http://127.0.0.1:5000".to_owned(),
            prefix: "bench-1".to_owned(),
        };
        let yaml = site.yaml();
        for store in ["outbox", "lease", "dlq"] {
            let block = format!(
                "  {store}:\n    type: dynamodb\n    options:\n      table_name: bench-1-{store}\n      \
                 region: us-east-1\n      endpoint_url: http://127.0.0.1:5000\n      create_tables: true\n"
            );
            assert!(yaml.contains(&block), "{yaml}");
        }
        assert_eq!(check(&site), Ok(()));
    }
}
