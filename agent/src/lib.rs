//! ferry-agent.
#![forbid(unsafe_code)]

pub mod admin;
pub mod metrics;
