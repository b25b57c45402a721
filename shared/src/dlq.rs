//! Dead letters as both halves see them: the reason, the filter and the
//! per-group counts, their `ferry.v1` forms, the request checks, and the one
//! `DlqService` ([`service`]) that the control plane and an agent's admin
//! listener both serve, each over its own store through a [`backend`].
//!
//! This module is pure code: no I/O. A failed check is a
//! [`DlqRequestError`], which the service maps to `INVALID_ARGUMENT`. The
//! stored entry stays with each half, because each stores the envelope
//! differently.

use std::time::SystemTime;

use crate::api::v1 as pb;

pub mod backend;
pub mod service;

/// Page size used when a request names none (in every `ferry.v1` listing,
/// dead letters or not).
pub const DEFAULT_PAGE_SIZE: u32 = 100;
/// Largest page size served; larger requests are clamped to it.
pub const MAX_PAGE_SIZE: u32 = 1000;

/// A request refused before anything happened: the field and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct DlqRequestError {
    /// The request field, as a path (`filter.since`, `entry.id`).
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

impl DlqRequestError {
    fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

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
    /// Too large for the route (`policy.max_payload_bytes`) or for the
    /// destination (its maximum packet size).
    Oversized,
}

impl DlqReason {
    /// Every reason, in `ferry.v1.DlqReason` number order.
    pub const ALL: [Self; 4] = [
        Self::PermanentError,
        Self::ReplayExhausted,
        Self::Expired,
        Self::Oversized,
    ];

    /// The stable `ferry.v1.DlqReason` number of this reason.
    pub fn code(self) -> i32 {
        pb::DlqReason::from(self) as i32
    }

    /// The reason for a `ferry.v1.DlqReason` number; `None` for UNSPECIFIED
    /// and unknown numbers.
    pub fn from_code(code: i32) -> Option<Self> {
        match pb::DlqReason::try_from(code).ok()? {
            pb::DlqReason::Unspecified => None,
            pb::DlqReason::PermanentError => Some(Self::PermanentError),
            pb::DlqReason::ReplayExhausted => Some(Self::ReplayExhausted),
            pb::DlqReason::Expired => Some(Self::Expired),
            pb::DlqReason::Oversized => Some(Self::Oversized),
        }
    }

    /// The text spelling (`permanent_error`, `replay_exhausted`, `expired`,
    /// `oversized`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PermanentError => "permanent_error",
            Self::ReplayExhausted => "replay_exhausted",
            Self::Expired => "expired",
            Self::Oversized => "oversized",
        }
    }

    /// Parses [`DlqReason::as_str`]'s spelling.
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == text)
    }
}

impl From<DlqReason> for pb::DlqReason {
    fn from(r: DlqReason) -> Self {
        match r {
            DlqReason::PermanentError => pb::DlqReason::PermanentError,
            DlqReason::ReplayExhausted => pb::DlqReason::ReplayExhausted,
            DlqReason::Expired => pb::DlqReason::Expired,
            DlqReason::Oversized => pb::DlqReason::Oversized,
        }
    }
}

/// Which dead letters an operation applies to; `None` matches everything.
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
    /// A filter from its `ferry.v1` form: unset (or empty) fields match
    /// everything, an UNSPECIFIED reason matches every reason.
    pub fn from_proto(filter: Option<pb::DlqFilter>) -> Result<Self, DlqRequestError> {
        let Some(f) = filter else {
            return Ok(Self::default());
        };
        let reason = match f.reason {
            0 => None,
            code => Some(DlqReason::from_code(code).ok_or_else(|| {
                DlqRequestError::new("filter.reason", format!("unknown reason {code}"))
            })?),
        };
        Ok(Self {
            bridge_id: non_empty(f.bridge_id),
            route_id: non_empty(f.route_id),
            binding_id: non_empty(f.binding_id),
            reason,
            since: f.since.map(|t| time("filter.since", t)).transpose()?,
            until: f.until.map(|t| time("filter.until", t)).transpose()?,
        })
    }

    /// Whether the filter selects everything.
    pub fn is_empty(&self) -> bool {
        self == &Self::default()
    }

    /// Whether an entry with these fields matches.
    pub fn matches(
        &self,
        bridge_id: &str,
        route_id: &str,
        binding_id: &str,
        reason: DlqReason,
        dead_lettered_at: SystemTime,
    ) -> bool {
        let eq = |want: &Option<String>, have: &str| want.as_deref().is_none_or(|w| w == have);
        eq(&self.bridge_id, bridge_id)
            && eq(&self.route_id, route_id)
            && eq(&self.binding_id, binding_id)
            && self.reason.is_none_or(|r| r == reason)
            && self.since.is_none_or(|t| dead_lettered_at >= t)
            && self.until.is_none_or(|t| dead_lettered_at < t)
    }
}

