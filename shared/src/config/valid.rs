//! [`ValidConfig`]: a configuration that passed [`super::validate`], with lookups and resolved
//! defaults. Only the validator builds one, so nothing in Ferry runs an unvalidated
//! configuration.

use std::ops::Deref;

use super::duration::Duration;
use super::model::BridgeConfig;
use super::route::Route;
use super::transport::{Binding, Receiver, Sender, Session};

/// A configuration that passed validation. Derefs to the [`BridgeConfig`] it wraps.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidConfig {
    config: BridgeConfig,
}

impl ValidConfig {
    /// Only the validator calls this.
    pub(super) fn new(config: BridgeConfig) -> Self {
        ValidConfig { config }
    }

    /// The validated document.
    pub fn config(&self) -> &BridgeConfig {
        &self.config
    }

    /// The validated document, by value.
    pub fn into_inner(self) -> BridgeConfig {
        self.config
    }

    /// `bridge.id`.
    pub fn bridge_id(&self) -> &str {
        &self.config.bridge.id
    }

    /// The session with this id.
    pub fn session(&self, id: &str) -> Option<&Session> {
        self.config.sessions.iter().find(|s| s.id == id)
    }

    /// The receiver with this id.
    pub fn receiver(&self, id: &str) -> Option<&Receiver> {
        self.config.receivers.iter().find(|r| r.id == id)
    }

    /// The sender with this id.
    pub fn sender(&self, id: &str) -> Option<&Sender> {
        self.config.senders.iter().find(|s| s.id == id)
    }

    /// The binding with this id.
    pub fn binding(&self, id: &str) -> Option<&Binding> {
        self.config.bindings.iter().find(|b| b.id == id)
    }

    /// The route with this id.
    pub fn route(&self, id: &str) -> Option<&Route> {
        self.config.routes.iter().find(|r| r.id == id)
    }

    /// A route's bindings, in the route's order (every id resolves in a valid configuration).
    pub fn route_bindings<'a>(&'a self, route: &'a Route) -> impl Iterator<Item = &'a Binding> {
        route.bindings.iter().filter_map(|id| self.binding(id))
    }

    /// The partition key of a route: `{bridge}/{route}`.
    pub fn partition(&self, route: &Route) -> String {
        format!("{}/{}", self.config.bridge.id, route.id)
    }

    /// The outbox's `stale_claim_duration` with its default, when there is a durable outbox.
    pub fn stale_claim_duration(&self) -> Option<Duration> {
        self.config
            .stores
            .outbox
            .as_ref()
            .and_then(|o| o.stale_claim_duration())
    }
}

impl Deref for ValidConfig {
    type Target = BridgeConfig;

    fn deref(&self) -> &BridgeConfig {
        &self.config
    }
}
