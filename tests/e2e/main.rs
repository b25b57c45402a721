//! Ferry's end-to-end tests: one test binary, one module per area.
//!
//! They start real processes — Mosquitto brokers, a moto server, the project's binaries — on
//! free loopback ports, and use fresh PostgreSQL databases, through the `ferry_tests` harness.
//! Run them with `./scripts/test.sh`, which installs what they need and builds the binaries
//! first.

#![forbid(unsafe_code)]

mod agent_delivery;
mod agent_direct_hold;
mod agent_dlq_fleet;
mod agent_failover;
mod agent_failures;
mod agent_figures;
mod agent_fleet;
mod agent_fleet_changes;
mod agent_ingress;
mod agent_managed;
mod agent_relay;
mod agent_reload;
mod agent_shared_ingress;
mod agent_store_outage;
mod agent_support;
mod agent_tracing;
mod agent_visibility;
mod auth;
mod aws;
mod control_plane;
mod cp_stores;
mod cp_stores_conformance;
mod deploy_manifests;
mod dlq_endpoints;
mod ferryctl;
mod first_run;
mod harness_selftest;
mod quickstart;
mod secrets;