impl std::fmt::Display for DlqFilter {
    /// The filter as audit events show it: `route=r reason=expired
    /// since=@1700000000` (times in Unix seconds), `everything` when empty.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secs = |t: SystemTime| {
            t.duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
        };
        let parts: Vec<String> = [
            self.bridge_id.as_ref().map(|v| format!("bridge={v}")),
            self.route_id.as_ref().map(|v| format!("route={v}")),
            self.binding_id.as_ref().map(|v| format!("binding={v}")),
            self.reason.map(|r| format!("reason={}", r.as_str())),
            self.since.map(|t| format!("since=@{}", secs(t))),
            self.until.map(|t| format!("until=@{}", secs(t))),
        ]
        .into_iter()
        .flatten()
        .collect();
        if parts.is_empty() {
            f.write_str("everything")
        } else {
            f.write_str(&parts.join(" "))
        }
    }
}

impl From<&DlqFilter> for pb::DlqFilter {
    /// The `ferry.v1` form: `None` becomes an empty field (or UNSPECIFIED),
    /// so that [`DlqFilter::from_proto`] gives the same filter back.
    fn from(f: &DlqFilter) -> Self {
        pb::DlqFilter {
            bridge_id: f.bridge_id.clone().unwrap_or_default(),
            route_id: f.route_id.clone().unwrap_or_default(),
            binding_id: f.binding_id.clone().unwrap_or_default(),
            reason: f.reason.map_or(0, DlqReason::code),
            since: f.since.map(Into::into),
            until: f.until.map(Into::into),
        }
    }
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
    /// When the oldest of them was written.
    pub oldest: SystemTime,
}

impl From<DlqStat> for pb::DlqStat {
    fn from(s: DlqStat) -> Self {
        pb::DlqStat {
            bridge_id: s.bridge_id,
            route_id: s.route_id,
            binding_id: s.binding_id,
            reason: s.reason.code(),
            count: s.count,
            oldest: Some(s.oldest.into()),
        }
    }
}

/// A purge deletes entries for good: it must say `confirm`.
pub fn check_purge_confirmed(confirm: bool) -> Result<(), DlqRequestError> {
    if confirm {
        Ok(())
    } else {
        Err(DlqRequestError::new(
            "confirm",
            "must be true; a purge deletes entries for good",
        ))
    }
}

/// The page size served for a requested one: 0 means
/// [`DEFAULT_PAGE_SIZE`], more than [`MAX_PAGE_SIZE`] means the maximum.
pub fn page_size(requested: u32) -> u32 {
    match requested {
        0 => DEFAULT_PAGE_SIZE,
        n => n.min(MAX_PAGE_SIZE),
    }
}

/// The identifying fields every written entry needs, each as `(name,
/// value)`; the first empty one is refused, its name prefixed with `prefix`.
pub fn check_required_ids(
    prefix: &str,
    id: &str,
    bridge_id: &str,
    route_id: &str,
    binding_id: &str,
) -> Result<(), DlqRequestError> {
    for (name, value) in [
        ("id", id),
        ("bridge_id", bridge_id),
        ("route_id", route_id),
        ("binding_id", binding_id),
    ] {
        if value.trim().is_empty() {
            return Err(DlqRequestError::new(
                format!("{prefix}{name}"),
                "must not be empty",
            ));
        }
    }
    Ok(())
}

/// The entry of a `WriteDlqEntryRequest` after [`check_written_entry`].
#[derive(Clone, Debug, PartialEq)]
pub struct WrittenEntry {
    /// The entry, its `envelope` taken out into [`WrittenEntry::envelope`].
    pub entry: pb::DlqEntry,
    /// The entry's envelope, which has an id.
    pub envelope: pb::Envelope,
    /// The entry's reason.
    pub reason: DlqReason,
}

/// The entry of a `WriteDlqEntryRequest`, checked: it must be set, with
/// `id`, `bridge_id`, `route_id`, `binding_id`, `envelope` (with its `id`)
/// and a known, specified `reason`; its timestamps, when set, in range.
pub fn check_written_entry(entry: Option<pb::DlqEntry>) -> Result<WrittenEntry, DlqRequestError> {
    let mut entry = entry.ok_or_else(|| DlqRequestError::new("entry", "must be set"))?;
    check_required_ids(
        "entry.",
        &entry.id,
        &entry.bridge_id,
        &entry.route_id,
        &entry.binding_id,
    )?;
    let envelope = entry
        .envelope
        .take()
        .ok_or_else(|| DlqRequestError::new("entry.envelope", "must be set"))?;
    if envelope.id.trim().is_empty() {
        return Err(DlqRequestError::new(
            "entry.envelope.id",
            "must not be empty",
        ));
    }
    let reason = DlqReason::from_code(entry.reason).ok_or_else(|| {
        DlqRequestError::new(
            "entry.reason",
            "must be permanent_error, replay_exhausted, expired or oversized",
        )
    })?;
    for (field, t) in [
        ("entry.first_attempt_at", entry.first_attempt_at),
        ("entry.last_attempt_at", entry.last_attempt_at),
        ("entry.dead_lettered_at", entry.dead_lettered_at),
    ] {
        t.map(|t| time(field, t)).transpose()?;
    }
    Ok(WrittenEntry {
        entry,
        envelope,
        reason,
    })
}

