//! Dead letters between their `ferry.v1` form (what the shared `DlqService`
//! hands its backend) and the state store's, and state store errors as the
//! service's backend errors.

use ferry_shared::api::v1 as pb;
use ferry_shared::dlq::backend::DlqBackendError;
use prost::Message;

use crate::state::{DlqEntry, DlqReason, StateError};

/// A state store error as the service sees it.
pub fn backend_error(error: StateError) -> DlqBackendError {
    let message = error.to_string();
    match error {
        StateError::NotFound { .. } => DlqBackendError::NotFound(message),
        StateError::Conflict { .. } | StateError::LeaseLost { .. } => {
            DlqBackendError::Conflict(message)
        }
        StateError::Invalid(_) => DlqBackendError::Invalid(message),
        StateError::Unavailable(_) => DlqBackendError::Unavailable(message),
        StateError::Corrupt(_) => DlqBackendError::Corrupt(message),
    }
}

/// An entry the service checked, to store.
pub fn entry_to_store(entry: pb::DlqEntry) -> Result<DlqEntry, DlqBackendError> {
    let invalid = |e: ferry_shared::dlq::DlqRequestError| DlqBackendError::Invalid(e.to_string());
    let time = |field, t| ferry_shared::dlq::time(field, t).map_err(invalid);
    let reason = DlqReason::from_code(entry.reason).ok_or_else(|| {
        DlqBackendError::Invalid(format!("entry.reason: unknown reason {}", entry.reason))
    })?;
    Ok(DlqEntry {
        reason,
        first_attempt_at: entry
            .first_attempt_at
            .map(|t| time("entry.first_attempt_at", t))
            .transpose()?,
        last_attempt_at: entry
            .last_attempt_at
            .map(|t| time("entry.last_attempt_at", t))
            .transpose()?,
        dead_lettered_at: match entry.dead_lettered_at {
            Some(t) => time("entry.dead_lettered_at", t)?,
            None => std::time::SystemTime::now(),
        },
        envelope: entry.envelope.unwrap_or_default().encode_to_vec(),
        id: entry.id,
        bridge_id: entry.bridge_id,
        route_id: entry.route_id,
        binding_id: entry.binding_id,
        last_error: entry.last_error,
        attempts: entry.attempts,
        agent_id: entry.agent_id,
        address: entry.address,
    })
}

/// A stored entry in its `ferry.v1` form, with its whole envelope.
pub fn entry_to_proto(entry: DlqEntry) -> Result<pb::DlqEntry, DlqBackendError> {
    let envelope = pb::Envelope::decode(entry.envelope.as_slice()).map_err(|e| {
        DlqBackendError::Corrupt(format!(
            "dead letter {:?}: stored envelope does not decode: {e}",
            entry.id
        ))
    })?;
    Ok(pb::DlqEntry {
        id: entry.id,
        bridge_id: entry.bridge_id,
        route_id: entry.route_id,
        binding_id: entry.binding_id,
        envelope: Some(envelope),
        reason: entry.reason.code(),
        last_error: entry.last_error,
        attempts: entry.attempts,
        first_attempt_at: entry.first_attempt_at.map(Into::into),
        last_attempt_at: entry.last_attempt_at.map(Into::into),
        dead_lettered_at: Some(entry.dead_lettered_at.into()),
        agent_id: entry.agent_id,
        address: entry.address,
    })
}
