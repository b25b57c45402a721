//! `ferryctl`: manage Ferry through the control plane's gRPC API, kubectl
//! style. Tables by default, `-o json|yaml` for scripts; any failure exits
//! non-zero with one clear line on stderr (or the validator's whole list for a
//! rejected configuration). Everything goes to stdout through [`out!`] and
//! [`outln!`]: a reader that goes away (`ferryctl get configs | head -1`)
//! ends the command quietly with exit 0 instead of a "Broken pipe" panic.

/// `print!` that returns the write error instead of panicking (see
/// [`output::write_stdout`]).
macro_rules! out {
    ($($arg:tt)*) => { $crate::output::write_stdout(format_args!($($arg)*)) };
}

/// `println!` that returns the write error instead of panicking.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::output::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

mod output;
mod views;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use ferry_shared::api::v1 as pb;
use pb::agent_service_client::AgentServiceClient;
use pb::config_service_client::ConfigServiceClient;
use pb::dlq_service_client::DlqServiceClient;
use pb::lease_service_client::LeaseServiceClient;
use pb::metrics_service_client::MetricsServiceClient;
use tonic::transport::{Channel, Endpoint};

use crate::output::Format;
use crate::views::{
    AgentBindingView, AgentView, ConfigView, DlqEntryView, LeaseView, RedriveView, RouteView,
    TotalsView, VersionView,
};

/// Manage Ferry bridges, agents, leases and dead letters.
#[derive(Debug, Parser)]
#[command(name = "ferryctl", version)]
struct Cli {
    /// The control plane's gRPC endpoint.
    #[arg(
        long,
        global = true,
        env = "FERRY_ENDPOINT",
        default_value = "http://127.0.0.1:50051"
    )]
    endpoint: String,
    /// Output format.
    #[arg(short = 'o', long, global = true, value_enum, default_value_t = Format::Table)]
    output: Format,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create or replace a bridge configuration from a YAML file.
    Apply {
        /// The configuration file (`-` for standard input).
        #[arg(short = 'f', long = "filename")]
        file: PathBuf,
        /// Run it on agents with this label (repeatable, `key=value`).
        #[arg(long = "selector", value_parser = parse_label)]
        selector: Vec<(String, String)>,
        /// Apply only if the current version is this one (0: must not exist).
        #[arg(long)]
        expected_version: Option<u64>,
        /// A note stored with the new version.
        #[arg(long, default_value = "")]
        note: String,
    },
    /// List resources.
    Get {
        #[command(subcommand)]
        what: Get,
    },
    /// Show one resource in detail.
    Describe {
        #[command(subcommand)]
        what: Describe,
    },
    /// List the versions of a configuration, newest first.
    History {
        /// The configuration's bridge id.
        config: String,
    },
    /// Make an old version of a configuration current again (as a new version).
    Rollback {
        /// The configuration's bridge id.
        config: String,
        /// The version to go back to.
        #[arg(long)]
        to: u64,
    },
    /// Delete a configuration and its history.
    Delete {
        /// The configuration's bridge id.
        config: String,
    },
    /// Inspect and act on dead letters.
    Dlq {
        #[command(subcommand)]
        action: Dlq,
    },
    /// Fleet totals of the conservation counters, per route and binding
    /// (per agent with --by-agent), from the agents' latest snapshots.
    Metrics {
        /// Only this bridge.
        #[arg(long)]
        bridge: Option<String>,
        /// One row per agent and binding instead of fleet totals.
        #[arg(long)]
        by_agent: bool,
    },
}

#[derive(Debug, Subcommand)]
enum Get {
    /// Configurations (current versions).
    Configs,
    /// The routes of one configuration (current version).
    Routes {
        /// The configuration's bridge id.
        config: String,
    },
    /// Agents, the versions they run and their latest counters, then the
    /// fleet's totals.
    Agents {
        /// Refresh in place every --interval until interrupted.
        #[arg(long)]
        watch: bool,
        /// Seconds between refreshes with --watch.
        #[arg(long, value_name = "SECONDS", default_value_t = 2, requires = "watch",
              value_parser = clap::value_parser!(u64).range(1..))]
        interval: u64,
    },
    /// Leases and their fencing versions.
    Leases {
        /// Only keys starting with this prefix.
        #[arg(long, default_value = "")]
        prefix: String,
    },
    /// Dead letters.
    Dlq {
        #[command(flatten)]
        filter: DlqFilterArgs,
        /// At most this many entries.
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
}

