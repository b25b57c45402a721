//! Dead letters (`DlqService`, on the control plane or on one agent's admin
//! listener): get dlq, dlq show / redrive / delete / purge / stats; and how
//! each is shown. Reason names are `ferry_shared::dlq::DlqReason`'s.

use anyhow::Context;
use ferry_shared::api::v1 as pb;
use ferry_shared::auth::client::AuthChannel;
use ferry_shared::dlq::{DlqFilter, DlqReason};
use pb::dlq_service_client::DlqServiceClient;
use serde::Serialize;

use crate::output::{self, Format, Row, timestamp};

/// `ferryctl get dlq`: at most `limit` entries matching `filter`, oldest
/// first, without their payloads.
pub async fn list(
    channel: AuthChannel,
    out: Format,
    filter: &DlqFilter,
    limit: u32,
) -> anyhow::Result<()> {
    let page = DlqServiceClient::new(channel)
        .list_dlq_entries(pb::ListDlqEntriesRequest {
            filter: Some(filter.into()),
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

/// `ferryctl dlq show`: one entry with its message.
pub async fn show(channel: AuthChannel, out: Format, id: String) -> anyhow::Result<()> {
    let entry = DlqServiceClient::new(channel)
        .get_dlq_entry(pb::GetDlqEntryRequest { id })
        .await?
        .into_inner()
        .entry
        .context("the server returned no entry")?;
    output::object(out, &DlqEntryView::from(entry), DlqEntryView::pairs)
}

/// `ferryctl dlq redrive`: the entries `ids` (or, without ids, those matching
/// `filter`) back to their binding; fails when any entry was not redriven.
pub async fn redrive(
    channel: AuthChannel,
    out: Format,
    ids: Vec<String>,
    filter: &DlqFilter,
    limit: u32,
) -> anyhow::Result<()> {
    let response = DlqServiceClient::new(channel)
        .redrive_dlq_entries(pb::RedriveDlqEntriesRequest {
            ids,
            filter: Some(filter.into()),
            limit,
        })
        .await?
        .into_inner();
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
    let failed = rows.iter().filter(|r| !r.ok).count();
    if failed > 0 {
        anyhow::bail!("{failed} of {} entries were not redriven", rows.len());
    }
    Ok(())
}

/// `ferryctl dlq delete`: one entry.
pub async fn delete(channel: AuthChannel, id: String) -> anyhow::Result<()> {
    DlqServiceClient::new(channel)
        .delete_dlq_entry(pb::DeleteDlqEntryRequest { id: id.clone() })
        .await?;
    outln!("entry {id} deleted")?;
    Ok(())
}

/// `ferryctl dlq purge --yes`: every entry matching `filter` (the caller
/// checked the confirmation before connecting).
pub async fn purge(channel: AuthChannel, filter: &DlqFilter) -> anyhow::Result<()> {
    let purged = DlqServiceClient::new(channel)
        .purge_dlq_entries(pb::PurgeDlqEntriesRequest {
            filter: Some(filter.into()),
            confirm: true,
        })
        .await?
        .into_inner()
        .purged;
    outln!("{purged} entries purged")?;
    Ok(())
}

/// `ferryctl dlq stats`: entry counts per bridge, route, binding and reason,
/// and their total.
pub async fn stats(channel: AuthChannel, out: Format, filter: &DlqFilter) -> anyhow::Result<()> {
    let response = DlqServiceClient::new(channel)
        .get_dlq_stats(pb::GetDlqStatsRequest {
            filter: Some(filter.into()),
        })
        .await?
        .into_inner();
    let view = StatsView {
        stats: response.stats.into_iter().map(Into::into).collect(),
        total: response.total,
    };
    if out == Format::Table {
        output::list(out, &view.stats)?;
        outln!("total: {}", view.total)?;
        return Ok(());
    }
    output::object(out, &view, |_| Vec::new())
}

/// The name operators see for a `ferry.v1.DlqReason` number.
fn reason_name(code: i32) -> &'static str {
    DlqReason::from_code(code).map_or("unspecified", DlqReason::as_str)
}

/// One dead letter.
#[derive(Debug, Serialize)]
struct DlqEntryView {
    id: String,
    bridge_id: String,
    route_id: String,
    binding_id: String,
    address: String,
    reason: &'static str,
    last_error: String,
    attempts: u32,
    dead_lettered_at: String,
    first_attempt_at: String,
    last_attempt_at: String,
    agent_id: String,
    message_id: String,
    headers: Vec<(String, String)>,
    /// The payload as text when it is UTF-8, otherwise its size.
    payload: String,
}

impl From<pb::DlqEntry> for DlqEntryView {
    fn from(e: pb::DlqEntry) -> Self {
        let envelope = e.envelope.unwrap_or_default();
        let payload = match String::from_utf8(envelope.payload) {
            Ok(text) => text,
            Err(bytes) => format!("<{} bytes, not UTF-8>", bytes.as_bytes().len()),
        };
        DlqEntryView {
            id: e.id,
            bridge_id: e.bridge_id,
            route_id: e.route_id,
            binding_id: e.binding_id,
            address: e.address,
            reason: reason_name(e.reason),
            last_error: e.last_error,
            attempts: e.attempts,
            dead_lettered_at: timestamp(e.dead_lettered_at.as_ref()),
            first_attempt_at: timestamp(e.first_attempt_at.as_ref()),
            last_attempt_at: timestamp(e.last_attempt_at.as_ref()),
            agent_id: e.agent_id,
            message_id: envelope.id,
            headers: envelope
                .headers
                .into_iter()
                .map(|h| (h.key, h.value))
                .collect(),
            payload,
        }
    }
}

impl DlqEntryView {
    fn pairs(&self) -> Vec<(&'static str, String)> {
        let headers = self
            .headers
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect::<Vec<_>>()
            .join("\n");
        vec![
            ("id", self.id.clone()),
            ("bridge", self.bridge_id.clone()),
            ("route", self.route_id.clone()),
            ("binding", self.binding_id.clone()),
            ("address", self.address.clone()),
            ("reason", self.reason.to_owned()),
            ("last error", self.last_error.clone()),
            ("attempts", self.attempts.to_string()),
            ("dead-lettered", self.dead_lettered_at.clone()),
            ("first attempt", self.first_attempt_at.clone()),
            ("last attempt", self.last_attempt_at.clone()),
            ("agent", self.agent_id.clone()),
            ("message id", self.message_id.clone()),
            ("headers", headers),
            ("payload", self.payload.clone()),
        ]
    }
}

impl Row for DlqEntryView {
    const HEADERS: &'static [&'static str] = &[
        "ID",
        "ROUTE",
        "BINDING",
        "REASON",
        "ATTEMPTS",
        "DEAD-LETTERED",
        "ERROR",
    ];
    fn cells(&self) -> Vec<String> {
        vec![
            self.id.clone(),
            format!("{}/{}", self.bridge_id, self.route_id),
            self.binding_id.clone(),
            self.reason.to_owned(),
            self.attempts.to_string(),
            self.dead_lettered_at.clone(),
            self.last_error.clone(),
        ]
    }
}

/// One redrive outcome.
#[derive(Debug, Serialize)]
struct RedriveView {
    id: String,
    ok: bool,
    error: String,
}

impl Row for RedriveView {
    const HEADERS: &'static [&'static str] = &["ID", "REDRIVEN", "ERROR"];
    fn cells(&self) -> Vec<String> {
        vec![self.id.clone(), self.ok.to_string(), self.error.clone()]
    }
}

