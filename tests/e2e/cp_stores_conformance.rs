//! The agent's lease and DLQ conformance suites against the `control_plane` store backends,
//! over gRPC to a control plane started in-process on a free loopback port (its state in
//! SQLite in a temporary directory).
//!
//! The suites pass fixed times (`t(15)`); the control plane decides lease times itself, so
//! each store shares a test clock with its server and sets it to the suite's `now` before
//! every lease call. `reopen` opens a new client on the same server: the control plane keeps
//! the state, so the backend is durable.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use ferry_agent::stores::conformance::{Guard, Harness};
use ferry_agent::stores::control_plane::{ControlPlaneDlqStore, ControlPlaneLeaseStore};
use ferry_agent::stores::{
    Acquired, BoxFuture, DlqEntry, DlqFilter, DlqPage, DlqStats, DlqStore, Lease, LeaseState,
    LeaseStore, PageRequest, StoreResult,
};
use ferry_control_plane::server::ControlPlane;
use ferry_control_plane::services::{Clock, Options};
use ferry_control_plane::state::open_state_store;
use ferry_shared::auth::client::ClientAuth;
use ferry_shared::config::store::ControlPlaneOptions;
use tokio_util::sync::{CancellationToken, DropGuard};

/// The time the control plane reads, set by the test.
type TestClock = Arc<Mutex<SystemTime>>;

/// A `control_plane` store, its endpoint and the clock of its server.
struct Remote<S> {
    store: S,
    options: ControlPlaneOptions,
    clock: TestClock,
}

impl<S> Remote<S> {
    fn set_clock(&self, now: SystemTime) {
        *self.clock.lock().unwrap_or_else(PoisonError::into_inner) = now;
    }
}

/// Stops the server (and removes its state) at the end of a test.
struct Server {
    _stop: DropGuard,
    _dir: tempfile::TempDir,
}

/// A control plane on a free loopback port; its endpoint, clock and guard.
async fn control_plane() -> (ControlPlaneOptions, TestClock, Guard) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let url = format!("sqlite://{}/state.db", dir.path().display());
    let state = open_state_store(&url).await.expect("state store");
    let clock: TestClock = Arc::new(Mutex::new(SystemTime::now()));
    let read = clock.clone();
    let options = Options {
        clock: Clock::from_fn(move || *read.lock().unwrap_or_else(PoisonError::into_inner)),
        ..Options::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    let stop = CancellationToken::new();
    let stopped = stop.clone().cancelled_owned();
    tokio::spawn(async move {
        if let Err(error) = ControlPlane::new(state, options)
            .serve(listener, stopped)
            .await
        {
            panic!("control plane stopped: {error}");
        }
    });
    let endpoint = ControlPlaneOptions {
        endpoint: Some(format!("http://{addr}")),
    };
    let guard = Server {
        _stop: stop.drop_guard(),
        _dir: dir,
    };
    (endpoint, clock, Box::new(guard))
}

async fn control_plane_lease() -> (Remote<ControlPlaneLeaseStore>, Guard) {
    let (options, clock, guard) = control_plane().await;
    let store =
        ControlPlaneLeaseStore::open(&options, &ClientAuth::default()).expect("open lease store");
    let remote = Remote {
        store,
        options,
        clock,
    };
    (remote, guard)
}

async fn control_plane_dlq() -> (Remote<ControlPlaneDlqStore>, Guard) {
    let (options, clock, guard) = control_plane().await;
    let store =
        ControlPlaneDlqStore::open(&options, &ClientAuth::default()).expect("open dlq store");
    let remote = Remote {
        store,
        options,
        clock,
    };
    (remote, guard)
}

impl Harness for Remote<ControlPlaneLeaseStore> {
    const DURABLE: bool = true;
    fn reopen(self) -> BoxFuture<'static, Self> {
        Box::pin(async move {
            let store = ControlPlaneLeaseStore::open(&self.options, &ClientAuth::default())
                .expect("reopen lease store");
            Remote { store, ..self }
        })
    }
}

impl Harness for Remote<ControlPlaneDlqStore> {
    const DURABLE: bool = true;
    fn reopen(self) -> BoxFuture<'static, Self> {
        Box::pin(async move {
            let store = ControlPlaneDlqStore::open(&self.options, &ClientAuth::default())
                .expect("reopen dlq store");
            Remote { store, ..self }
        })
    }
}

impl LeaseStore for Remote<ControlPlaneLeaseStore> {
    fn acquire<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        ttl: Duration,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Acquired>> {
        self.set_clock(now);
        self.store.acquire(key, holder, ttl, now)
    }

    fn renew<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
        ttl: Duration,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Lease>> {
        self.set_clock(now);
        self.store.renew(key, holder, version, ttl, now)
    }

    fn release<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
    ) -> BoxFuture<'a, StoreResult<()>> {
        self.store.release(key, holder, version)
    }

    fn list(&self) -> BoxFuture<'_, StoreResult<Vec<LeaseState>>> {
        self.store.list()
    }
}

impl DlqStore for Remote<ControlPlaneDlqStore> {
    fn put(&self, entry: DlqEntry) -> BoxFuture<'_, StoreResult<bool>> {
        self.store.put(entry)
    }

    fn list<'a>(
        &'a self,
        filter: &'a DlqFilter,
        page: PageRequest,
    ) -> BoxFuture<'a, StoreResult<DlqPage>> {
        self.store.list(filter, page)
    }

    fn get<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<DlqEntry>> {
        self.store.get(id)
    }

    fn delete<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<()>> {
        self.store.delete(id)
    }

    fn purge<'a>(&'a self, filter: &'a DlqFilter) -> BoxFuture<'a, StoreResult<u64>> {
        self.store.purge(filter)
    }

    fn stats<'a>(&'a self, filter: &'a DlqFilter) -> BoxFuture<'a, StoreResult<DlqStats>> {
        self.store.stats(filter)
    }
}

ferry_agent::lease_conformance!(control_plane_lease, control_plane_lease);
ferry_agent::dlq_conformance!(control_plane_dlq, control_plane_dlq);