#[derive(Debug, Subcommand)]
enum Describe {
    /// A configuration version, with its document.
    Config {
        /// The configuration's bridge id.
        id: String,
        /// A version other than the current one.
        #[arg(long)]
        version: Option<u64>,
    },
    /// An agent, with the status (ACK / NACK and error) of each configuration.
    Agent {
        /// The agent id.
        id: String,
    },
}

#[derive(Debug, Subcommand)]
enum Dlq {
    /// Show one entry with its message.
    Show {
        /// The entry id.
        id: String,
    },
    /// Deliver entries to their binding again; each is deleted once its
    /// redelivery is durable.
    Redrive {
        /// Entry ids; without ids, `--bridge/--route/--binding/--reason` select.
        ids: Vec<String>,
        #[command(flatten)]
        filter: DlqFilterArgs,
        /// At most this many entries in this call.
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Delete one entry.
    Delete {
        /// The entry id.
        id: String,
    },
    /// Delete every entry matching the filter.
    Purge {
        #[command(flatten)]
        filter: DlqFilterArgs,
        /// Confirm the purge; without it nothing is deleted.
        #[arg(long)]
        yes: bool,
    },
    /// Entry counts per route, binding and reason.
    Stats {
        #[command(flatten)]
        filter: DlqFilterArgs,
    },
}

#[derive(Debug, clap::Args)]
struct DlqFilterArgs {
    /// Only this bridge.
    #[arg(long)]
    bridge: Option<String>,
    /// Only this route.
    #[arg(long)]
    route: Option<String>,
    /// Only this binding.
    #[arg(long)]
    binding: Option<String>,
    /// Only this reason.
    #[arg(long, value_parser = ["permanent_error", "replay_exhausted", "expired", "oversized"])]
    reason: Option<String>,
}

impl DlqFilterArgs {
    fn to_proto(&self) -> pb::DlqFilter {
        let reason = match self.reason.as_deref() {
            Some("permanent_error") => pb::DlqReason::PermanentError,
            Some("replay_exhausted") => pb::DlqReason::ReplayExhausted,
            Some("expired") => pb::DlqReason::Expired,
            Some("oversized") => pb::DlqReason::Oversized,
            _ => pb::DlqReason::Unspecified,
        };
        pb::DlqFilter {
            bridge_id: self.bridge.clone().unwrap_or_default(),
            route_id: self.route.clone().unwrap_or_default(),
            binding_id: self.binding.clone().unwrap_or_default(),
            reason: reason.into(),
            since: None,
            until: None,
        }
    }
}

fn parse_label(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(format!("expected key=value, got {text:?}")),
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        // The reader closed the pipe: it has all it wanted.
        Err(error) if output::is_broken_pipe(&error) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("ferryctl: {}", describe_error(&error));
            ExitCode::FAILURE
        }
    }
}

/// One line (or the validator's list) for any failure: a gRPC status shows
/// its code and message, anything else its context chain.
fn describe_error(error: &anyhow::Error) -> String {
    if let Some(status) = error.downcast_ref::<tonic::Status>() {
        let message = status.message();
        return if message.is_empty() {
            format!("{:?} (the control plane gave no detail)", status.code())
        } else if message.contains('\n') {
            format!("{:?}:\n{message}", status.code())
        } else {
            format!("{:?}: {message}", status.code())
        };
    }
    format!("{error:#}")
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let out = cli.output;
    // Checks that need no server come first, so a mistyped command fails
    // without a connection attempt.
    match cli.command {
        Command::Apply {
            file,
            selector,
            expected_version,
            note,
        } => {
            let yaml = read_document(&file)?;
            let channel = connect(&cli.endpoint).await?;
            apply(channel, out, yaml, selector, expected_version, note).await
        }
        Command::Dlq {
            action: Dlq::Purge { yes: false, .. },
        } => anyhow::bail!("purge deletes entries for good: add --yes to confirm"),
        command => {
            let channel = connect(&cli.endpoint).await?;
            dispatch(channel, out, command).await
        }
    }
}

