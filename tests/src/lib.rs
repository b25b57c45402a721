//! Ferry's end-to-end test harness: real brokers, real stores, real processes.
//!
//! Every end-to-end test in `tests/e2e/` builds on these helpers; none of them uses a shared
//! system service other than the PostgreSQL server, and each cleans up after itself.
//!
//! - [`ports`]: free loopback ports and waiting for a port to accept connections.
//! - [`wait`]: poll a condition until a deadline, failing with what was waited for (no sleeps
//!   as synchronisation).
//! - [`process`]: run one of the project's binaries (or any program) as a child process with its
//!   output captured to files, SIGTERM / SIGKILL it, wait for its exit; find the binaries.
//! - [`mosquitto`]: a private Mosquitto broker per test on a free port, which can be stopped,
//!   killed and restarted on the same port to simulate an outage.
//! - [`moto`]: one moto server (SQS + DynamoDB) shared by the tests of a process, and SDK clients
//!   pointed at it.
//! - [`postgres`]: a fresh PostgreSQL database per test, dropped afterwards.
//! - [`mysql`]: a fresh MySQL / MariaDB database per test (`$FERRY_TEST_MYSQL`), dropped
//!   afterwards.
//! - [`rabbitmq`]: an exclusive RabbitMQ queue per test, consumed into memory.
//! - [`nats`]: a JetStream stream per test with unique subjects.
//! - [`proxy`]: a TCP proxy a test cuts and restores, to take a broker or a store's server away
//!   from the agent without stopping it for other tests.
//! - [`mqtt`]: an MQTT test client: publish numbered messages, collect them and count
//!   duplicates and gaps.
//! - [`agent`]: a `ferry-agent run` process with its configuration, admin port and parsed
//!   `/metrics`.
//! - [`otlp`]: an OTLP trace receiver (the `TraceService` on tonic) keeping the spans it is
//!   sent.
//! - [`ids`]: unique names for queues, tables, topics and client ids.
//! - [`bench`]: the `ferry-bench` benchmark (Ferry beside Mosquitto's bridge); see
//!   `docs/benchmarks.md`.
//!
//! Child processes never outlive the test process: each one is watched by a tiny `sh` watchdog
//! that SIGKILLs it when the test process goes away, even if the test process is itself killed
//! (see [`process`]).
//!
//! The external programs come from `./scripts/setup.sh` (called by `./scripts/test.sh`):
//! `mosquitto` on the `PATH` or in `/usr/sbin`, moto in the venv at `$FERRY_VENV` (default
//! `.venv` at the repository root), PostgreSQL at `$FERRY_TEST_PG`. The project's binaries must be
//! built before the tests run (`cargo build --workspace --bins`; the test script does it).

#![forbid(unsafe_code)]

pub mod agent;
pub mod bench;
pub mod ids;
pub mod mosquitto;
pub mod moto;
pub mod mqtt;
pub mod mysql;
pub mod nats;
pub mod otlp;
pub mod ports;
pub mod postgres;
pub mod process;
pub mod proxy;
pub mod rabbitmq;
pub mod wait;

pub use agent::Agent;
pub use mosquitto::Mosquitto;
pub use moto::Moto;
pub use mqtt::{Collector, Counts, PublishOptions, publish_seq, publish_seq_with};
pub use ports::free_port;
pub use postgres::TestDatabase;
pub use process::{ChildProcess, project_bin};
