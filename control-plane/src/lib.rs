//! ferry-control-plane: owns bridge configurations and their history, hands
//! out leases with fencing versions, keeps dead letters and the latest
//! metrics of every agent, and streams configurations to agents.
//!
//! - [`server`]: assembles the gRPC server (the Ferry services plus the
//!   standard health and reflection services) and runs it until shutdown.
//! - [`services`]: one module per gRPC service over a shared context (state
//!   store, connected-agent registry, configuration-change channel,
//!   shutdown token); errors become statuses in one place
//!   ([`services::status`]).
//! - [`rpc_span`]: one span per RPC, continuing the caller's trace.
//! - [`http`]: `GET /metrics` in Prometheus text format.
//! - [`state`]: the durable state behind every service, as one
//!   [`state::StateStore`] trait with an embedded `sqlite` backend (the
//!   default) and a `postgres` backend (several replicas on one database),
//!   chosen by URL with [`state::open_state_store`].
//!
//! The binary `ferry-control-plane` parses flags and calls
//! [`server::ControlPlane::serve`]; `ferryctl` talks to it with the generated
//! clients only.
#![forbid(unsafe_code)]

pub mod http;
pub mod rpc_span;
pub mod server;
pub mod services;
pub mod state;
