//! ferry-agent: the half of Ferry that runs near the brokers.
//!
//! An agent runs receivers, routes, outbox writers and drainers for the
//! bridges it is given. It is stateless apart from its stores:
//!
//! - [`stores`]: the outbox (per-destination progress, fenced by lease
//!   versions), the lease store and the dead-letter queue, each a trait with
//!   `memory` and `sqlite` backends and one conformance suite.
//! - [`metrics`]: every metric, defined once; the conservation counters.
//! - [`log_state`]: one log line per change of state of a failing store
//!   operation.
//! - [`health`]: readiness conditions (`/readyz`), reported by the runtime,
//!   the drainers and the stores.
//! - [`admin`]: the admin listener (`/metrics`, `/healthz`, `/readyz`, and
//!   the local `DlqService` over gRPC).
//! - [`runtime`]: builds a running bridge from a validated configuration and
//!   owns its tasks; it wires [`routes`] (`direct_hold`, the `shared_outbox`
//!   writer, redrive) and one [`drainer`] per `shared_outbox` route to the
//!   stores and transports below.
//! - [`control`]: a managed agent's side of the control plane: the
//!   `Connect` stream, the running bridges by id, the configuration cache.
//! - [`datadir`]: one agent per data directory (an exclusive lock file
//!   beside the SQLite stores, taken before any store is opened).
//! - [`ids`]: new unique ids (UUIDv7 text) for records and messages.
//! - [`spans`]: the per-message spans (receive to settle, append, send, DLQ
//!   write, expiry), created only when tracing is on.
//! - [`transports`]: sessions, receivers and senders for the brokers and
//!   queues Ferry moves messages between (MQTT today), behind transport-neutral
//!   traits the routes and drainers use.
//!
//! Each floor uses only those below it: `control` → `runtime` → `admin`, `drainer`,
//! `routes` → `health`, `stores`, `transports`, `metrics`.
#![forbid(unsafe_code)]

pub mod admin;
pub mod control;
pub mod datadir;
pub mod drainer;
pub mod health;
pub mod ids;
pub mod log_state;
pub mod metrics;
pub mod routes;
pub mod runtime;
pub mod spans;
pub mod stores;
pub mod transports;