async fn dispatch(channel: Channel, out: Format, command: Command) -> anyhow::Result<()> {
    match command {
        // Handled by `run` before connecting.
        Command::Apply { .. } => Ok(()),
        Command::Get { what } => get(channel, out, what).await,
        Command::Describe { what } => describe(channel, out, what).await,
        Command::History { config } => {
            let client = ConfigServiceClient::new(channel);
            let versions = all_pages(|page_token| {
                let (mut client, bridge_id) = (client.clone(), config.clone());
                async move {
                    let page = client
                        .list_config_versions(pb::ListConfigVersionsRequest {
                            bridge_id,
                            page_size: 0,
                            page_token,
                        })
                        .await?
                        .into_inner();
                    Ok((page.versions, page.next_page_token))
                }
            })
            .await?;
            let versions: Vec<VersionView> = versions.into_iter().map(Into::into).collect();
            output::list(out, &versions)
        }
        Command::Rollback { config, to } => {
            let response = ConfigServiceClient::new(channel)
                .rollback_config(pb::RollbackConfigRequest {
                    bridge_id: config,
                    to_version: to,
                    expected_version: None,
                })
                .await?
                .into_inner();
            let config = response
                .config
                .context("the server returned no configuration")?;
            let view = ConfigView::new(config, false);
            if out == Format::Table {
                outln!(
                    "bridge {} rolled back to version {to}: now version {}",
                    view.bridge_id,
                    view.version
                )?;
                return Ok(());
            }
            output::object(out, &view, ConfigView::pairs)
        }
        Command::Delete { config } => {
            ConfigServiceClient::new(channel)
                .delete_config(pb::DeleteConfigRequest {
                    bridge_id: config.clone(),
                    expected_version: None,
                })
                .await?;
            outln!("bridge {config} deleted")?;
            Ok(())
        }
        Command::Dlq { action } => dlq(channel, out, action).await,
        Command::Metrics { bridge, by_agent } => metrics(channel, out, bridge, by_agent).await,
    }
}

/// Every agent with its latest snapshot, then (tables) the fleet's totals.
async fn agents(channel: Channel, out: Format) -> anyhow::Result<()> {
    let client = AgentServiceClient::new(channel.clone());
    let agents = all_pages(|page_token| {
        let mut client = client.clone();
        async move {
            let page = client
                .list_agents(pb::ListAgentsRequest {
                    page_size: 0,
                    page_token,
                })
                .await?
                .into_inner();
            Ok((page.agents, page.next_page_token))
        }
    })
    .await?;
    let mut metrics = MetricsServiceClient::new(channel);
    let mut snapshots: HashMap<String, pb::MetricsSnapshot> = metrics
        .list_metrics(pb::ListMetricsRequest::default())
        .await?
        .into_inner()
        .snapshots
        .into_iter()
        .map(|s| (s.agent_id.clone(), s))
        .collect();
    let rows: Vec<AgentView> = agents
        .into_iter()
        .map(|a| {
            let snapshot = snapshots.remove(&a.agent_id);
            AgentView::with_metrics(a, snapshot)
        })
        .collect();
    output::list(out, &rows)?;
    if out == Format::Table {
        let totals = metrics
            .get_totals(pb::GetTotalsRequest::default())
            .await?
            .into_inner();
        let f = totals.fleet.unwrap_or_default();
        let depth: u64 = totals.bindings.iter().map(|b| b.outbox_depth).sum();
        outln!(
            "fleet: {} agents ({} connected), received {}, sent {}, dlq {}, in flight {}, depth {}",
            totals.agents,
            totals.agents_connected,
            f.received,
            f.sent,
            f.dead_lettered,
            f.in_flight,
            depth
        )?;
    }
    Ok(())
}

