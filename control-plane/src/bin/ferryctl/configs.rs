//! Bridge configurations (`ConfigService`): apply, get configs, get routes,
//! describe config, history, rollback, delete; and how each is shown.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use ferry_shared::api::v1 as pb;
use ferry_shared::auth::client::AuthChannel;
use pb::config_service_client::ConfigServiceClient;
use serde::Serialize;

use crate::output::{self, Format, Row, labels, timestamp};
use crate::paging::all_pages;

/// The configuration document from a file, or standard input for `-`.
pub fn read_document(file: &Path) -> anyhow::Result<Vec<u8>> {
    if file.as_os_str() == "-" {
        let mut text = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut text)
            .context("reading the configuration from standard input")?;
        return Ok(text);
    }
    std::fs::read(file).with_context(|| format!("reading {}", file.display()))
}

/// `ferryctl apply`: stores `yaml` as the bridge's next version (unless it
/// equals the current one).
pub async fn apply(
    channel: AuthChannel,
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
        let what = if response.changed {
            "configured"
        } else {
            "unchanged"
        };
        outln!("bridge {} {what}: version {}", view.bridge_id, view.version)?;
        return Ok(());
    }
    output::object(out, &view, ConfigView::pairs)
}

/// `ferryctl get configs`: the current version of every configuration; with
/// `-o json|yaml` each with its document (secrets masked by the control
/// plane unless `show_secrets`, which needs the admin role).
pub async fn list(channel: AuthChannel, out: Format, show_secrets: bool) -> anyhow::Result<()> {
    let client = ConfigServiceClient::new(channel);
    let configs = all_pages(|page_token| {
        let mut client = client.clone();
        async move {
            client
                .list_configs(pb::ListConfigsRequest {
                    page_size: 0,
                    page_token,
                    reveal_secrets: show_secrets,
                })
                .await
        }
    })
    .await?;
    let rows: Vec<ConfigView> = configs
        .into_iter()
        .map(|c| ConfigView::new(c, out != Format::Table))
        .collect();
    output::list(out, &rows)
}

/// `ferryctl get routes`: the routes of a configuration's current version.
pub async fn routes(channel: AuthChannel, out: Format, bridge_id: String) -> anyhow::Result<()> {
    let stored = get(channel, bridge_id, None, false).await?;
    output::list(out, &RouteView::from_document(&stored.yaml)?)
}

/// `ferryctl describe config`: one version with its document (secrets
/// masked unless `show_secrets`).
pub async fn describe(
    channel: AuthChannel,
    out: Format,
    bridge_id: String,
    version: Option<u64>,
    show_secrets: bool,
) -> anyhow::Result<()> {
    let config = get(channel, bridge_id, version, show_secrets).await?;
    output::object(out, &ConfigView::new(config, true), ConfigView::pairs)
}

/// `ferryctl history`: every version of a configuration, newest first.
pub async fn history(channel: AuthChannel, out: Format, bridge_id: String) -> anyhow::Result<()> {
    let client = ConfigServiceClient::new(channel);
    let versions = all_pages(|page_token| {
        let (mut client, bridge_id) = (client.clone(), bridge_id.clone());
        async move {
            client
                .list_config_versions(pb::ListConfigVersionsRequest {
                    bridge_id,
                    page_size: 0,
                    page_token,
                })
                .await
        }
    })
    .await?;
    let rows: Vec<VersionView> = versions.into_iter().map(Into::into).collect();
    output::list(out, &rows)
}

