//! `ferryctl`: manage Ferry through the control plane's gRPC API, kubectl
//! style. Tables by default, `-o json|yaml` for scripts; any failure exits
//! non-zero with one clear line on stderr (or the validator's whole list for a
//! rejected configuration). Everything goes to stdout through [`out!`] and
//! [`outln!`]: a reader that goes away (`ferryctl get configs | head -1`)
//! ends the command quietly with exit 0 instead of a "Broken pipe" panic.
//!
//! This file is the command line and its dispatch; each resource is a module
//! with its calls and its views (how its messages are shown): [`configs`],
//! [`agents`], [`leases`], [`dlq`], [`metrics`], [`token`]. [`paging`] follows page
//! tokens for every listing, [`output`] renders tables, JSON and YAML.

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

mod agents;
mod configs;
mod dlq;
mod leases;
mod metrics;
mod output;
mod paging;
mod token;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Parser, Subcommand};
use ferry_shared::auth::client::{AuthChannel, ClientAuth};
use ferry_shared::config::ProcessEnv;
use ferry_shared::dlq::{DlqFilter, DlqReason};
use ferry_shared::telemetry::TelemetryArgs;
use tracing::Instrument;

use crate::output::Format;

/// Shown at the end of `--help`. Every line is a command the unit tests parse.
const EXAMPLES: &str = "\
Examples:
  ferryctl apply -f deploy/examples/durable-sensor-ingest.yaml --selector site=plant-1
  ferryctl get configs
  ferryctl get agents --watch
  ferryctl describe agent edge-01
  ferryctl history durable-sensor-ingest
  ferryctl rollback durable-sensor-ingest --to 1
  ferryctl get dlq --bridge durable-sensor-ingest --reason oversized
  ferryctl dlq redrive --route sensor-ingest --limit 50
  ferryctl -o json metrics --by-agent
  ferryctl --endpoint https://cp:50051 --ca-cert ca.crt get agents    # token in FERRY_TOKEN
  ferryctl token hash --name alice --role operator    # the token on stdin
  ferryctl --endpoint http://127.0.0.1:9464 get dlq    # an agent's own dead letters";

/// Manage Ferry bridges, agents, leases and dead letters.
#[derive(Debug, Parser)]
#[command(name = "ferryctl", version, after_help = EXAMPLES)]
struct Cli {
    /// The control plane's gRPC endpoint.
    #[arg(
        long,
        global = true,
        env = "FERRY_ENDPOINT",
        default_value = "http://127.0.0.1:50051"
    )]
    endpoint: String,
    /// Bearer token to present (prefer `FERRY_TOKEN`: a flag shows in `ps`).
    #[arg(long, global = true, env = "FERRY_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// PEM CA certificate that the `https://` endpoint's certificate must
    /// chain to (default: the system's roots).
    #[arg(long, global = true, env = "FERRY_CA_CERT")]
    ca_cert: Option<PathBuf>,
    /// PEM client certificate for mTLS (with `--client-key`).
    #[arg(
        long,
        global = true,
        env = "FERRY_CLIENT_CERT",
        requires = "client_key"
    )]
    client_cert: Option<PathBuf>,
    /// PEM private key of `--client-cert`.
    #[arg(
        long,
        global = true,
        env = "FERRY_CLIENT_KEY",
        requires = "client_cert"
    )]
    client_key: Option<PathBuf>,
    /// Output format.
    #[arg(short = 'o', long, global = true, value_enum, default_value_t = Format::Table)]
    output: Format,
    /// Logging (default `warn`) and span export: with an OTLP endpoint each command is a
    /// trace that the control plane's RPC spans join.
    #[command(flatten)]
    telemetry: TelemetryArgs,
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
    /// Token-file entries.
    Token {
        #[command(subcommand)]
        action: Token,
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

impl Command {
    /// The command's name, for its span.
    fn name(&self) -> &'static str {
        match self {
            Command::Apply { .. } => "apply",
            Command::Get { .. } => "get",
            Command::Describe { .. } => "describe",
            Command::History { .. } => "history",
            Command::Rollback { .. } => "rollback",
            Command::Delete { .. } => "delete",
            Command::Dlq { .. } => "dlq",
            Command::Metrics { .. } => "metrics",
            Command::Token { .. } => "token",
        }
    }
}

