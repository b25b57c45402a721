//! The runtime: runs a bridge from a [`ValidConfig`], owns its tasks, and
//! applies a new version of the bridge as a diff.
//!
//! A running bridge is made of parts that start and stop on their own:
//!
//! - its stores ([`stores`]), shared by every route;
//! - its sessions, started through the transport-neutral factory
//!   ([`sessions::start`]), each with the receiver of the route it feeds, its
//!   own token and a watcher for readiness and the session gauges;
//! - its routes ([`route::start`]), one per delivery mode (`direct_hold`, or
//!   the `shared_outbox` writer plus its drainer), each with its own tokens.
//!
//! Invariants:
//!
//! - parts stop in dependency order: routes stop taking deliveries and finish
//!   what is in progress within the grace period (what is left stays
//!   unsettled: the broker redelivers); then drainers finish their cycle and
//!   release their leases; then sessions disconnect (their brokers keep the
//!   unacknowledged messages);
//! - [`Bridge::apply`] stops only what the new version changes or removes
//!   and starts only what it changes or adds ([`diff`], ADR 0005): a part
//!   left alone is never paused or reconnected. A part stops before its
//!   replacement starts, so one partition never has two drainers;
//! - a version that cannot be started leaves the previous one running: what
//!   the change stopped is started again with the previous version.

mod diff;
mod route;
mod sessions;
mod settings;
mod stores;

use ferry_shared::auth::client::ClientAuth;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use ferry_shared::config::ValidConfig;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::health::Readiness;
use crate::metrics::Metrics;
use crate::routes::Redrive;
use crate::stores::DlqStore;

pub use diff::{Changes, Diff, diff};
use route::{RouteContext, RunningRoute};
use sessions::SessionEntry;
use stores::Stores;

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
    /// The control plane the agent is managed by (`--control-plane`): the
    /// endpoint of `control_plane` stores that name none.
    pub control_plane: Option<String>,
    /// The credentials `control_plane` stores present (token, CA, client
    /// certificate).
    pub client: ClientAuth,
}

/// Why a bridge, or a new version of it, could not start.
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

/// What [`Bridge::apply`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApplyReport {
    /// Which sessions and routes were left alone, started, stopped or
    /// restarted.
    pub diff: Diff,
}

/// A running bridge.
pub struct Bridge {
    config: ValidConfig,
    deps: Deps,
    stores: Stores,
    sessions: HashMap<String, SessionEntry>,
    routes: HashMap<String, RunningRoute>,
    redrive: Arc<Redrive>,
    /// The claim owner of this bridge's drainers: agent id and incarnation.
    owner: String,
    /// Partitions whose records this process has counted as received.
    counted: HashSet<String>,
    /// Sessions this bridge has started at least once.
    started_sessions: HashSet<String>,
    /// The address of every binding this bridge has run.
    addresses: HashMap<String, String>,
}

impl std::fmt::Debug for Bridge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bridge")
            .field("bridge", &self.config.bridge_id())
            .field("sessions", &self.sessions.len())
            .field("routes", &self.routes.len())
            .finish_non_exhaustive()
    }
}

impl Bridge {
    /// Opens the stores and starts every session, route and drainer.
    pub async fn start(valid: &ValidConfig, deps: Deps) -> Result<Bridge, BuildError> {
        let stores = stores::open(valid, &deps).await?;
        let mut bridge = Bridge {
            config: valid.clone(),
            owner: format!("{}/{}", deps.agent_id, uuid::Uuid::now_v7()),
            deps,
            stores,
            sessions: HashMap::new(),
            routes: HashMap::new(),
            redrive: Arc::new(Redrive::new(valid.bridge_id().to_owned())),
            counted: HashSet::new(),
            started_sessions: HashSet::new(),
            addresses: HashMap::new(),
        };
        let (sessions, routes) = everything(valid);
        if let Err(e) = bridge.start_parts(&sessions, &routes).await {
            // Nothing started before the error may outlive it.
            bridge.stop_parts(&sessions, &routes).await;
            return Err(e);
        }
        Ok(bridge)
    }

