//! ferry-agent: the half of Ferry that runs near the brokers.
//!
//! An agent runs receivers, routes, outbox writers and drainers for the
//! bridges it is given. It is stateless apart from its stores:
//!
//! - [`transports`]: sessions, receivers and senders for the brokers and
//!   queues Ferry moves messages between (MQTT today), behind transport-neutral
//!   traits the routes and drainers use.
#![forbid(unsafe_code)]

pub mod transports;