/// `ferryctl rollback`: an old version's document as the new version.
pub async fn rollback(
    channel: AuthChannel,
    out: Format,
    bridge_id: String,
    to: u64,
) -> anyhow::Result<()> {
    let config = ConfigServiceClient::new(channel)
        .rollback_config(pb::RollbackConfigRequest {
            bridge_id,
            to_version: to,
            expected_version: None,
        })
        .await?
        .into_inner()
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

/// `ferryctl delete`: a configuration and its history.
pub async fn delete(channel: AuthChannel, bridge_id: String) -> anyhow::Result<()> {
    ConfigServiceClient::new(channel)
        .delete_config(pb::DeleteConfigRequest {
            bridge_id: bridge_id.clone(),
            expected_version: None,
        })
        .await?;
    outln!("bridge {bridge_id} deleted")?;
    Ok(())
}

/// One version of a configuration; `None` reads the current one.
async fn get(
    channel: AuthChannel,
    bridge_id: String,
    version: Option<u64>,
    show_secrets: bool,
) -> anyhow::Result<pb::BridgeConfig> {
    ConfigServiceClient::new(channel)
        .get_config(pb::GetConfigRequest {
            bridge_id,
            version: version.unwrap_or(0),
            reveal_secrets: show_secrets,
        })
        .await?
        .into_inner()
        .config
        .context("the server returned no configuration")
}

/// One route of a configuration document.
#[derive(Debug, Serialize)]
struct RouteView {
    id: String,
    receiver: String,
    delivery_mode: String,
    dispatch_mode: String,
    bindings: Vec<String>,
}

impl RouteView {
    /// The routes of a stored document. `${VAR:-default}` takes its default,
    /// as when the control plane validated it.
    fn from_document(yaml: &str) -> anyhow::Result<Vec<Self>> {
        let no_variables = |_: &str| None;
        let config = ferry_shared::config::load_str(yaml, &no_variables)
            .map_err(|e| anyhow::anyhow!("the stored configuration does not parse: {e}"))?;
        Ok(config
            .routes
            .into_iter()
            .map(|route| RouteView {
                id: route.id,
                receiver: route.receiver_id,
                delivery_mode: route.delivery_mode.as_str().to_owned(),
                dispatch_mode: match route.dispatch_mode {
                    ferry_shared::config::DispatchMode::Single => "single",
                    ferry_shared::config::DispatchMode::FanOut => "fan_out",
                }
                .to_owned(),
                bindings: route.bindings,
            })
            .collect())
    }
}

impl Row for RouteView {
    const HEADERS: &'static [&'static str] =
        &["ROUTE", "RECEIVER", "DELIVERY", "DISPATCH", "BINDINGS"];
    fn cells(&self) -> Vec<String> {
        vec![
            self.id.clone(),
            self.receiver.clone(),
            self.delivery_mode.clone(),
            self.dispatch_mode.clone(),
            self.bindings.join(","),
        ]
    }
}

/// One configuration version.
#[derive(Debug, Serialize)]
struct ConfigView {
    bridge_id: String,
    version: u64,
    selector: BTreeMap<String, String>,
    created_at: String,
    change_note: String,
    applied_by: String,
    client_address: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    yaml: String,
}

impl ConfigView {
    fn new(config: pb::BridgeConfig, with_yaml: bool) -> Self {
        ConfigView {
            bridge_id: config.bridge_id,
            version: config.version,
            selector: config
                .selector
                .map(|s| s.match_labels.into_iter().collect())
                .unwrap_or_default(),
            created_at: timestamp(config.created_at.as_ref()),
            change_note: config.change_note,
            applied_by: config.applied_by,
            client_address: config.client_address,
            yaml: if with_yaml {
                config.yaml
            } else {
                String::new()
            },
        }
    }

    fn pairs(&self) -> Vec<(&'static str, String)> {
        vec![
            ("bridge", self.bridge_id.clone()),
            ("version", self.version.to_string()),
            ("selector", labels(&self.selector)),
            ("created", self.created_at.clone()),
            ("note", self.change_note.clone()),
            (
                "applied by",
                applied_by(&self.applied_by, &self.client_address),
            ),
            ("document", self.yaml.clone()),
        ]
    }
}

impl Row for ConfigView {
    const HEADERS: &'static [&'static str] = &["BRIDGE", "VERSION", "SELECTOR", "CREATED"];
    fn cells(&self) -> Vec<String> {
        vec![
            self.bridge_id.clone(),
            self.version.to_string(),
            labels(&self.selector),
            self.created_at.clone(),
        ]
    }
}

/// Who applied a version, as tables show it: `alice from 10.0.0.7:53122`;
/// `-` for versions stored before the control plane recorded it.
fn applied_by(principal: &str, client_address: &str) -> String {
    match (principal, client_address) {
        ("", _) => "-".to_owned(),
        (principal, "") => principal.to_owned(),
        (principal, address) => format!("{principal} from {address}"),
    }
}

/// One entry of a configuration's history.
#[derive(Debug, Serialize)]
struct VersionView {
    version: u64,
    created_at: String,
    applied_by: String,
    client_address: String,
    digest: String,
    change_note: String,
}

impl From<pb::ConfigVersion> for VersionView {
    fn from(v: pb::ConfigVersion) -> Self {
        VersionView {
            version: v.version,
            created_at: timestamp(v.created_at.as_ref()),
            applied_by: v.applied_by,
            client_address: v.client_address,
            digest: v.digest,
            change_note: v.change_note,
        }
    }
}

impl Row for VersionView {
    const HEADERS: &'static [&'static str] =
        &["VERSION", "CREATED", "APPLIED BY", "DIGEST", "NOTE"];
    fn cells(&self) -> Vec<String> {
        vec![
            self.version.to_string(),
            self.created_at.clone(),
            applied_by(&self.applied_by, &self.client_address),
            self.digest.chars().take(12).collect(),
            self.change_note.clone(),
        ]
    }
}
