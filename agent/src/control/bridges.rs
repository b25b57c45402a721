//! The bridges a managed agent runs: a map bridge id → running [`Bridge`],
//! each independent of the others.
//!
//! Invariants:
//! - a bridge runs at most one version at a time: a new version of a running
//!   bridge is applied to it as a diff (ADR 0005), in
//!   [`Bridges::apply_version`], the one place where a version replaces another;
//! - a version that fails to start is refused and the last good version is
//!   started again, so a refused push never leaves a bridge stopped that ran
//!   before (unless its own restart fails, which is logged);
//! - only a running version is cached, and [`Bridges::versions`] reports
//!   exactly what runs (for the Hello after a reconnect);
//! - [`Bridges::handles`] lists exactly the running bridges, each with its
//!   redrive entry point and its routes' delivery modes (for commands and
//!   metrics snapshots, which run beside the applier);
//! - the directories of a bridge's SQLite stores are locked for this agent
//!   before any of its stores is opened, and stay locked until the process
//!   ends (one agent per data directory, see [`crate::datadir`]).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use ferry_shared::config::{CheckError, ProcessEnv, ValidConfig, check_bytes};
use tokio::sync::watch;

use super::cache::{CacheError, Cached, ConfigCache};
use crate::datadir::{self, DataDirLocks};
use crate::health::ReadinessCondition;
use crate::metrics::Metrics;
use crate::routes::Redrive;
use crate::runtime::{Bridge, Deps};