    /// The version running.
    pub fn config(&self) -> &ValidConfig {
        &self.config
    }

    /// Applies `new`, a new version of the same bridge, as a diff (see the
    /// module's invariants and ADR 0005). On an error the previous version
    /// keeps running (what the change had stopped is started again).
    pub async fn apply(&mut self, new: &ValidConfig) -> Result<ApplyReport, BuildError> {
        if new.bridge_id() != self.config.bridge_id() {
            return Err(BuildError::Unsupported(format!(
                "bridge {} cannot become bridge {}: run it as a bridge of its own",
                self.config.bridge_id(),
                new.bridge_id()
            )));
        }
        let d = diff(&self.config, new);
        if d.is_empty() {
            self.config = new.clone();
            return Ok(ApplyReport { diff: d });
        }
        // What can be refused without I/O is refused before anything stops.
        for id in d.sessions.starting() {
            if let Some(session) = new.session(id) {
                sessions::check(session, &diff::feed(new, id))?;
            }
        }
        let old = self.config.clone();
        if d.restart_all {
            self.restart_all(&old, new).await?;
        } else {
            let stopping = (to_vec(d.sessions.stopping()), to_vec(d.routes.stopping()));
            let starting = (to_vec(d.sessions.starting()), to_vec(d.routes.starting()));
            self.stop_parts(&stopping.0, &stopping.1).await;
            self.config = new.clone();
            if let Err(e) = self.start_parts(&starting.0, &starting.1).await {
                tracing::warn!(error = %e, "the new version cannot start; the previous one starts again");
                self.stop_parts(&starting.0, &starting.1).await;
                self.config = old;
                if let Err(again) = self.start_parts(&stopping.0, &stopping.1).await {
                    tracing::error!(error = %again, "the previous version cannot start again either");
                }
                return Err(e);
            }
        }
        tracing::info!(
            restart_all = d.restart_all,
            routes_unchanged = ?d.routes.unchanged,
            routes_added = ?d.routes.added,
            routes_removed = ?d.routes.removed,
            routes_changed = ?d.routes.changed,
            sessions_restarted = ?d.sessions.changed,
            "configuration applied"
        );
        Ok(ApplyReport { diff: d })
    }

    /// The DLQ store, when configured (for the local DlqService).
    pub fn dlq(&self) -> Option<Arc<dyn DlqStore>> {
        self.stores.dlq.clone()
    }

    /// Puts DLQ entries back on their binding.
    pub fn redrive(&self) -> Arc<Redrive> {
        Arc::clone(&self.redrive)
    }

    /// The grace period for in-flight work at shutdown.
    pub fn grace(&self) -> Duration {
        self.routes
            .values()
            .map(|r| r.grace)
            .max()
            .unwrap_or(DEFAULT_GRACE)
    }

    /// Stops intake, lets in-flight work finish or leaves it to the source,
    /// releases leases, disconnects.
    pub async fn shutdown(mut self) {
        let (sessions, routes) = everything(&self.config);
        self.stop_parts(&sessions, &routes).await;
        tracing::info!("bridge stopped");
    }

    /// A change of stores: everything stops, the stores close, the new
    /// version starts on new stores; if it cannot, the previous one does.
    async fn restart_all(
        &mut self,
        old: &ValidConfig,
        new: &ValidConfig,
    ) -> Result<(), BuildError> {
        let (sessions, routes) = everything(old);
        self.stop_parts(&sessions, &routes).await;
        if old.stores.outbox != new.stores.outbox {
            self.counted.clear();
        }
        match self.start_all(new).await {
            Ok(()) => Ok(()),
            Err(e) => {
                tracing::warn!(error = %e, "the new version cannot start; the previous one starts again");
                let (sessions, routes) = everything(new);
                self.stop_parts(&sessions, &routes).await;
                if old.stores.outbox != new.stores.outbox {
                    self.counted.clear();
                }
                if let Err(again) = self.start_all(old).await {
                    tracing::error!(error = %again, "the previous version cannot start again either");
                }
                Err(e)
            }
        }
    }