/// Runs `show` every `seconds` until Ctrl-C; clears the screen first when
/// stdout is a terminal and the output a table (a pipe gets each refresh
/// after the previous one).
async fn watch<F, Fut>(seconds: u64, out: Format, mut show: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    use std::io::IsTerminal;
    let clear = out == Format::Table && std::io::stdout().is_terminal();
    let mut ticker = tokio::time::interval(std::time::Duration::from_secs(seconds));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            interrupted = tokio::signal::ctrl_c() => return Ok(interrupted?),
            _ = ticker.tick() => {}
        }
        if clear {
            out!("\x1b[2J\x1b[H")?;
        }
        show().await?;
        if !clear {
            outln!("")?;
        }
    }
}

/// `ferryctl metrics`: fleet totals per binding, or one row per agent and
/// binding.
async fn metrics(
    channel: Channel,
    out: Format,
    bridge: Option<String>,
    by_agent: bool,
) -> anyhow::Result<()> {
    let mut client = MetricsServiceClient::new(channel);
    let bridge_id = bridge.unwrap_or_default();
    if by_agent {
        let snapshots = client
            .list_metrics(pb::ListMetricsRequest { bridge_id })
            .await?
            .into_inner()
            .snapshots;
        let rows: Vec<AgentBindingView> = snapshots
            .into_iter()
            .flat_map(|s| {
                let agent = s.agent_id.clone();
                crate::views::AgentMetricsView::from(s)
                    .bindings
                    .into_iter()
                    .map(move |figures| AgentBindingView {
                        agent_id: agent.clone(),
                        figures,
                    })
            })
            .collect();
        return output::list(out, &rows);
    }
    let totals = client
        .get_totals(pb::GetTotalsRequest { bridge_id })
        .await?
        .into_inner();
    let rows: Vec<TotalsView> = totals
        .bindings
        .into_iter()
        .map(|b| {
            TotalsView::new(
                b.bridge_id,
                b.route_id,
                b.binding_id,
                b.counters.unwrap_or_default(),
                b.outbox_depth,
            )
        })
        .collect();
    output::list(out, &rows)?;
    if out == Format::Table {
        outln!(
            "agents: {} ({} connected)",
            totals.agents,
            totals.agents_connected
        )?;
    }
    Ok(())
}

/// Follows `next_page_token` from the first page to the last and returns
/// every item; `fetch` gets a page token and returns one page and the next
/// token (empty after the last page).
async fn all_pages<T, F, Fut>(mut fetch: F) -> anyhow::Result<Vec<T>>
where
    F: FnMut(String) -> Fut,
    Fut: std::future::Future<Output = Result<(Vec<T>, String), tonic::Status>>,
{
    let mut items = Vec::new();
    let mut page_token = String::new();
    loop {
        let (page, next) = fetch(page_token).await?;
        items.extend(page);
        if next.is_empty() {
            return Ok(items);
        }
        page_token = next;
    }
}

async fn connect(endpoint: &str) -> anyhow::Result<Channel> {
    let endpoint = Endpoint::from_shared(endpoint.to_owned())
        .with_context(|| format!("invalid endpoint {endpoint:?}"))?
        .connect_timeout(std::time::Duration::from_secs(5));
    endpoint
        .connect()
        .await
        .with_context(|| format!("cannot reach the control plane at {}", endpoint.uri()))
}

/// The configuration document from a file, or standard input for `-`.
fn read_document(file: &PathBuf) -> anyhow::Result<Vec<u8>> {
    if file.as_os_str() == "-" {
        let mut text = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut text)
            .context("reading the configuration from standard input")?;
        return Ok(text);
    }
    std::fs::read(file).with_context(|| format!("reading {}", file.display()))
}