/// A timestamp as a `SystemTime`, refused (naming `field`) out of range.
pub fn time(field: &str, t: prost_types::Timestamp) -> Result<SystemTime, DlqRequestError> {
    SystemTime::try_from(t).map_err(|_| DlqRequestError::new(field, "timestamp out of range"))
}

fn non_empty(text: String) -> Option<String> {
    (!text.is_empty()).then_some(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reason_round_trips_through_code_and_text() {
        for (r, code) in DlqReason::ALL.into_iter().zip(1..) {
            assert_eq!(r.code(), code, "ALL is in number order");
            assert_eq!(DlqReason::from_code(r.code()), Some(r));
            assert_eq!(DlqReason::parse(r.as_str()), Some(r));
        }
        assert_eq!(DlqReason::from_code(0), None);
        assert_eq!(DlqReason::from_code(99), None);
        assert_eq!(DlqReason::parse("unspecified"), None);
    }

    #[test]
    fn filter_round_trips_through_proto() {
        let t = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
        for f in [
            DlqFilter::default(),
            DlqFilter {
                bridge_id: Some("b".into()),
                route_id: Some("r".into()),
                binding_id: Some("x".into()),
                reason: Some(DlqReason::Oversized),
                since: Some(t),
                until: Some(t + std::time::Duration::from_nanos(5)),
            },
        ] {
            let proto = pb::DlqFilter::from(&f);
            assert_eq!(DlqFilter::from_proto(Some(proto)), Ok(f));
        }
    }

    #[test]
    fn filter_from_proto_names_the_bad_field() {
        let bad = pb::DlqFilter {
            reason: 99,
            ..Default::default()
        };
        let e = DlqFilter::from_proto(Some(bad)).expect_err("refused");
        assert_eq!(e.field, "filter.reason");
        assert!(DlqFilter::from_proto(None).expect("accepted").is_empty());
        let by_route = DlqFilter::from_proto(Some(pb::DlqFilter {
            route_id: "r".into(),
            ..Default::default()
        }))
        .expect("accepted");
        assert_eq!(by_route.route_id.as_deref(), Some("r"));
        assert!(!by_route.is_empty());
    }

    #[test]
    fn purge_needs_confirm_and_pages_are_clamped() {
        assert!(check_purge_confirmed(true).is_ok());
        assert!(
            check_purge_confirmed(false)
                .expect_err("refused")
                .to_string()
                .starts_with("confirm: ")
        );
        assert_eq!(page_size(0), DEFAULT_PAGE_SIZE);
        assert_eq!(page_size(7), 7);
        assert_eq!(page_size(5000), MAX_PAGE_SIZE);
    }

    #[test]
    fn required_ids_refuse_blank_values() {
        assert!(check_required_ids("entry.", "i", "b", "r", "x").is_ok());
        let e = check_required_ids("entry.", "i", "b", " ", "x").expect_err("refused");
        assert_eq!(e.to_string(), "entry.route_id: must not be empty");
    }

    #[test]
    fn written_entry_needs_ids_envelope_and_reason() {
        let good = pb::DlqEntry {
            id: "i".into(),
            bridge_id: "b".into(),
            route_id: "r".into(),
            binding_id: "x".into(),
            envelope: Some(pb::Envelope {
                id: "m".into(),
                ..Default::default()
            }),
            reason: DlqReason::Expired.code(),
            ..Default::default()
        };
        assert!(check_written_entry(Some(good.clone())).is_ok());
        assert_eq!(
            check_written_entry(None).expect_err("refused").field,
            "entry"
        );
        let field = |e: pb::DlqEntry| check_written_entry(Some(e)).expect_err("refused").field;
        let no_reason = pb::DlqEntry {
            reason: 0,
            ..good.clone()
        };
        assert_eq!(field(no_reason), "entry.reason");
        let no_envelope = pb::DlqEntry {
            envelope: None,
            ..good
        };
        assert_eq!(field(no_envelope), "entry.envelope");
    }
}
