//! The one place where errors become gRPC statuses, plus the request checks
//! and conversions every service shares.
//!
//! | [`StateError`] | status |
//! |---|---|
//! | `NotFound` | `NOT_FOUND` |
//! | `Conflict` | `FAILED_PRECONDITION`, naming the current version |
//! | `LeaseLost` | `FAILED_PRECONDITION` |
//! | `Invalid` | `INVALID_ARGUMENT` |
//! | `Unavailable` | `UNAVAILABLE` (the call may or may not have taken effect) |
//! | `Corrupt` | `DATA_LOSS` |

use std::time::{Duration, SystemTime};

use ferry_shared::api::v1 as pb;
use tonic::Status;

use crate::state::{Labels, PageRequest, StateError};

/// Maps a state store error to the status the caller sees.
pub fn state_status(error: StateError) -> Status {
    let message = error.to_string();
    match error {
        StateError::NotFound { .. } => Status::not_found(message),
        StateError::Conflict { .. } | StateError::LeaseLost { .. } => {
            Status::failed_precondition(message)
        }
        StateError::Invalid(_) => Status::invalid_argument(message),
        StateError::Unavailable(_) => Status::unavailable(message),
        StateError::Corrupt(_) => Status::data_loss(message),
    }
}

/// A configuration document that was refused: `INVALID_ARGUMENT` whose
/// message is a headline followed by every `path: message`, one per line.
pub fn rejected(headline: &str, problems: &[String]) -> Status {
    let mut message = format!("{headline}:");
    for problem in problems {
        message.push('\n');
        message.push_str(problem);
    }
    Status::invalid_argument(message)
}

/// `INVALID_ARGUMENT` naming `field` when `value` is empty.
pub fn require(field: &str, value: &str) -> Result<(), Status> {
    if value.trim().is_empty() {
        return Err(Status::invalid_argument(format!(
            "{field}: must not be empty"
        )));
    }
    Ok(())
}

/// A page request from a gRPC page size and token.
pub fn page(size: u32, token: String) -> PageRequest {
    PageRequest {
        size,
        token: (!token.is_empty()).then_some(token),
    }
}

/// A protobuf timestamp of `time`.
pub fn timestamp(time: SystemTime) -> prost_types::Timestamp {
    time.into()
}

/// `time` as a `SystemTime`; `INVALID_ARGUMENT` naming `field` when it is out
/// of range.
pub fn system_time(field: &str, time: prost_types::Timestamp) -> Result<SystemTime, Status> {
    SystemTime::try_from(time)
        .map_err(|_| Status::invalid_argument(format!("{field}: timestamp out of range")))
}

/// A positive duration; `INVALID_ARGUMENT` naming `field` when it is unset,
/// zero or negative.
pub fn positive_duration(
    field: &str,
    duration: Option<prost_types::Duration>,
) -> Result<Duration, Status> {
    let duration =
        duration.ok_or_else(|| Status::invalid_argument(format!("{field}: must be set")))?;
    match Duration::try_from(duration) {
        Ok(d) if !d.is_zero() => Ok(d),
        _ => Err(Status::invalid_argument(format!(
            "{field}: must be positive"
        ))),
    }
}

/// The labels of a selector (none when unset).
pub fn selector_labels(selector: Option<pb::LabelSelector>) -> Result<Labels, Status> {
    let labels: Labels = selector
        .map(|s| s.match_labels.into_iter().collect())
        .unwrap_or_default();
    if labels.keys().any(|key| key.trim().is_empty()) {
        return Err(Status::invalid_argument(
            "selector.match_labels: a label name must not be empty",
        ));
    }
    Ok(labels)
}

/// Whether an agent with `labels` is selected by `selector`.
pub fn selects(selector: &Labels, labels: &Labels) -> bool {
    selector
        .iter()
        .all(|(key, value)| labels.get(key) == Some(value))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn maps_every_state_error() {
        let cases = [
            (StateError::NotFound { what: "x".into() }, Code::NotFound),
            (
                StateError::Conflict { current: 3 },
                Code::FailedPrecondition,
            ),
            (
                StateError::LeaseLost {
                    key: "k".into(),
                    holder: "h".into(),
                    version: 1,
                },
                Code::FailedPrecondition,
            ),
            (StateError::Invalid("x".into()), Code::InvalidArgument),
            (StateError::Unavailable("x".into()), Code::Unavailable),
            (StateError::Corrupt("x".into()), Code::DataLoss),
        ];
        for (error, code) in cases {
            assert_eq!(state_status(error).code(), code);
        }
        assert!(
            state_status(StateError::Conflict { current: 3 })
                .message()
                .contains("current version is 3")
        );
    }

    #[test]
    fn selectors_match_subsets() {
        let labels: Labels = [("site".into(), "a".into()), ("tier".into(), "edge".into())].into();
        assert!(selects(&Labels::new(), &labels));
        assert!(selects(&[("site".into(), "a".into())].into(), &labels));
        assert!(!selects(&[("site".into(), "b".into())].into(), &labels));
    }
}
