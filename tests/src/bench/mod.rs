//! The benchmark behind `ferry-bench`: Ferry's agent beside Mosquitto's own bridge, in one run.
//!
//! Each run starts fresh brokers A and B and moves 256-byte QoS 1 messages from A to B, either
//! through Mosquitto's bridge (configured in broker A) or through `ferry-agent run`; subscribers
//! on B count every message by number and measure throughput and end-to-end latency. The
//! binary (`src/bin/ferry-bench.rs`) chooses the runs and prints the [`report`].
//!
//! - [`payload`]: the messages (sequence number, send stamp, padding) and the shared clock.
//! - [`brokers`]: brokers A and B, and the bridge's `connection` sections.
//! - [`ferry`]: the agent's configuration and process.
//! - [`publisher`]: pipelined QoS 1 publishing, flat out or at a fixed rate.
//! - [`collector`]: a subscriber per destination, counting and timing arrivals.
//! - [`latency`]: percentiles of the latency samples.
//! - [`rss`]: the agent's resident memory from `/proc`.
//! - [`cpu`]: CPU time per message of the agent, the brokers and `ferry-bench` from `/proc`.
//! - [`callgrind`]: the agent's instructions per message under Callgrind (`--callgrind`).
//! - [`scenario`]: one run from start to stop, with deadlines.
//! - [`report`]: the table and the floors.
//! - [`relay`]: `ferry-bench relay`, an outbox table in PostgreSQL relayed to JetStream and
//!   RabbitMQ by Ferry and by a minimal relay (issue 20).

pub mod brokers;
pub mod callgrind;
pub mod collector;
pub mod cpu;
pub mod ferry;
pub mod latency;
pub mod payload;
pub mod publisher;
pub mod relay;
pub mod report;
pub mod rss;
pub mod scenario;

/// What the source receiver (and each bridge connection) subscribes to on broker A.
pub const SOURCE_FILTER: &str = "sensors/#";
/// The topic of the measured messages on broker A.
pub const MEASURED_TOPIC: &str = "sensors/bench";
/// The topic of the warm-up probes on broker A.
pub const PROBE_TOPIC: &str = "sensors/probe";
/// The destination prefixes on broker B (a one-destination run uses the first).
pub const DESTINATIONS: [&str; 3] = ["events", "audit", "analytics"];
