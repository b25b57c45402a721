//! The one mapping of AWS errors to Ferry's: transient or permanent, with the
//! AWS error code kept in the message (it reaches the DLQ entry).
//!
//! - Throttling, 5xx, timeouts and dispatch failures (connection refused,
//!   DNS) are transient; a dispatch failure or timeout also means the service
//!   is unreachable, which the session shows as disconnected.
//! - Access denied, a non-existent queue or topic and invalid parameters are
//!   permanent, and so is any other error the service blames on the request
//!   (4xx), except expired credentials, which a refresh can fix.

use std::error::Error;

use aws_sdk_sqs::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};

use crate::transports::SendError;

/// A classified AWS failure.
#[derive(Debug)]
pub(crate) struct AwsError {
    /// What Ferry does with it.
    pub error: SendError,
    /// The service could not be reached at all (no response).
    pub unreachable: bool,
    /// The AWS error code, when the service answered with one.
    pub code: Option<String>,
}

/// Codes that are transient whatever status they come with.
const TRANSIENT_CODES: &[&str] = &[
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottled",
    "RequestThrottledException",
    "TooManyRequestsException",
    "ProvisionedThroughputExceededException",
    "RequestLimitExceeded",
    "KMSThrottling",
    "KmsThrottled",
    "ServiceUnavailable",
    "InternalError",
    "InternalFailure",
    "RequestTimeout",
    "RequestTimeoutException",
    "ExpiredToken",
    "ExpiredTokenException",
    "RequestExpired",
    "AWS.SimpleQueueService.RequestThrottled",
];

/// Whether an error the service answered with is permanent: by its code
/// first, then by its status (4xx permanent, the rest transient).
pub(crate) fn is_permanent_code(code: Option<&str>, status: Option<u16>) -> bool {
    if code.is_some_and(|c| TRANSIENT_CODES.contains(&c)) {
        return false;
    }
    match status {
        Some(429) => false,
        Some(s) => (400..500).contains(&s),
        // No status: a batch entry's failure, classified by its sender_fault.
        None => true,
    }
}

/// One failed entry of a batch call (`code`, `sender_fault`, `message`).
pub(crate) fn entry_error(code: &str, sender_fault: bool, message: Option<&str>) -> SendError {
    let text = match message {
        Some(m) if !m.is_empty() => format!("{code}: {m}"),
        _ => code.to_owned(),
    };
    if sender_fault && is_permanent_code(Some(code), None) {
        SendError::Permanent(text)
    } else {
        SendError::Transient(text)
    }
}

/// Classifies the failure of call `operation`.
pub(crate) fn classify<E>(operation: &str, error: &SdkError<E>) -> AwsError
where
    E: ProvideErrorMetadata + Error + Send + Sync + 'static,
{
    match error {
        SdkError::DispatchFailure(_) | SdkError::TimeoutError(_) => AwsError {
            error: SendError::Transient(format!(
                "{operation}: unreachable: {}",
                DisplayErrorContext(error)
            )),
            unreachable: true,
            code: None,
        },
        SdkError::ServiceError(service) => {
            let e = service.err();
            let code = e.code().unwrap_or("Unknown");
            let status = service.raw().status().as_u16();
            let text = match e.message() {
                Some(m) if !m.is_empty() => format!("{operation}: {code}: {m}"),
                _ => format!("{operation}: {code} (HTTP {status})"),
            };
            let error = if is_permanent_code(Some(code), Some(status)) {
                SendError::Permanent(text)
            } else {
                SendError::Transient(text)
            };
            AwsError {
                error,
                unreachable: false,
                code: Some(code.to_owned()),
            }
        }
        SdkError::ResponseError(_) => AwsError {
            error: SendError::Transient(format!(
                "{operation}: unreadable response: {}",
                DisplayErrorContext(error)
            )),
            unreachable: false,
            code: None,
        },
        // ConstructionFailure and any later kind: the request itself is wrong.
        _ => AwsError {
            error: SendError::Permanent(format!("{operation}: {}", DisplayErrorContext(error))),
            unreachable: false,
            code: None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_statuses() {
        assert!(is_permanent_code(Some("AccessDenied"), Some(403)));
        assert!(is_permanent_code(
            Some("AWS.SimpleQueueService.NonExistentQueue"),
            Some(400)
        ));
        assert!(is_permanent_code(Some("InvalidParameterValue"), Some(400)));
        assert!(!is_permanent_code(Some("ThrottlingException"), Some(400)));
        assert!(!is_permanent_code(Some("ExpiredToken"), Some(403)));
        assert!(!is_permanent_code(Some("InternalError"), Some(500)));
        assert!(!is_permanent_code(None, Some(503)));
        assert!(!is_permanent_code(None, Some(429)));
    }

    #[test]
    fn batch_entries_keep_their_code() {
        let e = entry_error("InvalidMessageContents", true, Some("bad characters"));
        assert_eq!(
            e,
            SendError::Permanent("InvalidMessageContents: bad characters".into())
        );
        assert!(!entry_error("InternalError", false, None).is_permanent());
        assert!(!entry_error("RequestThrottled", true, None).is_permanent());
    }
}
