//! The agent's dead letter (DESIGN §4.6), its storage encoding and `ferry.v1`
//! form, and paging, shared by every backend. The reason, the filter and the
//! counts come from [`ferry_shared::dlq`], which the control plane uses too.

use std::collections::BTreeMap;
use std::time::SystemTime;

use ferry_shared::api::v1 as pb;
pub use ferry_shared::dlq::{DlqFilter, DlqReason, DlqStat};
use ferry_shared::dlq::{DlqRequestError, check_required_ids, page_size};
use ferry_shared::envelope::Envelope;
use prost::Message;

use super::{StoreError, StoreResult, unix_nanos};

/// First byte of [`DlqEntry::encode`]: the layout that follows.
const FORMAT_V1: u8 = 1;

/// One dead letter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DlqEntry {
    /// Deterministic id: the outbox record id, or for direct_hold the message
    /// id plus the binding, so that writing it twice stores it once.
    pub id: String,
    /// The bridge.
    pub bridge_id: String,
    /// The route that failed.
    pub route_id: String,
    /// The binding that failed; a redrive goes only there.
    pub binding_id: String,
    /// The address the binding sends to.
    pub address: String,
    /// The message, unchanged.
    pub envelope: Envelope,
    /// Why it was dead-lettered.
    pub reason: DlqReason,
    /// The last error seen.
    pub last_error: String,
    /// Delivery attempts made.
    pub attempts: u32,
    /// First delivery attempt, if any.
    pub first_attempt_at: Option<SystemTime>,
    /// Last delivery attempt, if any.
    pub last_attempt_at: Option<SystemTime>,
    /// When the entry was written.
    pub dead_lettered_at: SystemTime,
    /// The agent that wrote it.
    pub agent_id: String,
}

impl DlqEntry {
    /// The storage encoding: a format byte, then the `ferry.v1.DlqEntry`.
    pub fn encode(&self) -> Vec<u8> {
        let m = pb::DlqEntry::from(self);
        let mut out = Vec::with_capacity(1 + m.encoded_len());
        out.push(FORMAT_V1);
        m.encode_raw(&mut out);
        out
    }

    /// Decodes [`DlqEntry::encode`]'s output; bad bytes are `Corrupt`.
    pub fn decode(bytes: &[u8]) -> StoreResult<Self> {
        let corrupt = |e: String| StoreError::Corrupt(format!("dlq entry: {e}"));
        match bytes.split_first() {
            Some((&FORMAT_V1, body)) => {
                let m = pb::DlqEntry::decode(body).map_err(|e| corrupt(e.to_string()))?;
                DlqEntry::try_from(m).map_err(|e| corrupt(e.to_string()))
            }
            Some((v, _)) => Err(corrupt(format!("unknown format {v}"))),
            None => Err(corrupt("empty".into())),
        }
    }

    /// Checks the fields a write requires.
    pub fn validate(&self) -> StoreResult<()> {
        check_required_ids(
            "entry.",
            &self.id,
            &self.bridge_id,
            &self.route_id,
            &self.binding_id,
        )
        .map_err(invalid)
    }

    /// Whether `filter` selects this entry.
    pub fn matches(&self, filter: &DlqFilter) -> bool {
        filter.matches(
            &self.bridge_id,
            &self.route_id,
            &self.binding_id,
            self.reason,
            self.dead_lettered_at,
        )
    }
}

impl From<&DlqEntry> for pb::DlqEntry {
    fn from(e: &DlqEntry) -> Self {
        pb::DlqEntry {
            id: e.id.clone(),
            bridge_id: e.bridge_id.clone(),
            route_id: e.route_id.clone(),
            binding_id: e.binding_id.clone(),
            envelope: Some(pb::Envelope::from(&e.envelope)),
            reason: e.reason.code(),
            last_error: e.last_error.clone(),
            attempts: e.attempts,
            first_attempt_at: e.first_attempt_at.map(Into::into),
            last_attempt_at: e.last_attempt_at.map(Into::into),
            dead_lettered_at: Some(e.dead_lettered_at.into()),
            agent_id: e.agent_id.clone(),
            address: e.address.clone(),
        }
    }
}

impl TryFrom<pb::DlqEntry> for DlqEntry {
    type Error = StoreError;

