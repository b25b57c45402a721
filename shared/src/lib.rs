//! ferry-shared: what the agent and the control plane have in common.
//!
//! - [`auth`]: the principal an authenticated request carries and the
//!   caller audit records name.
//! - [`api`]: the generated `ferry.v1` gRPC messages, clients and servers
//!   (from `proto/ferry/v1`), plus the encoded descriptor set for reflection.
//! - [`envelope`]: the message as Ferry carries it, with the storage
//!   encoding the outbox, the DLQ and the API share.
//! - [`dlq`]: dead-letter reasons, filters and counts with their `ferry.v1`
//!   forms, and the request checks both DLQ services share.
//! - [`lease`]: the lease rules (grant, renew, release and the fencing
//!   argument) every lease backend of both halves applies.
//! - [`config`]: the bridge configuration model (the YAML document), its
//!   loading with `${VAR}` expansion, and the pure validator both halves run.
//! - [`listener`]: the accept loop of the HTTP listeners, plain or TLS.
//! - [`os`]: private data directories created when missing, and one-line reasons for a
//!   listener that cannot bind or a file that cannot be read.
//!
//! The agent and the control plane never depend on each other; they meet here.
#![forbid(unsafe_code)]

pub mod api;
pub mod auth;
pub mod config;
pub mod dlq;
pub mod envelope;
pub mod lease;
pub mod listener;
pub mod os;
