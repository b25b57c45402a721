//! What a DLQ store must do for [`super::service::DlqServer`] to serve it:
//! the [`DlqBackend`] trait each half implements over its own store (the
//! agent's local DLQ store, the control plane's state store), its errors and
//! their one mapping to gRPC statuses.
//!
//! A backend only stores and redelivers: every request check, default and
//! per-entry decision is the service's. Entries cross the trait in their
//! `ferry.v1` form, which both halves already convert to and from.

use tonic::Status;

use super::{DlqFilter, DlqStat};
use crate::api::v1 as pb;

/// A backend failure. Each variant says whether the operation certainly did
/// not happen (`NotFound`, `Invalid`, `Conflict`, `Corrupt`, `Full`) or
/// might have (`Unavailable`, `Timeout`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DlqBackendError {
    /// No such entry. Not applied.
    #[error("{0}")]
    NotFound(String),
    /// The store refused the arguments (a bad page token, a time out of
    /// range). Not applied.
    #[error("{0}")]
    Invalid(String),
    /// The operation contradicts the store's current state. Not applied.
    #[error("{0}")]
    Conflict(String),
    /// A stored entry cannot be decoded.
    #[error("{0}")]
    Corrupt(String),
    /// The store has no room left. Not applied.
    #[error("{0}")]
    Full(String),
    /// The store could not be reached; the operation may have been applied.
    #[error("{0}")]
    Unavailable(String),
    /// The store did not answer in time; the operation may have been applied.
    #[error("{0}")]
    Timeout(String),
}

/// The one mapping of backend errors to gRPC statuses.
pub fn status(error: DlqBackendError) -> Status {
    match error {
        DlqBackendError::NotFound(m) => Status::not_found(m),
        DlqBackendError::Invalid(m) => Status::invalid_argument(m),
        DlqBackendError::Conflict(m) => Status::failed_precondition(m),
        DlqBackendError::Corrupt(m) => Status::data_loss(m),
        DlqBackendError::Full(m) => Status::resource_exhausted(m),
        DlqBackendError::Unavailable(m) => Status::unavailable(m),
        DlqBackendError::Timeout(m) => Status::deadline_exceeded(m),
    }
}

/// Why one entry was not redelivered; the entry is kept either way.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RedriveError {
    /// Nothing can redeliver it here (no connected agent runs its route):
    /// certainly not redelivered.
    #[error("{0}")]
    Unroutable(String),
    /// The redelivery was refused, failed or timed out.
    #[error("{0}")]
    Failed(String),
}

/// One page of entries, oldest first.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DlqPage {
    /// The entries, with their envelopes.
    pub entries: Vec<pb::DlqEntry>,
    /// Token of the next page; `None` on the last page.
    pub next_page_token: Option<String>,
}

/// A DLQ store, as the service needs it. Dyn-compatible: the service holds
/// an `Arc<dyn DlqBackend>`.
#[tonic::async_trait]
pub trait DlqBackend: Send + Sync + 'static {
    /// Stores a checked entry (required fields set, `dead_lettered_at` set),
    /// durable when it returns; `false` when the id was already stored
    /// (nothing changed).
    async fn write(&self, entry: pb::DlqEntry) -> Result<bool, DlqBackendError>;

    /// The part of a write's authorization that depends on the entry (the
    /// role table already allowed the call): the control plane lets an
    /// agent write only for the bridges assigned to it. Allows by default.
    async fn authorize_write(
        &self,
        _caller: &crate::auth::Principal,
        _entry: &pb::DlqEntry,
    ) -> Result<(), tonic::Status> {
        Ok(())
    }

    /// At most `size` entries matching `filter` (`size` is already within
    /// the served limits), oldest first, after the page `token` names.
    async fn list(
        &self,
        filter: &DlqFilter,
        size: u32,
        token: Option<String>,
    ) -> Result<DlqPage, DlqBackendError>;

    /// One entry; `NotFound` when absent.
    async fn get(&self, id: &str) -> Result<pb::DlqEntry, DlqBackendError>;

    /// Deletes one entry; `NotFound` when absent.
    async fn delete(&self, id: &str) -> Result<(), DlqBackendError>;

    /// Deletes every entry matching `filter`; returns how many.
    async fn purge(&self, filter: &DlqFilter) -> Result<u64, DlqBackendError>;

    /// Counts per bridge, route, binding and reason of entries matching
    /// `filter`.
    async fn stats(&self, filter: &DlqFilter) -> Result<Vec<DlqStat>, DlqBackendError>;

    /// Puts `entry`'s envelope back on its binding; `Ok` only once that
    /// redelivery is durable. Never deletes the entry (the service does).
    async fn redrive(&self, entry: &pb::DlqEntry) -> Result<(), RedriveError>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn maps_every_backend_error() {
        let m = || "m".to_owned();
        for (error, code) in [
            (DlqBackendError::NotFound(m()), Code::NotFound),
            (DlqBackendError::Invalid(m()), Code::InvalidArgument),
            (DlqBackendError::Conflict(m()), Code::FailedPrecondition),
            (DlqBackendError::Corrupt(m()), Code::DataLoss),
            (DlqBackendError::Full(m()), Code::ResourceExhausted),
            (DlqBackendError::Unavailable(m()), Code::Unavailable),
            (DlqBackendError::Timeout(m()), Code::DeadlineExceeded),
        ] {
            let s = status(error);
            assert_eq!((s.code(), s.message()), (code, "m"));
        }
    }
}
