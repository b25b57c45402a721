//! The `control_plane` lease and DLQ stores: the agent's
//! [`LeaseStore`](super::LeaseStore) and [`DlqStore`](super::DlqStore) over the control plane's `LeaseService` and `DlqService`
//! (gRPC, `ferry.v1`).
//!
//! # Contract
//!
//! - Opening never connects: the channel connects lazily, so an agent whose
//!   control plane is down starts and keeps running; every call then fails
//!   `Unavailable` (or `Timeout`) until the control plane is back. A call
//!   waits at most [`CONNECT_TIMEOUT`] for a connection and
//!   [`REQUEST_TIMEOUT`] for its answer.
//! - The control plane decides time for leases: the `now` the traits pass is
//!   not sent. The expiry of a lease the caller holds is counted on the
//!   caller's clock from just before the request was sent (`now + ttl`),
//!   never later in real time than the control plane's own expiry whatever
//!   the skew between the two clocks, so a drainer that stops at that
//!   expiry stops before another holder can be granted the lease (ADR 0004,
//!   addendum).
//! - A dead letter is settled only after `WriteDlqEntry` returned OK, which
//!   the control plane answers once the entry is durable; while it is
//!   unreachable the write fails `Unavailable` and the caller keeps the
//!   delivery and retries (writes are idempotent by entry id).
//!
//! # Status codes
//!
//! gRPC statuses become [`StoreError`]s in one place, `store_error`:
//!
//! | status | [`StoreError`] |
//! |---|---|
//! | `NOT_FOUND` | `NotFound` |
//! | `INVALID_ARGUMENT`, `OUT_OF_RANGE` | `Invalid` |
//! | `FAILED_PRECONDITION` | `Stale` (leases: not held at that version), `Conflict` (DLQ) |
//! | `ALREADY_EXISTS`, `ABORTED` | `Conflict` |
//! | `RESOURCE_EXHAUSTED` | `Full` |
//! | `DATA_LOSS` | `Corrupt` |
//! | `DEADLINE_EXCEEDED` | `Timeout` (may have happened) |
//! | `UNAVAILABLE` and every other code | `Unavailable` (may have happened) |

use std::time::{Duration, SystemTime};

use ferry_shared::auth::client::{AuthChannel, ClientAuth};
use ferry_shared::config::store::ControlPlaneOptions;
use tonic::Code;

use super::StoreError;

mod dlq;
mod lease;

pub use dlq::ControlPlaneDlqStore;
pub use lease::ControlPlaneLeaseStore;

/// How long a call waits for a connection to the control plane.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a call waits for the control plane's answer.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Which service answered: `FAILED_PRECONDITION` means a fenced-out caller
/// for leases, a state conflict elsewhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Service {
    Lease,
    Dlq,
}

/// The one mapping of gRPC statuses to store errors (see the module table).
pub(crate) fn store_error(service: Service, status: &tonic::Status) -> StoreError {
    let message = format!("control plane: {}", status.message());
    match status.code() {
        Code::NotFound => StoreError::NotFound(message),
        Code::InvalidArgument | Code::OutOfRange => StoreError::Invalid(message),
        Code::FailedPrecondition => match service {
            Service::Lease => StoreError::Stale(message),
            Service::Dlq => StoreError::Conflict(message),
        },
        Code::AlreadyExists | Code::Aborted => StoreError::Conflict(message),
        Code::ResourceExhausted => StoreError::Full(message),
        Code::DataLoss => StoreError::Corrupt(message),
        Code::DeadlineExceeded => StoreError::Timeout(message),
        _ => StoreError::Unavailable(format!(
            "control plane ({}): {}",
            status.code(),
            status.message()
        )),
    }
}

/// A lazily connecting channel to the endpoint of `options` (`store` names
/// the store in errors: `lease` or `dlq`), presenting `client`'s credentials.
/// `Invalid` when the endpoint is unset or not an `http://` or `https://` URL.
pub(crate) fn channel(
    store: &str,
    options: &ControlPlaneOptions,
    client: &ClientAuth,
) -> Result<AuthChannel, StoreError> {
    let Some(url) = options.endpoint.as_deref() else {
        return Err(StoreError::Invalid(format!(
            "stores.{store}.options.endpoint must be set when the agent is not managed by a control plane (--control-plane)"
        )));
    };
    let bad = |e: &dyn std::fmt::Display| {
        StoreError::Invalid(format!("stores.{store}.options.endpoint {url:?}: {e}"))
    };
    let endpoint = client
        .endpoint(url)
        .map_err(|e| bad(&e))?
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(REQUEST_TIMEOUT);
    Ok(client.wrap(endpoint.connect_lazy()))
}

/// A timestamp the control plane sent, `Corrupt` when missing or out of range.
pub(crate) fn time(
    field: &str,
    t: Option<prost_types::Timestamp>,
) -> Result<SystemTime, StoreError> {
    t.and_then(|t| SystemTime::try_from(t).ok()).ok_or_else(|| {
        StoreError::Corrupt(format!("control plane: {field} is missing or out of range"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_every_status_code() {
        let cases = [
            (Code::NotFound, Service::Dlq, "not_found"),
            (Code::InvalidArgument, Service::Dlq, "invalid"),
            (Code::FailedPrecondition, Service::Lease, "stale"),
            (Code::FailedPrecondition, Service::Dlq, "conflict"),
            (Code::AlreadyExists, Service::Dlq, "conflict"),
            (Code::Aborted, Service::Lease, "conflict"),
            (Code::ResourceExhausted, Service::Dlq, "full"),
            (Code::DataLoss, Service::Dlq, "corrupt"),
            (Code::DeadlineExceeded, Service::Lease, "timeout"),
            (Code::Unavailable, Service::Lease, "unavailable"),
            (Code::Internal, Service::Dlq, "unavailable"),
            (Code::Unknown, Service::Dlq, "unavailable"),
        ];
        for (code, service, kind) in cases {
            let e = store_error(service, &tonic::Status::new(code, "why"));
            assert_eq!(e.kind(), kind, "{code:?} for {service:?}");
            assert!(e.to_string().contains("why"), "{e}");
        }
    }

    #[tokio::test]
    async fn opens_without_a_control_plane_and_refuses_bad_endpoints() {
        let with = |e: &str| ControlPlaneOptions {
            endpoint: Some(e.to_owned()),
        };
        // Nothing listens there: opening still succeeds (lazy).
        let client = ClientAuth::default();
        assert!(channel("lease", &with("http://127.0.0.1:9"), &client).is_ok());
        assert!(channel("dlq", &with("https://cp.example:50051"), &client).is_ok());
        let unset = channel("dlq", &ControlPlaneOptions::default(), &client).expect_err("unset");
        assert!(
            unset.to_string().contains("stores.dlq.options.endpoint"),
            "{unset}"
        );
        let bad = channel("lease", &with("grpc://cp:1"), &client).expect_err("scheme");
        assert!(matches!(bad, StoreError::Invalid(_)), "{bad}");
    }
}
