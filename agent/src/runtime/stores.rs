//! Opening a bridge's stores: the outbox, the lease store and the DLQ, each
//! optional, each observed (errors counted, health in `/readyz`, one log line
//! per change of state: `stores::observed`).
//!
//! Every route of a bridge shares them, so a change to `stores` restarts the
//! whole bridge (ADR 0005).

use std::sync::Arc;
use std::time::Duration;

use ferry_shared::config::ValidConfig;

use super::{BuildError, Deps, settings};
use crate::stores::observed::{self, StoreObserver};
use crate::stores::{DlqStore, LeaseStore, OutboxStore};

/// The stores of one bridge.
#[derive(Clone)]
pub(crate) struct Stores {
    pub outbox: Option<Arc<dyn OutboxStore>>,
    pub leases: Option<Arc<dyn LeaseStore>>,
    pub dlq: Option<Arc<dyn DlqStore>>,
}

/// Opens the stores `valid` configures.
pub(crate) async fn open(valid: &ValidConfig, deps: &Deps) -> Result<Stores, BuildError> {
    let bridge_id = valid.bridge_id();
    let stale = valid
        .stale_claim_duration()
        .map_or(Duration::from_secs(300), |d| d.get());
    let observer =
        |store| StoreObserver::new(bridge_id, store, Arc::clone(&deps.metrics), &deps.readiness);
    let outbox = match &valid.stores.outbox {
        Some(c) => Some(observed::outbox(
            settings::outbox(c, stale).await?,
            observer("outbox"),
        )),
        None => None,
    };
    let leases = match &valid.stores.lease {
        Some(c) => Some(observed::lease(
            settings::lease(c, deps.control_plane.as_deref(), &deps.client).await?,
            observer("lease"),
        )),
        None => None,
    };
    let dlq = match &valid.stores.dlq {
        Some(c) => Some(observed::dlq(
            settings::dlq(c, deps.control_plane.as_deref(), &deps.client).await?,
            observer("dlq"),
        )),
        None => None,
    };
    Ok(Stores {
        outbox,
        leases,
        dlq,
    })
}

impl Stores {
    /// No store (while the stores of a bridge are replaced).
    pub fn none() -> Self {
        Stores {
            outbox: None,
            leases: None,
            dlq: None,
        }
    }
}