    /// Refuses what `WriteDlqEntry` refuses: missing required fields, an
    /// unspecified reason, invalid timestamps.
    fn try_from(m: pb::DlqEntry) -> StoreResult<Self> {
        let envelope = m
            .envelope
            .ok_or_else(|| StoreError::Invalid("dlq entry: missing envelope".into()))?;
        let envelope = Envelope::try_from(envelope)
            .map_err(|e| StoreError::Invalid(format!("dlq entry: {e}")))?;
        let dead_lettered_at = m
            .dead_lettered_at
            .ok_or_else(|| StoreError::Invalid("dlq entry: missing dead_lettered_at".into()))?;
        let entry = DlqEntry {
            id: m.id,
            bridge_id: m.bridge_id,
            route_id: m.route_id,
            binding_id: m.binding_id,
            address: m.address,
            envelope,
            reason: DlqReason::from_code(m.reason).ok_or_else(|| {
                StoreError::Invalid(format!("entry.reason: unknown reason {}", m.reason))
            })?,
            last_error: m.last_error,
            attempts: m.attempts,
            first_attempt_at: m
                .first_attempt_at
                .map(|t| time("entry.first_attempt_at", t))
                .transpose()?,
            last_attempt_at: m
                .last_attempt_at
                .map(|t| time("entry.last_attempt_at", t))
                .transpose()?,
            dead_lettered_at: time("entry.dead_lettered_at", dead_lettered_at)?,
            agent_id: m.agent_id,
        };
        entry.validate()?;
        Ok(entry)
    }
}

fn time(field: &str, t: prost_types::Timestamp) -> StoreResult<SystemTime> {
    ferry_shared::dlq::time(field, t).map_err(invalid)
}

/// A refused request field as a store error.
fn invalid(e: DlqRequestError) -> StoreError {
    StoreError::Invalid(e.to_string())
}

/// Which page of a listing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PageRequest {
    /// Entries per page; 0 means 100, more than 1000 means 1000.
    pub size: usize,
    /// The previous page's `next_page_token`; `None` for the first page.
    pub token: Option<String>,
}

impl PageRequest {
    /// The page size after defaults and limits.
    pub fn effective_size(&self) -> usize {
        page_size(u32::try_from(self.size).unwrap_or(u32::MAX)) as usize
    }

    /// The position after which this page starts: the (time, id) of the last
    /// entry of the previous page.
    pub(crate) fn after(&self) -> StoreResult<Option<(i64, String)>> {
        let Some(token) = &self.token else {
            return Ok(None);
        };
        let bad = || StoreError::Invalid(format!("bad page token {token:?}"));
        let (nanos, id) = token.split_once('/').ok_or_else(bad)?;
        Ok(Some((nanos.parse().map_err(|_| bad())?, id.to_owned())))
    }
}

/// A page token pointing after `entry`.
pub(crate) fn token_after(entry: &DlqEntry) -> StoreResult<String> {
    Ok(format!(
        "{}/{}",
        unix_nanos(entry.dead_lettered_at)?,
        entry.id
    ))
}

/// One page of entries.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DlqPage {
    /// Entries, oldest first.
    pub entries: Vec<DlqEntry>,
    /// Token for the next page; `None` on the last page.
    pub next_page_token: Option<String>,
}

/// Counts of matching entries.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DlqStats {
    /// One row per bridge, route, binding and reason, in that order.
    pub rows: Vec<DlqStat>,
    /// All matching entries.
    pub total: u64,
}

/// The page of `entries` (in listing order: `dead_lettered_at`, then id)
/// that `filter` and `page` select: for stores that list in memory.
pub(crate) fn page_of<'a>(
    entries: impl Iterator<Item = &'a DlqEntry>,
    filter: &DlqFilter,
    page: &PageRequest,
) -> StoreResult<DlqPage> {
    let size = page.effective_size();
    let after = page.after()?;
    let mut selected = Vec::new();
    for e in entries {
        if let Some((nanos, id)) = &after
            && (unix_nanos(e.dead_lettered_at)?, &e.id) <= (*nanos, id)
        {
            continue;
        }
        if e.matches(filter) {
            selected.push(e.clone());
            if selected.len() > size {
                break;
            }
        }
    }
    let more = selected.len() > size;
    selected.truncate(size);
    let next_page_token = match (more, selected.last()) {
        (true, Some(last)) => Some(token_after(last)?),
        _ => None,
    };
    Ok(DlqPage {
        entries: selected,
        next_page_token,
    })
}

/// The counts of the `entries` that `filter` selects: for stores that count
/// in memory.
pub(crate) fn stats_of<'a>(
    entries: impl Iterator<Item = &'a DlqEntry>,
    filter: &DlqFilter,
) -> DlqStats {
    let mut rows: BTreeMap<(&str, &str, &str, i32), DlqStat> = BTreeMap::new();
    let mut total = 0;
    for e in entries.filter(|e| e.matches(filter)) {
        total += 1;
        let key = (
            e.bridge_id.as_str(),
            e.route_id.as_str(),
            e.binding_id.as_str(),
            e.reason.code(),
        );
        let row = rows.entry(key).or_insert_with(|| DlqStat {
            bridge_id: e.bridge_id.clone(),
            route_id: e.route_id.clone(),
            binding_id: e.binding_id.clone(),
            reason: e.reason,
            count: 0,
            oldest: e.dead_lettered_at,
        });
        row.count += 1;
        row.oldest = row.oldest.min(e.dead_lettered_at);
    }
    DlqStats {
        rows: rows.into_values().collect(),
        total,
    }
}
