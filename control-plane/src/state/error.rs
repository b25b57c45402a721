//! The one error type of the state store boundary.

/// What went wrong with a state store operation, and whether it happened.
///
/// `NotFound`, `Conflict`, `LeaseLost` and `Invalid` mean the operation
/// certainly changed nothing. `Unavailable` means the store could not be
/// reached or failed part-way: the operation may or may not have been applied,
/// and callers must treat it so (retry idempotently, or read back).
/// `Corrupt` means stored data cannot be read back as written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// The named thing does not exist.
    #[error("{what} not found")]
    NotFound {
        /// What was looked for, for example `config "b1" version 3`.
        what: String,
    },
    /// A compare-and-swap saw another version than the caller expected.
    /// Nothing was stored.
    #[error("version conflict: the current version is {current}")]
    Conflict {
        /// The current version; 0 when the thing does not exist.
        current: u64,
    },
    /// The caller does not hold the lease at that version (it was never
    /// held, was released, or expired and was taken by another holder).
    #[error("lease {key:?} is not held by {holder:?} at version {version}")]
    LeaseLost {
        /// The lease key.
        key: String,
        /// The holder the caller claimed to be.
        holder: String,
        /// The version the caller claimed to hold.
        version: u64,
    },
    /// The request is malformed (empty id, zero TTL, bad page token, a time
    /// out of range). Nothing was stored.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The store could not be reached or failed part-way; the operation may
    /// or may not have been applied.
    #[error("state store unavailable (the operation may or may not have been applied): {0}")]
    Unavailable(String),
    /// Stored data cannot be decoded (for example a negative version).
    #[error("state store data is corrupt: {0}")]
    Corrupt(String),
}

impl StateError {
    pub(crate) fn not_found(what: impl Into<String>) -> Self {
        Self::NotFound { what: what.into() }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::Invalid(message.into())
    }

    pub(crate) fn corrupt(message: impl Into<String>) -> Self {
        Self::Corrupt(message.into())
    }
}

/// The result of every state store operation.
pub type StateResult<T> = Result<T, StateError>;
