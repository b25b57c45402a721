//! ferry-control-plane: owns bridge configurations and their history, hands
//! out leases with fencing versions, keeps dead letters and the latest
//! metrics of every agent.
//!
//! - [`state`]: the durable state behind every service, as one
//!   [`state::StateStore`] trait with an embedded `sqlite` backend (the
//!   default) and a `postgres` backend (several replicas on one database),
//!   chosen by URL with [`state::open_state_store`].
#![forbid(unsafe_code)]

pub mod state;
