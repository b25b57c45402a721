//! ferry-control-plane: the gRPC service that owns bridge configurations and
//! their history, hands out leases with fencing versions, administers dead
//! letters and collects agents' metrics.
//!
//! - [`server`]: assembles the gRPC server (the Ferry services plus the
//!   standard health and reflection services) and runs it until shutdown.
//!
//! The binary `ferry-control-plane` parses flags and calls [`server::serve`];
//! `ferryctl` talks to it with the generated clients only.
#![forbid(unsafe_code)]

pub mod server;