async fn apply(
    channel: Channel,
    out: Format,
    yaml: Vec<u8>,
    selector: Vec<(String, String)>,
    expected_version: Option<u64>,
    note: String,
) -> anyhow::Result<()> {
    let response = ConfigServiceClient::new(channel)
        .apply_config(pb::ApplyConfigRequest {
            document: Some(pb::apply_config_request::Document::Yaml(yaml)),
            selector: Some(pb::LabelSelector {
                match_labels: selector.into_iter().collect(),
            }),
            expected_version,
            change_note: note,
        })
        .await?
        .into_inner();
    let config = response
        .config
        .context("the server returned no configuration")?;
    let view = ConfigView::new(config, false);
    if out == Format::Table {
        if response.changed {
            outln!(
                "bridge {} configured: version {}",
                view.bridge_id,
                view.version
            )?;
        } else {
            outln!(
                "bridge {} unchanged: version {}",
                view.bridge_id,
                view.version
            )?;
        }
        return Ok(());
    }
    output::object(out, &view, ConfigView::pairs)
}

async fn get(channel: Channel, out: Format, what: Get) -> anyhow::Result<()> {
    match what {
        Get::Configs => {
            let client = ConfigServiceClient::new(channel);
            let configs = all_pages(|page_token| {
                let mut client = client.clone();
                async move {
                    let page = client
                        .list_configs(pb::ListConfigsRequest {
                            page_size: 0,
                            page_token,
                        })
                        .await?
                        .into_inner();
                    Ok((page.configs, page.next_page_token))
                }
            })
            .await?;
            let rows: Vec<ConfigView> = configs
                .into_iter()
                .map(|c| ConfigView::new(c, false))
                .collect();
            output::list(out, &rows)
        }
        Get::Routes { config } => {
            let stored = ConfigServiceClient::new(channel)
                .get_config(pb::GetConfigRequest {
                    bridge_id: config,
                    version: 0,
                })
                .await?
                .into_inner()
                .config
                .context("the server returned no configuration")?;
            output::list(out, &RouteView::from_document(&stored.yaml)?)
        }
        Get::Agents {
            watch: false,
            interval: _,
        } => agents(channel, out).await,
        Get::Agents {
            watch: true,
            interval,
        } => watch(interval, out, || agents(channel.clone(), out)).await,
        Get::Leases { prefix } => {
            let client = LeaseServiceClient::new(channel);
            let leases = all_pages(|page_token| {
                let (mut client, key_prefix) = (client.clone(), prefix.clone());
                async move {
                    let page = client
                        .list_leases(pb::ListLeasesRequest {
                            key_prefix,
                            page_size: 0,
                            page_token,
                        })
                        .await?
                        .into_inner();
                    Ok((page.leases, page.next_page_token))
                }
            })
            .await?;
            let rows: Vec<LeaseView> = leases.into_iter().map(Into::into).collect();
            output::list(out, &rows)
        }
        Get::Dlq { filter, limit } => {
            let page = DlqServiceClient::new(channel)
                .list_dlq_entries(pb::ListDlqEntriesRequest {
                    filter: Some(filter.to_proto()),
                    page_size: limit,
                    page_token: String::new(),
                    omit_payload: true,
                })
                .await?
                .into_inner();
            let rows: Vec<DlqEntryView> = page.entries.into_iter().map(Into::into).collect();
            output::list(out, &rows)?;
            if out == Format::Table && !page.next_page_token.is_empty() {
                outln!("(more entries: raise --limit or narrow the filter)")?;
            }
            Ok(())
        }
    }
}