#[derive(Debug, Subcommand)]
enum Get {
    /// Configurations (current versions); `-o json|yaml` includes each
    /// document, its secrets masked.
    Configs {
        /// Show the documents' secrets as stored (needs the admin role).
        #[arg(long)]
        show_secrets: bool,
    },
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
enum Token {
    /// Read a token on standard input and print its entry for the server's
    /// `--tokens` file (its SHA-256, never the token).
    Hash {
        /// The principal's name, as audit records show it.
        #[arg(long)]
        name: String,
        /// admin, operator, viewer or agent.
        #[arg(long)]
        role: String,
        /// For `--role agent`: the agent id the token acts as.
        #[arg(long)]
        agent_id: Option<String>,
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
        /// Show the document's secrets as stored (needs the admin role).
        #[arg(long)]
        show_secrets: bool,
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
    #[arg(long, value_parser = reason_parser())]
    reason: Option<DlqReason>,
}

impl From<DlqFilterArgs> for DlqFilter {
    fn from(args: DlqFilterArgs) -> Self {
        DlqFilter {
            bridge_id: args.bridge,
            route_id: args.route,
            binding_id: args.binding,
            reason: args.reason,
            since: None,
            until: None,
        }
    }
}

/// `--reason`: one of the shared model's reason names, listed in `--help`.
fn reason_parser() -> impl TypedValueParser<Value = DlqReason> {
    PossibleValuesParser::new(DlqReason::ALL.map(DlqReason::as_str))
        .try_map(|name| DlqReason::parse(&name).ok_or("not a dead-letter reason"))
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
    let telemetry = match cli
        .telemetry
        .settings("ferryctl", None, &ProcessEnv)
        .and_then(|mut settings| {
            settings.log_filter = settings.log_filter.or_else(|| Some("warn".into()));
            ferry_shared::telemetry::init(settings)
        }) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("ferryctl: {e}");
            return ExitCode::FAILURE;
        }
    };
    let span = tracing::info_span!("ferryctl", command = cli.command.name());
    let result = match ClientAuth::new(
        cli.token.as_deref(),
        cli.ca_cert.as_deref(),
        cli.client_cert.as_deref(),
        cli.client_key.as_deref(),
    ) {
        Ok(auth) => {
            run(&cli.endpoint, &auth, cli.output, cli.command)
                .instrument(span)
                .await
        }
        Err(e) => Err(e.into()),
    };
    telemetry.shutdown().await;
    match result {
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

/// Runs one command. Each arm connects (`channel()`) only after the checks
/// that need no server, so a mistyped command fails without a connection
/// attempt.
async fn run(
    endpoint: &str,
    auth: &ClientAuth,
    out: Format,
    command: Command,
) -> anyhow::Result<()> {
    let channel = || connect(endpoint, auth);
    match command {
        Command::Apply {
            file,
            selector,
            expected_version,
            note,
        } => {
            let yaml = configs::read_document(&file)?;
            configs::apply(
                channel().await?,
                out,
                yaml,
                selector,
                expected_version,
                note,
            )
            .await
        }
        Command::Get { what } => match what {
            Get::Configs { show_secrets } => {
                configs::list(channel().await?, out, show_secrets).await
            }
            Get::Routes { config } => configs::routes(channel().await?, out, config).await,
            Get::Agents {
                watch: false,
                interval: _,
            } => agents::list(channel().await?, out).await,
            Get::Agents {
                watch: true,
                interval,
            } => agents::watch(channel().await?, out, interval).await,
            Get::Leases { prefix } => leases::list(channel().await?, out, prefix).await,
            Get::Dlq { filter, limit } => {
                dlq::list(channel().await?, out, &filter.into(), limit).await
            }
        },
        Command::Describe { what } => match what {
            Describe::Config {
                id,
                version,
                show_secrets,
            } => configs::describe(channel().await?, out, id, version, show_secrets).await,
            Describe::Agent { id } => agents::describe(channel().await?, out, id).await,
        },
        Command::History { config } => configs::history(channel().await?, out, config).await,
        Command::Rollback { config, to } => {
            configs::rollback(channel().await?, out, config, to).await
        }
        Command::Delete { config } => configs::delete(channel().await?, config).await,
        Command::Dlq { action } => match action {
            Dlq::Show { id } => dlq::show(channel().await?, out, id).await,
            Dlq::Redrive { ids, filter, limit } => {
                dlq::redrive(channel().await?, out, ids, &filter.into(), limit).await
            }
            Dlq::Delete { id } => dlq::delete(channel().await?, id).await,
            Dlq::Purge { yes: false, .. } => {
                anyhow::bail!("purge deletes entries for good: add --yes to confirm")
            }
            Dlq::Purge { filter, yes: true } => dlq::purge(channel().await?, &filter.into()).await,
            Dlq::Stats { filter } => dlq::stats(channel().await?, out, &filter.into()).await,
        },
        Command::Token {
            action:
                Token::Hash {
                    name,
                    role,
                    agent_id,
                },
        } => token::hash(&name, &role, agent_id.as_deref()),
        Command::Metrics { bridge, by_agent } => {
            metrics::show(channel().await?, out, bridge, by_agent).await
        }
    }
}

async fn connect(endpoint: &str, auth: &ClientAuth) -> anyhow::Result<AuthChannel> {
    let endpoint = auth
        .endpoint(endpoint)
        .map_err(|e| anyhow::anyhow!("invalid endpoint {e}"))?
        .connect_timeout(std::time::Duration::from_secs(5));
    let channel = endpoint
        .connect()
        .await
        .with_context(|| format!("cannot reach the control plane at {}", endpoint.uri()))?;
    // The channel sends the token and the command's trace context.
    Ok(auth.wrap(channel))
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    /// The example lines of `--help`, without `ferryctl` and the comment.
    fn examples() -> Vec<Vec<&'static str>> {
        EXAMPLES
            .lines()
            .skip(1)
            .map(|line| {
                let command = line.split('#').next().unwrap_or_default();
                command.split_whitespace().skip(1).collect()
            })
            .collect()
    }

    #[test]
    fn help_ends_with_examples_that_parse() {
        let help = Cli::command().render_long_help().to_string();
        assert!(help.contains("\nExamples:\n  ferryctl apply -f "), "{help}");
        let examples = examples();
        assert!(examples.len() >= 5, "{examples:?}");
        for args in examples {
            let parsed = Cli::try_parse_from(std::iter::once("ferryctl").chain(args.clone()));
            assert!(
                parsed.is_ok(),
                "{args:?}: {}",
                parsed.err().map(|e| e.to_string()).unwrap_or_default()
            );
        }
    }

    #[test]
    fn example_files_exist() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        for args in examples() {
            for pair in args.windows(2).filter(|pair| pair[0] == "-f") {
                assert!(root.join(pair[1]).is_file(), "{} in the examples", pair[1]);
            }
        }
    }

    #[test]
    fn reason_flag_takes_the_shared_names_only() {
        let parsed =
            Cli::try_parse_from(["ferryctl", "get", "dlq", "--reason", "replay_exhausted"])
                .expect("parsed");
        let Command::Get {
            what: Get::Dlq { filter, .. },
        } = parsed.command
        else {
            panic!("not get dlq: {parsed:?}");
        };
        assert_eq!(filter.reason, Some(DlqReason::ReplayExhausted));
        let error = Cli::try_parse_from(["ferryctl", "get", "dlq", "--reason", "bogus"])
            .expect_err("refused");
        let text = error.to_string();
        for reason in DlqReason::ALL {
            assert!(text.contains(reason.as_str()), "{text}");
        }
    }
}
