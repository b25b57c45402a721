//! Redrive: a DLQ entry goes back on the binding that failed, and only
//! there (DESIGN §4.6). For a `shared_outbox` route that is a new outbox
//! record for that binding; for `direct_hold`, a direct send. The caller
//! deletes the entry only after this returned `Ok` (durable).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use tokio::sync::Notify;

use super::RouteBinding;
use super::shared_outbox::OutboxDepth;
use crate::metrics::Terminal;
use crate::stores::{DlqEntry, NewMessage, NewRecord, OutboxStore};
use crate::transports::{Address, Sender};

/// Where a route's redriven messages go.
pub(crate) enum Target {
    /// A new record in the route's partition.
    Outbox {
        partition: String,
        outbox: Arc<dyn OutboxStore>,
        bindings: HashMap<String, RouteBinding>,
        wake: Arc<Notify>,
        depth: Arc<OutboxDepth>,
    },
    /// A send on the route's one binding.
    Direct {
        binding: RouteBinding,
        sender: Arc<dyn Sender>,
    },
}

/// The redrive targets of one bridge, by route. The runtime replaces a
/// route's target when the route starts again and removes it when the route
/// stops (a live configuration change).
pub struct Redrive {
    bridge_id: String,
    targets: Mutex<HashMap<String, Arc<Target>>>,
}

impl std::fmt::Debug for Redrive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Redrive")
            .field("bridge_id", &self.bridge_id)
            .finish_non_exhaustive()
    }
}

impl Redrive {
    pub(crate) fn new(bridge_id: String) -> Self {
        Self {
            bridge_id,
            targets: Mutex::default(),
        }
    }

    /// Sets where `route`'s redriven messages go (`None`: the route is not
    /// running here).
    pub(crate) fn set_target(&self, route: &str, target: Option<Target>) {
        let mut targets = self.targets.lock().unwrap_or_else(PoisonError::into_inner);
        match target {
            Some(t) => targets.insert(route.to_owned(), Arc::new(t)),
            None => targets.remove(route),
        };
    }

    /// Puts `entry`'s envelope back on its binding; `Ok` once that is durable
    /// (appended to the outbox, or accepted by the destination).
    pub async fn redrive(&self, entry: &DlqEntry) -> Result<(), String> {
        if entry.bridge_id != self.bridge_id {
            return Err(format!(
                "entry of bridge {} (this agent runs {})",
                entry.bridge_id, self.bridge_id
            ));
        }
        let target = self
            .targets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&entry.route_id)
            .cloned()
            .ok_or_else(|| format!("route {} is not running here", entry.route_id))?;
        // The message is delivered afresh: its old expiry does not apply.
        let mut envelope = entry.envelope.clone();
        envelope.expires_at = None;
        match &*target {
            Target::Outbox {
                partition,
                outbox,
                bindings,
                wake,
                depth,
            } => {
                let binding = bindings.get(&entry.binding_id).ok_or_else(|| {
                    format!(
                        "binding {} is not on route {}",
                        entry.binding_id, entry.route_id
                    )
                })?;
                let record = NewRecord::new(binding.id.as_str(), binding.address.as_str());
                let message = NewMessage::new(envelope, SystemTime::now(), vec![record]);
                outbox
                    .append(partition, message)
                    .await
                    .map_err(|e| format!("outbox append: {e}"))?;
                binding.metrics.received(1);
                depth.add(1);
                wake.notify_one();
                Ok(())
            }
            Target::Direct { binding, sender } => {
                if binding.id != entry.binding_id {
                    return Err(format!(
                        "binding {} is not on route {}",
                        entry.binding_id, entry.route_id
                    ));
                }
                sender
                    .send(&envelope, &Address::new(binding.address.clone()))
                    .await
                    .map_err(|e| e.to_string())?;
                binding.metrics.received(1);
                binding.metrics.finished(Terminal::Sent, 1, None);
                Ok(())
            }
        }
    }
}