/// Why a version was refused; the bridge keeps its last good version.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The document did not load or is invalid in this agent's environment.
    #[error("invalid configuration: {0}")]
    Invalid(CheckError),
    /// The document is for another bridge than the push says.
    #[error("the document's bridge id is {found:?}, the push is for {expected:?}")]
    WrongBridge {
        /// The push's bridge id.
        expected: String,
        /// The document's.
        found: String,
    },
    /// A data directory could not be created or locked.
    #[error(transparent)]
    Lock(#[from] datadir::LockError),
    /// The bridge did not start (a store did not open, a session was refused).
    #[error("starting the bridge: {0}")]
    Start(#[from] crate::runtime::BuildError),
}

impl ApplyError {
    /// Every problem as `path: message` (one line for a non-validation error).
    pub fn details(&self) -> Vec<String> {
        match self {
            ApplyError::Invalid(e) => e.messages(),
            other => vec![other.to_string()],
        }
    }
}

/// What commands and metrics snapshots need of one running bridge.
#[derive(Clone, Debug)]
pub struct BridgeHandle {
    /// The version it runs.
    pub version: u64,
    /// Puts a DLQ entry back on its binding.
    pub redrive: Arc<Redrive>,
    /// Route id → `direct_hold` or `shared_outbox`.
    pub delivery_modes: BTreeMap<String, &'static str>,
}

struct Running {
    version: u64,
    yaml: String,
    valid: ValidConfig,
    bridge: Bridge,
}

/// The running bridges.
pub struct Bridges {
    deps: Deps,
    cache: ConfigCache,
    running: BTreeMap<String, Running>,
    locks: BTreeMap<PathBuf, DataDirLocks>,
    versions: watch::Sender<BTreeMap<String, u64>>,
    handles: watch::Sender<BTreeMap<String, BridgeHandle>>,
    /// Not ready until the cached bridges are started (or failed to).
    loading: Option<ReadinessCondition>,
}

impl Bridges {
    /// No bridge yet; `data_dir` (canonical) is already locked by `lock`.
    /// The agent is not ready until [`Bridges::start_cached`] has run.
    pub fn new(deps: Deps, cache: ConfigCache, data_dir: PathBuf, lock: DataDirLocks) -> Self {
        let loading = deps.readiness.condition("cached configurations started");
        Self {
            loading: Some(loading),
            deps,
            cache,
            running: BTreeMap::new(),
            locks: BTreeMap::from([(data_dir, lock)]),
            versions: watch::Sender::new(BTreeMap::new()),
            handles: watch::Sender::new(BTreeMap::new()),
        }
    }

    /// The version each running bridge runs, kept up to date.
    pub fn versions(&self) -> watch::Receiver<BTreeMap<String, u64>> {
        self.versions.subscribe()
    }

    /// Every running bridge's handle, kept up to date.
    pub fn handles(&self) -> watch::Receiver<BTreeMap<String, BridgeHandle>> {
        self.handles.subscribe()
    }

    /// Where the bridges count.
    pub fn metrics(&self) -> Arc<Metrics> {
        Arc::clone(&self.deps.metrics)
    }

    /// The version `bridge` runs, if any.
    pub fn version(&self, bridge: &str) -> Option<u64> {
        self.running.get(bridge).map(|r| r.version)
    }

    /// Starts every cached configuration (at start, before the control
    /// plane is reached), then lets the agent be ready. A cached version
    /// that no longer starts is logged and skipped; the control plane pushes
    /// it again.
    pub async fn start_cached(&mut self) {
        let (cached, problems) = match self.cache.load() {
            Ok(loaded) => loaded,
            Err(error) => {
                tracing::warn!(%error, "cannot read the configuration cache");
                self.loading = None;
                return;
            }
        };
        for error in problems {
            tracing::warn!(%error, "cached configuration skipped");
        }
        for (bridge, c) in cached {
            match self.apply_version(&bridge, c.version, &c.yaml).await {
                Ok(()) => {
                    tracing::info!(%bridge, version = c.version, "bridge running from the cache");
                }
                Err(error) => {
                    tracing::warn!(%bridge, version = c.version, error = %error, "cached configuration does not start");
                }
            }
        }
        self.loading = None;
    }

    /// Runs `version` of `bridge` (the document `yaml`, as pushed): checks
    /// it, applies it to the running bridge as a diff (or starts it) and
    /// caches it. On an error the last good version keeps running. A version
    /// already running is left alone.
    pub async fn apply_version(
        &mut self,
        bridge: &str,
        version: u64,
        yaml: &str,
    ) -> Result<(), ApplyError> {
        if self.version(bridge) == Some(version) {
            return Ok(());
        }
        let valid = check_bytes(yaml.as_bytes(), &ProcessEnv).map_err(ApplyError::Invalid)?;
        if valid.bridge_id() != bridge {
            return Err(ApplyError::WrongBridge {
                expected: bridge.to_owned(),
                found: valid.bridge_id().to_owned(),
            });
        }
        self.lock_dirs(&valid)?;
        if let Some(running) = self.running.get_mut(bridge) {
            // A new version of a running bridge is applied as a diff (ADR
            // 0005): what did not change keeps running; on an error the
            // bridge puts back what it stopped and the last good version
            // keeps running.
            running
                .bridge
                .apply(&valid)
                .await
                .map_err(ApplyError::Start)?;
            running.version = version;
            running.yaml = yaml.to_owned();
            running.valid = valid;
            // Published first: the watches name the version that runs
            // while its cache file is written.
            self.publish();
            self.cache(bridge, version, yaml).await;
            return Ok(());
        }
        let started = Bridge::start(&valid, self.deps.clone())
            .await
            .map_err(ApplyError::Start)?;
        self.insert(bridge, version, yaml.to_owned(), valid, started);
        self.cache(bridge, version, yaml).await;
        Ok(())
    }

    /// Caches an ACKed version (a failure is logged: the bridge runs; only a
    /// start without the control plane would miss it, and the next ACKed
    /// version is cached again).
    async fn cache(&self, bridge: &str, version: u64, yaml: &str) {
        let cached = Cached {
            version,
            yaml: yaml.to_owned(),
        };
        let stored = self
            .change_cache(bridge, move |cache, id| cache.store(id, &cached))
            .await;
        if let Err(error) = stored {
            tracing::error!(%bridge, version, %error, "cannot cache the configuration");
        }
    }

    /// Runs `change` on `bridge`'s cached file in the blocking pool: it
    /// writes and syncs files, and the runtime's workers (one on a small
    /// node, ADR 0017) keep running every route meanwhile.
    async fn change_cache(
        &self,
        bridge: &str,
        change: impl FnOnce(&ConfigCache, &str) -> Result<(), CacheError> + Send + 'static,
    ) -> Result<(), String> {
        let (cache, id) = (self.cache.clone(), bridge.to_owned());
        match tokio::task::spawn_blocking(move || change(&cache, &id)).await {
            Ok(done) => done.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Stops `bridge` and forgets it (a withdrawal).
    pub async fn withdraw(&mut self, bridge: &str) {
        if self.stop(bridge).await.is_some() {
            tracing::info!(%bridge, "bridge withdrawn and stopped");
        }
        let removed = self
            .change_cache(bridge, |cache, id| cache.remove(id))
            .await;
        if let Err(error) = removed {
            tracing::warn!(%bridge, %error, "cannot remove the cached configuration");
        }
    }

    /// Stops every bridge (the agent is shutting down); the cache is kept.
    pub async fn shutdown(mut self) {
        let ids: Vec<String> = self.running.keys().cloned().collect();
        for bridge in ids {
            self.stop(&bridge).await;
        }
    }

    fn insert(&mut self, bridge: &str, version: u64, yaml: String, valid: ValidConfig, b: Bridge) {
        self.running.insert(
            bridge.to_owned(),
            Running {
                version,
                yaml,
                valid,
                bridge: b,
            },
        );
        self.publish();
    }

    /// Shuts `bridge` down; returns what it ran.
    async fn stop(&mut self, bridge: &str) -> Option<(u64, String, ValidConfig)> {
        let running = self.running.remove(bridge)?;
        self.publish();
        tracing::info!(%bridge, version = running.version, grace = ?running.bridge.grace(), "stopping bridge");
        running.bridge.shutdown().await;
        Some((running.version, running.yaml, running.valid))
    }

    fn publish(&self) {
        let versions = self
            .running
            .iter()
            .map(|(id, r)| (id.clone(), r.version))
            .collect();
        self.versions.send_replace(versions);
        let handles = self
            .running
            .iter()
            .map(|(id, r)| {
                let delivery_modes = r
                    .valid
                    .config()
                    .routes
                    .iter()
                    .map(|route| (route.id.clone(), route.delivery_mode.as_str()))
                    .collect();
                let handle = BridgeHandle {
                    version: r.version,
                    redrive: r.bridge.redrive(),
                    delivery_modes,
                };
                (id.clone(), handle)
            })
            .collect();
        self.handles.send_replace(handles);
    }

    /// Creates (when missing) and locks the directories of `valid`'s SQLite
    /// stores not locked yet.
    fn lock_dirs(&mut self, valid: &ValidConfig) -> Result<(), datadir::LockError> {
        let missing: Vec<PathBuf> = datadir::sqlite_dirs(valid)?
            .into_iter()
            .filter(|dir| !self.locks.contains_key(dir))
            .collect();
        for dir in missing {
            let lock = datadir::lock(std::slice::from_ref(&dir), &self.deps.agent_id)?;
            tracing::debug!(dir = %dir.display(), "data directory locked");
            self.locks.insert(dir, lock);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::health::Readiness;
    use crate::metrics::Metrics;

    fn document(bridge: &str, dlq: &std::path::Path) -> String {
        format!(
            "bridge:\n  id: {bridge}\nsessions:\n  - id: conn\n    transport: mqtt\n    options:\n      session:\n        broker_url: tcp://127.0.0.1:9\n        client_id: {bridge}-client\nstores:\n  dlq:\n    type: sqlite\n    options:\n      path: {}\nreceivers:\n  - id: in\n    session_id: conn\n    topics:\n      - topic: \"in/#\"\n        qos: 1\nsenders:\n  - id: out\n    session_id: conn\nbindings:\n  - id: to-out\n    sender_id: out\n    address: out/topic\nroutes:\n  - id: main\n    receiver_id: in\n    delivery_mode: direct_hold\n    dispatch_mode: single\n    bindings: [to-out]\n",
            dlq.display()
        )
    }

    fn managed(dir: &std::path::Path) -> anyhow::Result<Bridges> {
        let data = dir.join("agent");
        std::fs::create_dir_all(&data)?;
        let data = data.canonicalize()?;
        let lock = datadir::lock(std::slice::from_ref(&data), "test")?;
        let deps = Deps {
            agent_id: "test".to_owned(),
            metrics: Arc::new(Metrics::new()),
            readiness: Readiness::default(),
            control_plane: None,
            client: ferry_shared::auth::client::ClientAuth::default(),
        };
        Ok(Bridges::new(deps, ConfigCache::open(&data)?, data, lock))
    }

    #[tokio::test]
    async fn a_refused_version_leaves_the_last_good_one_running_and_cached() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let mut bridges = managed(dir.path())?;
        let versions = bridges.versions();
        let good = document("a", &dir.path().join("dlq.db"));
        bridges.apply_version("a", 1, &good).await?;
        assert_eq!(bridges.version("a"), Some(1));

        // Invalid, for another bridge, and failing to start (a DLQ path that is a directory).
        let invalid = good.replace("bindings: [to-out]", "bindings: [nowhere]");
        let refused = bridges.apply_version("a", 2, &invalid).await;
        assert!(
            matches!(refused, Err(ApplyError::Invalid(_))),
            "{refused:?}"
        );
        let other = bridges
            .apply_version("a", 3, &document("b", &dir.path().join("b.db")))
            .await;
        assert!(
            matches!(other, Err(ApplyError::WrongBridge { .. })),
            "{other:?}"
        );
        let a_directory = dir.path().join("dlq-is-a-directory");
        std::fs::create_dir(&a_directory)?;
        let broken = document("a", &a_directory);
        let failed = bridges.apply_version("a", 4, &broken).await;
        assert!(matches!(failed, Err(ApplyError::Start(_))), "{failed:?}");
        assert_eq!(bridges.version("a"), Some(1));
        assert_eq!(versions.borrow().get("a"), Some(&1));

        // The cache holds the running version; a second agent starts from it.
        bridges.shutdown().await;
        let mut again = managed(dir.path())?;
        let unmet = again.deps.readiness.unmet();
        assert_eq!(unmet, vec!["cached configurations started".to_owned()]);
        again.start_cached().await;
        assert_eq!(again.version("a"), Some(1));
        // Only the session's own condition is left (its broker is not there).
        let unmet = again.deps.readiness.unmet();
        assert_eq!(unmet, vec!["session conn connected".to_owned()]);
        again.withdraw("a").await;
        assert_eq!(again.version("a"), None);
        assert!(again.cache.load()?.0.is_empty());
        again.shutdown().await;
        Ok(())
    }
}
