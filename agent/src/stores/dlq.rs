//! Dead-letter types (DESIGN §4.6), their `ferry.v1` forms, filters and
//! paging, shared by every backend.

use std::time::SystemTime;

use ferry_shared::api::v1 as pb;
use ferry_shared::envelope::Envelope;
use prost::Message;

use super::{StoreError, StoreResult, unix_nanos};

/// Default and maximum page sizes (as in `ListDlqEntriesRequest`).
const DEFAULT_PAGE_SIZE: usize = 100;
const MAX_PAGE_SIZE: usize = 1000;

/// First byte of [`DlqEntry::encode`]: the layout that follows.
const FORMAT_V1: u8 = 1;

/// Why a delivery was dead-lettered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DlqReason {
    /// The destination refused the message for good.
    PermanentError,
    /// Replayed more than `max_replay_attempts` times and longer than
    /// `replay_budget`.
    ReplayExhausted,
    /// Expired before it could be delivered.
    Expired,
}

impl DlqReason {
    /// The stable number stored and sent for this reason.
    pub fn code(self) -> i32 {
        pb::DlqReason::from(self) as i32
    }

    /// The reason for a stored number.
    pub fn from_code(code: i32) -> StoreResult<Self> {
        match pb::DlqReason::try_from(code) {
            Ok(pb::DlqReason::PermanentError) => Ok(DlqReason::PermanentError),
            Ok(pb::DlqReason::ReplayExhausted) => Ok(DlqReason::ReplayExhausted),
            Ok(pb::DlqReason::Expired) => Ok(DlqReason::Expired),
            _ => Err(StoreError::Invalid(format!("unknown dlq reason {code}"))),
        }
    }
}

impl From<DlqReason> for pb::DlqReason {
    fn from(r: DlqReason) -> Self {
        match r {
            DlqReason::PermanentError => pb::DlqReason::PermanentError,
            DlqReason::ReplayExhausted => pb::DlqReason::ReplayExhausted,
            DlqReason::Expired => pb::DlqReason::Expired,
        }
    }
}

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
        for (name, value) in [
            ("id", &self.id),
            ("bridge_id", &self.bridge_id),
            ("route_id", &self.route_id),
            ("binding_id", &self.binding_id),
        ] {
            if value.is_empty() {
                return Err(StoreError::Invalid(format!("dlq entry: empty {name}")));
            }
        }
        Ok(())
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
            reason: DlqReason::from_code(m.reason)?,
            last_error: m.last_error,
            attempts: m.attempts,
            first_attempt_at: m.first_attempt_at.map(time).transpose()?,
            last_attempt_at: m.last_attempt_at.map(time).transpose()?,
            dead_lettered_at: time(dead_lettered_at)?,
            agent_id: m.agent_id,
        };
        entry.validate()?;
        Ok(entry)
    }
}

fn time(t: prost_types::Timestamp) -> StoreResult<SystemTime> {
    SystemTime::try_from(t).map_err(|e| StoreError::Invalid(format!("timestamp: {e}")))
}

/// Which entries an operation applies to; `None` matches everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DlqFilter {
    /// Only this bridge.
    pub bridge_id: Option<String>,
    /// Only this route.
    pub route_id: Option<String>,
    /// Only this binding.
    pub binding_id: Option<String>,
    /// Only this reason.
    pub reason: Option<DlqReason>,
    /// Only entries dead-lettered at or after this time.
    pub since: Option<SystemTime>,
    /// Only entries dead-lettered before this time.
    pub until: Option<SystemTime>,
}

impl DlqFilter {
    /// True when `e` matches.
    pub fn matches(&self, e: &DlqEntry) -> bool {
        let eq = |want: &Option<String>, have: &str| want.as_deref().is_none_or(|w| w == have);
        eq(&self.bridge_id, &e.bridge_id)
            && eq(&self.route_id, &e.route_id)
            && eq(&self.binding_id, &e.binding_id)
            && self.reason.is_none_or(|r| r == e.reason)
            && self.since.is_none_or(|t| e.dead_lettered_at >= t)
            && self.until.is_none_or(|t| e.dead_lettered_at < t)
    }
}

impl TryFrom<pb::DlqFilter> for DlqFilter {
    type Error = StoreError;

    fn try_from(f: pb::DlqFilter) -> StoreResult<Self> {
        let opt = |s: String| (!s.is_empty()).then_some(s);
        Ok(DlqFilter {
            bridge_id: opt(f.bridge_id),
            route_id: opt(f.route_id),
            binding_id: opt(f.binding_id),
            // Unspecified matches every reason.
            reason: match f.reason {
                0 => None,
                code => Some(DlqReason::from_code(code)?),
            },
            since: f.since.map(time).transpose()?,
            until: f.until.map(time).transpose()?,
        })
    }
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
        match self.size {
            0 => DEFAULT_PAGE_SIZE,
            n => n.min(MAX_PAGE_SIZE),
        }
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

/// Entries of one bridge, route, binding and reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DlqStat {
    /// The bridge.
    pub bridge_id: String,
    /// The route.
    pub route_id: String,
    /// The binding.
    pub binding_id: String,
    /// The reason.
    pub reason: DlqReason,
    /// How many entries.
    pub count: u64,
    /// When the oldest was written.
    pub oldest: SystemTime,
}

/// Counts of matching entries.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DlqStats {
    /// One row per bridge, route, binding and reason, in that order.
    pub rows: Vec<DlqStat>,
    /// All matching entries.
    pub total: u64,
}
