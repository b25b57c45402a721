//! The gRPC services, one file per service, over one shared [`Context`]:
//! the state store, the channel that tells agent streams a configuration
//! changed, the registry of connected agents (through which DLQ redrives
//! reach them) and the shutdown token every stream watches.
//!
//! - [`config`]: ConfigService (documents validated in [`documents`]);
//! - [`agent`]: AgentService: `Connect` streams ([`agent::session`]) and the
//!   agent listing;
//! - [`dlq`]: the shared `DlqService` of `ferry_shared::dlq::service` over
//!   the state store ([`dlq_convert`]) and the connected agents;
//! - [`lease`], [`metrics`]: the other services;
//! - [`assignment`]: an agent acts only for the bridges assigned to it
//!   (the body-dependent part of the authorization);
//! - [`status`]: the one mapping of errors to gRPC statuses and the shared
//!   request checks.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::state::StateStore;

pub mod agent;
pub mod assignment;
pub mod config;
pub mod dlq;
pub mod dlq_convert;
pub mod documents;
pub mod lease;
pub mod metrics;
pub mod registry;
pub mod status;

pub use registry::Registry;

/// Timings of the agent streams and redrives.
#[derive(Debug, Clone)]
pub struct Options {
    /// How often both sides send heartbeats; an agent silent for three
    /// intervals is disconnected.
    pub heartbeat_interval: Duration,
    /// How often a stream re-reads the configurations even without a local
    /// change (picks up changes made through another replica).
    pub resync_interval: Duration,
    /// How long a stream may take to send its Hello.
    pub hello_timeout: Duration,
    /// How long a redrive waits for the agent's CommandResult.
    pub command_timeout: Duration,
    /// What LeaseService takes as now: the system clock, or a test's.
    pub clock: Clock,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            heartbeat_interval: Duration::from_secs(10),
            resync_interval: Duration::from_secs(15),
            hello_timeout: Duration::from_secs(10),
            command_timeout: Duration::from_secs(30),
            clock: Clock::default(),
        }
    }
}

/// Where the lease rules read the time: the system clock by default; tests
/// (the agent's lease conformance suite, which passes fixed times) set their
/// own with [`Clock::from_fn`].
#[derive(Clone)]
pub struct Clock(Option<Arc<dyn Fn() -> SystemTime + Send + Sync>>);

impl Clock {
    /// A clock that answers `now()`.
    pub fn from_fn(now: impl Fn() -> SystemTime + Send + Sync + 'static) -> Self {
        Self(Some(Arc::new(now)))
    }

    /// The current time.
    pub fn now(&self) -> SystemTime {
        match &self.0 {
            Some(now) => now(),
            None => SystemTime::now(),
        }
    }
}

impl Default for Clock {
    /// The system clock.
    fn default() -> Self {
        Self(None)
    }
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Clock(custom)"
        } else {
            "Clock(system)"
        })
    }
}

/// What every service shares.
#[derive(Clone)]
pub struct Context {
    /// The durable state.
    pub store: Arc<dyn StateStore>,
    /// Bumped after every configuration change; agent streams re-reconcile.
    pub changes: watch::Sender<u64>,
    /// The agents connected to this replica.
    pub agents: Arc<Registry>,
    /// Timings.
    pub options: Options,
    /// Cancelled on shutdown: agent streams end cleanly.
    pub shutdown: CancellationToken,
}

impl Context {
    /// A context over `store`.
    pub fn new(store: Arc<dyn StateStore>, options: Options, shutdown: CancellationToken) -> Self {
        Self {
            store,
            changes: watch::Sender::new(0),
            agents: Arc::new(Registry::default()),
            options,
            shutdown,
        }
    }

    /// Tells every agent stream that configurations changed.
    pub fn notify_config_change(&self) {
        self.changes.send_modify(|generation| *generation += 1);
    }
}