    /// Opens `valid`'s stores (after closing the current ones: an observed
    /// store's readiness condition is named after the store) and starts
    /// everything.
    async fn start_all(&mut self, valid: &ValidConfig) -> Result<(), BuildError> {
        self.stores = Stores::none();
        self.config = valid.clone();
        self.stores = stores::open(valid, &self.deps).await?;
        let (sessions, routes) = everything(valid);
        self.start_parts(&sessions, &routes).await
    }

    /// Starts `sessions`, then `routes`, of the running version. A route's
    /// receiver comes from its session, so that session must be among
    /// `sessions`.
    async fn start_parts(
        &mut self,
        sessions: &[String],
        routes: &[String],
    ) -> Result<(), BuildError> {
        let bridge_id = self.config.bridge_id().to_owned();
        let mut receivers = HashMap::new();
        for id in sessions {
            let Some(config) = self.config.session(id) else {
                continue;
            };
            for r in self.config.receivers.iter().filter(|r| &r.session_id == id) {
                if !self
                    .config
                    .routes
                    .iter()
                    .any(|route| route.receiver_id == r.id)
                {
                    tracing::warn!(receiver = %r.id, "receiver feeds no route; not subscribed");
                }
            }
            let feed = diff::feed(&self.config, id);
            let token = CancellationToken::new();
            let started = sessions::start(config, &feed, token.clone())?;
            if let (Some(rx), Some((_, route))) = (started.receiver, feed.first()) {
                receivers.insert(route.id.clone(), rx);
            }
            let restarted = !self.started_sessions.insert(id.clone());
            let entry = SessionEntry::watch(
                id,
                started.session,
                token,
                &self.deps,
                &bridge_id,
                restarted,
            );
            self.sessions.insert(id.clone(), entry);
        }
        for b in &self.config.bindings {
            self.addresses.insert(b.id.clone(), b.address.clone());
        }
        for id in routes {
            let Some(route) = self.config.route(id) else {
                continue;
            };
            let receiver = receivers.remove(id).ok_or_else(|| {
                BuildError::Unsupported(format!(
                    "route {}: receiver {} is not on a started session",
                    route.id, route.receiver_id
                ))
            })?;
            let ctx = RouteContext {
                valid: &self.config,
                deps: &self.deps,
                stores: &self.stores,
                sessions: &self.sessions,
                owner: &self.owner,
                addresses: &self.addresses,
            };
            let (running, target) = route::start(&ctx, route, receiver, &mut self.counted).await?;
            self.redrive.set_target(id, Some(target));
            self.routes.insert(id.clone(), running);
        }
        Ok(())
    }

    /// Stops `routes`, then `sessions` (those running; see the module's
    /// order).
    async fn stop_parts(&mut self, sessions: &[String], routes: &[String]) {
        let mut stopping = Vec::new();
        for id in routes {
            if let Some(r) = self.routes.remove(id) {
                self.redrive.set_target(id, None);
                stopping.push(r);
            }
        }
        let bound = stopping
            .iter()
            .map(|r| r.grace)
            .max()
            .unwrap_or(DEFAULT_GRACE)
            + Duration::from_secs(2);
        route::stop_all(stopping).await;
        let entries: Vec<SessionEntry> = sessions
            .iter()
            .filter_map(|id| self.sessions.remove(id))
            .collect();
        futures::future::join_all(entries.into_iter().map(|e| e.stop(bound))).await;
    }
}

/// Every session and route id of `valid`.
fn everything(valid: &ValidConfig) -> (Vec<String>, Vec<String>) {
    (
        valid.sessions.iter().map(|s| s.id.clone()).collect(),
        valid.routes.iter().map(|r| r.id.clone()).collect(),
    )
}

fn to_vec<'a>(ids: impl Iterator<Item = &'a String>) -> Vec<String> {
    ids.cloned().collect()
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
