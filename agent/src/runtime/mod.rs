//! The runtime: builds a running bridge from a [`ValidConfig`] and owns its
//! tasks.
//!
//! [`Bridge::start`] opens the stores, starts one MQTT session per configured
//! session (with the receiver of the route it feeds), one task per route
//! (`direct_hold`, or the `shared_outbox` writer) and one drainer per
//! `shared_outbox` route, plus a watcher per session for readiness and the
//! connected gauge. [`Bridge::shutdown`] stops them in dependency order:
//!
//! 1. routes stop taking deliveries and finish what is in progress within the
//!    grace period; what is left stays unsettled (the broker redelivers);
//! 2. drainers finish their cycle within the grace period and release their
//!    leases;
//! 3. sessions disconnect (their brokers keep the unacknowledged messages).

mod build;
mod settings;

use std::sync::Arc;
use std::time::Duration;

use ferry_shared::config::ValidConfig;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::health::Readiness;
use crate::metrics::Metrics;
use crate::stores::DlqStore;
use crate::transports::mqtt::MqttSession;

use crate::routes::Redrive;

/// The grace period when no route sets `step_down_grace`.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(5);

/// What a bridge needs from its surroundings.
#[derive(Clone, Debug)]
pub struct Deps {
    /// This agent's id: the lease holder, stable across restarts.
    pub agent_id: String,
    /// Where the bridge counts.
    pub metrics: Arc<Metrics>,
    /// Where the bridge reports readiness.
    pub readiness: Readiness,
}

/// Why a bridge could not start.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// A store could not be opened.
    #[error("{0}")]
    Store(String),
    /// A session's settings were refused by the transport.
    #[error("{0}")]
    Session(String),
    /// A valid configuration this agent cannot run (yet).
    #[error("{0}")]
    Unsupported(String),
}

/// A running bridge.
pub struct Bridge {
    routes: CancellationToken,
    drainers: CancellationToken,
    sessions_token: CancellationToken,
    route_tasks: Vec<JoinHandle<()>>,
    drainer_tasks: Vec<JoinHandle<()>>,
    watcher_tasks: Vec<JoinHandle<()>>,
    sessions: Vec<MqttSession>,
    dlq: Option<Arc<dyn DlqStore>>,
    redrive: Arc<Redrive>,
    grace: Duration,
}

impl std::fmt::Debug for Bridge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bridge")
            .field("routes", &self.route_tasks.len())
            .field("drainers", &self.drainer_tasks.len())
            .finish_non_exhaustive()
    }
}

impl Bridge {
    /// Opens the stores and starts every session, route and drainer.
    pub async fn start(valid: &ValidConfig, deps: Deps) -> Result<Bridge, BuildError> {
        build::start(valid, deps).await
    }

    /// The DLQ store, when configured (for the local DlqService).
    pub fn dlq(&self) -> Option<Arc<dyn DlqStore>> {
        self.dlq.clone()
    }

    /// Puts DLQ entries back on their binding.
    pub fn redrive(&self) -> Arc<Redrive> {
        Arc::clone(&self.redrive)
    }

    /// The grace period for in-flight work at shutdown.
    pub fn grace(&self) -> Duration {
        self.grace
    }

    /// Stops intake, lets in-flight work finish or leaves it to the source,
    /// releases leases, disconnects.
    pub async fn shutdown(self) {
        // Each task bounds itself by the grace period; the margin covers a
        // store call in progress.
        let bound = self.grace + Duration::from_secs(2);
        self.routes.cancel();
        join_all("route", self.route_tasks, bound).await;
        self.drainers.cancel();
        join_all("drainer", self.drainer_tasks, bound).await;
        self.sessions_token.cancel();
        for session in self.sessions {
            session.stopped().await;
        }
        join_all("watcher", self.watcher_tasks, bound).await;
        tracing::info!("bridge stopped");
    }
}

async fn join_all(what: &str, tasks: Vec<JoinHandle<()>>, bound: Duration) {
    for mut task in tasks {
        match tokio::time::timeout(bound, &mut task).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::error!(what, %error, "task failed"),
            Err(_) => {
                tracing::warn!(what, "task did not stop in time; aborted");
                task.abort();
            }
        }
    }
}
