//! Readiness: named conditions the agent must meet to be ready (`/readyz`).
//!
//! A neutral module, so that the runtime, the drainer and the stores can
//! report readiness without importing the admin listener (which serves it).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

/// Named readiness conditions ("session mqtt-conn connected", "lease of
/// route sensor-ingest resolved"). The agent is ready when every registered
/// condition holds. A condition not met may say why ("store dlq" with
/// "full: sqlite: database or disk is full").
#[derive(Clone, Debug, Default)]
pub struct Readiness {
    conditions: Arc<Mutex<BTreeMap<String, Condition>>>,
}

#[derive(Debug, Default)]
struct Condition {
    met: bool,
    /// Why it is not met, when known.
    why: Option<String>,
}

impl Readiness {
    /// Registers `name` (initially not met) and returns its handle. The
    /// condition is removed when the handle is dropped, so a route or session
    /// that stops does not keep the agent unready.
    pub fn condition(&self, name: impl Into<String>) -> ReadinessCondition {
        let name = name.into();
        self.lock().insert(name.clone(), Condition::default());
        ReadinessCondition {
            readiness: self.clone(),
            name,
        }
    }

    /// Every condition not met, in order: its name, followed by `: why`
    /// when it said why.
    pub fn unmet(&self) -> Vec<String> {
        self.lock()
            .iter()
            .filter(|(_, c)| !c.met)
            .map(|(name, c)| match &c.why {
                Some(why) => format!("{name}: {why}"),
                None => name.clone(),
            })
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Condition>> {
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
    /// Marks the condition met or not (without a reason).
    pub fn set(&self, met: bool) {
        if let Some(c) = self.readiness.lock().get_mut(&self.name) {
            c.met = met;
            c.why = None;
        }
    }

    /// Marks the condition not met because of `why`.
    pub fn fail(&self, why: impl Into<String>) {
        if let Some(c) = self.readiness.lock().get_mut(&self.name) {
            c.met = false;
            c.why = Some(why.into());
        }
    }
}

impl Drop for ReadinessCondition {
    fn drop(&mut self) {
        self.readiness.lock().remove(&self.name);
    }
}
