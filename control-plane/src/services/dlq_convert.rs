//! Dead letters between their gRPC form and the state store's. The request
//! checks are ferry-shared's (the agent's local DlqService runs the same);
//! this module maps their refusals to `INVALID_ARGUMENT`.

use ferry_shared::api::v1 as pb;
use ferry_shared::dlq::{DlqRequestError, WrittenEntry, check_written_entry};
use prost::Message;
use tonic::Status;

use super::status::{system_time, timestamp};
use crate::state::{DlqEntry, DlqFilter};

/// A refused request field.
pub fn invalid(e: DlqRequestError) -> Status {
    Status::invalid_argument(e.to_string())
}

/// A filter from its gRPC form (unset fields match everything).
pub fn filter(filter: Option<pb::DlqFilter>) -> Result<DlqFilter, Status> {
    DlqFilter::from_proto(filter).map_err(invalid)
}

/// An entry to store, checked: `id`, `bridge_id`, `route_id`, `binding_id`,
/// `envelope` and `reason` are required; an unset `dead_lettered_at` is now.
pub fn entry_to_store(entry: Option<pb::DlqEntry>) -> Result<DlqEntry, Status> {
    let WrittenEntry {
        entry,
        envelope,
        reason,
    } = check_written_entry(entry).map_err(invalid)?;
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
        reason: entry.reason.code(),
        last_error: entry.last_error,
        attempts: entry.attempts,
        first_attempt_at: entry.first_attempt_at.map(timestamp),
        last_attempt_at: entry.last_attempt_at.map(timestamp),
        dead_lettered_at: Some(timestamp(entry.dead_lettered_at)),
        agent_id: entry.agent_id,
        address: entry.address,
    })
}