async fn describe(channel: Channel, out: Format, what: Describe) -> anyhow::Result<()> {
    match what {
        Describe::Config { id, version } => {
            let config = ConfigServiceClient::new(channel)
                .get_config(pb::GetConfigRequest {
                    bridge_id: id,
                    version: version.unwrap_or(0),
                })
                .await?
                .into_inner()
                .config
                .context("the server returned no configuration")?;
            output::object(out, &ConfigView::new(config, true), ConfigView::pairs)
        }
        Describe::Agent { id } => {
            let agent = AgentServiceClient::new(channel.clone())
                .get_agent(pb::GetAgentRequest { agent_id: id })
                .await?
                .into_inner()
                .agent
                .context("the server returned no agent")?;
            let snapshot = match MetricsServiceClient::new(channel)
                .get_agent_metrics(pb::GetAgentMetricsRequest {
                    agent_id: agent.agent_id.clone(),
                })
                .await
            {
                Ok(response) => response.into_inner().snapshot,
                Err(status) if status.code() == tonic::Code::NotFound => None,
                Err(status) => return Err(status.into()),
            };
            let view = AgentView::with_metrics(agent, snapshot);
            output::object(out, &view, AgentView::pairs)
        }
    }
}

async fn dlq(channel: Channel, out: Format, action: Dlq) -> anyhow::Result<()> {
    let mut client = DlqServiceClient::new(channel);
    match action {
        Dlq::Show { id } => {
            let entry = client
                .get_dlq_entry(pb::GetDlqEntryRequest { id })
                .await?
                .into_inner()
                .entry
                .context("the server returned no entry")?;
            output::object(out, &DlqEntryView::from(entry), DlqEntryView::pairs)
        }
        Dlq::Redrive { ids, filter, limit } => {
            let response = client
                .redrive_dlq_entries(pb::RedriveDlqEntriesRequest {
                    ids,
                    filter: Some(filter.to_proto()),
                    limit,
                })
                .await?
                .into_inner();
            let failed = response.outcomes.iter().filter(|o| !o.ok).count();
            let rows: Vec<RedriveView> = response
                .outcomes
                .into_iter()
                .map(|o| RedriveView {
                    id: o.id,
                    ok: o.ok,
                    error: o.error,
                })
                .collect();
            output::list(out, &rows)?;
            if response.truncated && out == Format::Table {
                outln!("(more entries matched: run again or raise --limit)")?;
            }
            if failed > 0 {
                anyhow::bail!("{failed} of {} entries were not redriven", rows.len());
            }
            Ok(())
        }
        Dlq::Delete { id } => {
            client
                .delete_dlq_entry(pb::DeleteDlqEntryRequest { id: id.clone() })
                .await?;
            outln!("entry {id} deleted")?;
            Ok(())
        }
        // `--yes` was checked before connecting.
        Dlq::Purge { filter, .. } => {
            let purged = client
                .purge_dlq_entries(pb::PurgeDlqEntriesRequest {
                    filter: Some(filter.to_proto()),
                    confirm: true,
                })
                .await?
                .into_inner()
                .purged;
            outln!("{purged} entries purged")?;
            Ok(())
        }
        Dlq::Stats { filter } => {
            let stats = client
                .get_dlq_stats(pb::GetDlqStatsRequest {
                    filter: Some(filter.to_proto()),
                })
                .await?
                .into_inner();
            let text = output::table(
                &["BRIDGE", "ROUTE", "BINDING", "REASON", "COUNT", "OLDEST"],
                stats.stats.iter().map(|s| {
                    vec![
                        s.bridge_id.clone(),
                        s.route_id.clone(),
                        s.binding_id.clone(),
                        views::reason_name(s.reason).to_owned(),
                        s.count.to_string(),
                        output::timestamp(s.oldest.as_ref()),
                    ]
                }),
            );
            match out {
                Format::Table => {
                    out!("{text}")?;
                    outln!("total: {}", stats.total)?;
                    Ok(())
                }
                _ => {
                    let rows: Vec<serde_json::Value> = stats
                        .stats
                        .iter()
                        .map(|s| {
                            serde_json::json!({
                                "bridge_id": s.bridge_id,
                                "route_id": s.route_id,
                                "binding_id": s.binding_id,
                                "reason": views::reason_name(s.reason),
                                "count": s.count,
                                "oldest": output::timestamp(s.oldest.as_ref()),
                            })
                        })
                        .collect();
                    let value = serde_json::json!({ "stats": rows, "total": stats.total });
                    output::object(out, &value, |_| Vec::new())
                }
            }
        }
    }
}