/// `ferryctl dlq stats`: one row per group, and the total.
#[derive(Debug, Serialize)]
struct StatsView {
    stats: Vec<StatView>,
    total: u64,
}

/// The entries of one bridge, route, binding and reason.
#[derive(Debug, Serialize)]
struct StatView {
    bridge_id: String,
    route_id: String,
    binding_id: String,
    reason: &'static str,
    count: u64,
    oldest: String,
}

impl From<pb::DlqStat> for StatView {
    fn from(s: pb::DlqStat) -> Self {
        StatView {
            bridge_id: s.bridge_id,
            route_id: s.route_id,
            binding_id: s.binding_id,
            reason: reason_name(s.reason),
            count: s.count,
            oldest: timestamp(s.oldest.as_ref()),
        }
    }
}

impl Row for StatView {
    const HEADERS: &'static [&'static str] =
        &["BRIDGE", "ROUTE", "BINDING", "REASON", "COUNT", "OLDEST"];
    fn cells(&self) -> Vec<String> {
        vec![
            self.bridge_id.clone(),
            self.route_id.clone(),
            self.binding_id.clone(),
            self.reason.to_owned(),
            self.count.to_string(),
            self.oldest.clone(),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_named_as_the_shared_model_spells_them() {
        for reason in DlqReason::ALL {
            assert_eq!(reason_name(reason.code()), reason.as_str());
        }
        assert_eq!(reason_name(0), "unspecified");
        assert_eq!(reason_name(99), "unspecified");
    }
}
