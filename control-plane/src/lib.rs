//! ferry-control-plane: owns bridge configurations and their history, hands
//! out leases with fencing versions, keeps dead letters and the latest
//! metrics of every agent.
//!
//! - [`server`]: assembles the gRPC server (the Ferry services plus the
//!   standard health and reflection services) and runs it until shutdown.
//! - [`state`]: the durable state behind every service, as one
//!   [`state::StateStore`] trait with an embedded `sqlite` backend (the
//!   default) and a `postgres` backend (several replicas on one database),
//!   chosen by URL with [`state::open_state_store`].
//!
//! The binary `ferry-control-plane` parses flags and calls [`server::serve`];
//! `ferryctl` talks to it with the generated clients only.
#![forbid(unsafe_code)]

pub mod server;
pub mod state;
