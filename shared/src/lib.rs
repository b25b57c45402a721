//! ferry-shared: what the agent and the control plane have in common.
//!
//! - [`auth`]: authentication and TLS — bearer tokens, client
//!   certificates, the role table and the tower layer that checks them, the
//!   clients' credentials — and the caller audit records name.
//! - [`audit`]: the structured audit events (target `ferry::audit`) of what
//!   operators change: configurations, dead letters, leases.
//! - [`api`]: the generated `ferry.v1` gRPC messages, clients and servers
//!   (from `proto/ferry/v1`), plus the encoded descriptor set for reflection.
//! - [`address`]: binding address templates (`orders.{header:aggregate_id}`) filled from the
//!   envelope, and the RabbitMQ and NATS address shapes the validator and the senders share.
//! - [`envelope`]: the message as Ferry carries it, with the storage
//!   encoding the outbox, the DLQ and the API share.
//! - [`dlq`]: dead-letter reasons, filters and counts with their `ferry.v1`
//!   forms, and the request checks both DLQ services share.
//! - [`lease`]: the lease rules (grant, renew, release and the fencing
//!   argument) every lease backend of both halves applies.
//! - [`config`]: the bridge configuration model (the YAML document), its
//!   loading with `${VAR}` expansion, and the pure validator both halves run.
//! - [`listener`]: the accept loop of the HTTP listeners, plain or TLS.
//! - [`telemetry`]: the one logging and tracing set-up of every binary
//!   (OTLP export through a bounded queue) and W3C trace context
//!   propagation.
//! - [`os`]: private data directories created when missing, and one-line reasons for a
//!   listener that cannot bind or a file that cannot be read.
//!
//! The agent and the control plane never depend on each other; they meet here.
#![forbid(unsafe_code)]

pub mod address;
pub mod api;
pub mod audit;
pub mod auth;
pub mod config;
pub mod dlq;
pub mod envelope;
pub mod lease;
pub mod listener;
pub mod mqtt_string;
pub mod os;
pub mod postgres;
pub mod telemetry;
pub mod tls;
