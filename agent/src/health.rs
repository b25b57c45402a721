//! Readiness: named conditions the agent must meet to be ready (`/readyz`).
//!
//! A neutral module, so that the runtime, the drainer and the stores can
//! report readiness without importing the admin listener (which serves it).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

/// Named readiness conditions ("session mqtt-conn connected", "lease of
/// route sensor-ingest resolved"). The agent is ready when every registered
/// condition holds.
#[derive(Clone, Debug, Default)]
pub struct Readiness {
    conditions: Arc<Mutex<BTreeMap<String, bool>>>,
}

impl Readiness {
    /// Registers `name` (initially not met) and returns its handle. The
    /// condition is removed when the handle is dropped, so a route or session
    /// that stops does not keep the agent unready.
    pub fn condition(&self, name: impl Into<String>) -> ReadinessCondition {
        let name = name.into();
        self.lock().insert(name.clone(), false);
        ReadinessCondition {
            readiness: self.clone(),
            name,
        }
    }

    /// The names of every condition not met, in order.
    pub fn unmet(&self) -> Vec<String> {
        self.lock()
            .iter()
            .filter(|(_, met)| !**met)
            .map(|(name, _)| name.clone())
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, bool>> {
        self.conditions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// One readiness condition; see [`Readiness::condition`].
#[derive(Debug)]
pub struct ReadinessCondition {
    readiness: Readiness,
    name: String,
}

impl ReadinessCondition {
    /// Marks the condition met or not.
    pub fn set(&self, met: bool) {
        if let Some(value) = self.readiness.lock().get_mut(&self.name) {
            *value = met;
        }
    }
}

impl Drop for ReadinessCondition {
    fn drop(&mut self) {
        self.readiness.lock().remove(&self.name);
    }
}
