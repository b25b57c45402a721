//! Dead letters between their gRPC form and the state store's.

use ferry_shared::api::v1 as pb;
use prost::Message;
use tonic::Status;

use super::status::{require, system_time, timestamp};
use crate::state::{DlqEntry, DlqFilter, DlqReason};

/// A reason from its gRPC form; `None` for UNSPECIFIED (or unknown).
pub fn reason(value: i32) -> Option<DlqReason> {
    match pb::DlqReason::try_from(value).ok()? {
        pb::DlqReason::Unspecified => None,
        pb::DlqReason::PermanentError => Some(DlqReason::PermanentError),
        pb::DlqReason::ReplayExhausted => Some(DlqReason::ReplayExhausted),
        pb::DlqReason::Expired => Some(DlqReason::Expired),
    }
}

/// A reason in its gRPC form.
pub fn reason_to_proto(reason: DlqReason) -> i32 {
    match reason {
        DlqReason::PermanentError => pb::DlqReason::PermanentError,
        DlqReason::ReplayExhausted => pb::DlqReason::ReplayExhausted,
        DlqReason::Expired => pb::DlqReason::Expired,
    }
    .into()
}

fn non_empty(text: String) -> Option<String> {
    (!text.is_empty()).then_some(text)
}

/// A filter from its gRPC form (unset fields match everything).
pub fn filter(filter: Option<pb::DlqFilter>) -> Result<DlqFilter, Status> {
    let Some(filter) = filter else {
        return Ok(DlqFilter::default());
    };
    if pb::DlqReason::try_from(filter.reason).is_err() {
        return Err(Status::invalid_argument(format!(
            "filter.reason: unknown reason {}",
            filter.reason
        )));
    }
    Ok(DlqFilter {
        bridge_id: non_empty(filter.bridge_id),
        route_id: non_empty(filter.route_id),
        binding_id: non_empty(filter.binding_id),
        reason: reason(filter.reason),
        since: filter
            .since
            .map(|t| system_time("filter.since", t))
            .transpose()?,
        until: filter
            .until
            .map(|t| system_time("filter.until", t))
            .transpose()?,
    })
}

/// Whether a filter selects everything.
pub fn is_empty(filter: &DlqFilter) -> bool {
    filter == &DlqFilter::default()
}

/// An entry to store, checked: `id`, `bridge_id`, `route_id`, `binding_id`,
/// `envelope` and `reason` are required.
pub fn entry_to_store(entry: Option<pb::DlqEntry>) -> Result<DlqEntry, Status> {
    let entry = entry.ok_or_else(|| Status::invalid_argument("entry: must be set"))?;
    require("entry.id", &entry.id)?;
    require("entry.bridge_id", &entry.bridge_id)?;
    require("entry.route_id", &entry.route_id)?;
    require("entry.binding_id", &entry.binding_id)?;
    let envelope = entry
        .envelope
        .ok_or_else(|| Status::invalid_argument("entry.envelope: must be set"))?;
    require("entry.envelope.id", &envelope.id)?;
    let reason = reason(entry.reason).ok_or_else(|| {
        Status::invalid_argument(
            "entry.reason: must be permanent_error, replay_exhausted or expired",
        )
    })?;
    Ok(DlqEntry {
        id: entry.id,
        bridge_id: entry.bridge_id,
        route_id: entry.route_id,
        binding_id: entry.binding_id,
        reason,
        last_error: entry.last_error,
        attempts: entry.attempts,
        first_attempt_at: entry
            .first_attempt_at
            .map(|t| system_time("entry.first_attempt_at", t))
            .transpose()?,
        last_attempt_at: entry
            .last_attempt_at
            .map(|t| system_time("entry.last_attempt_at", t))
            .transpose()?,
        dead_lettered_at: match entry.dead_lettered_at {
            Some(t) => system_time("entry.dead_lettered_at", t)?,
            None => std::time::SystemTime::now(),
        },
        agent_id: entry.agent_id,
        address: entry.address,
        envelope: envelope.encode_to_vec(),
    })
}

/// A stored entry in its gRPC form, with or without its payload.
pub fn entry_to_proto(entry: DlqEntry, with_payload: bool) -> Result<pb::DlqEntry, Status> {
    let mut envelope = pb::Envelope::decode(entry.envelope.as_slice()).map_err(|e| {
        Status::data_loss(format!(
            "dead letter {:?}: stored envelope does not decode: {e}",
            entry.id
        ))
    })?;
    if !with_payload {
        envelope.payload.clear();
    }
    Ok(pb::DlqEntry {
        id: entry.id,
        bridge_id: entry.bridge_id,
        route_id: entry.route_id,
        binding_id: entry.binding_id,
        envelope: Some(envelope),
        reason: reason_to_proto(entry.reason),
        last_error: entry.last_error,
        attempts: entry.attempts,
        first_attempt_at: entry.first_attempt_at.map(timestamp),
        last_attempt_at: entry.last_attempt_at.map(timestamp),
        dead_lettered_at: Some(timestamp(entry.dead_lettered_at)),
        agent_id: entry.agent_id,
        address: entry.address,
    })
}
