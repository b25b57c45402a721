//! The validator: a pure function from a parsed [`BridgeConfig`] to a [`ValidConfig`], or to
//! every problem found, each as `path: message`.
//!
//! It does no I/O (no file is opened, no host resolved), so the control plane and the agent run
//! the same checks; the agent checks what needs I/O when it applies a configuration. Each rule
//! lives with the part of the document it is about: [`ids`] (identities and references),
//! [`transport`] (sessions, receivers, senders, bindings), [`store`], [`route`]; [`syntax`]
//! holds the URL, topic and queue-name checks they share.

mod ids;
mod route;
mod store;
mod syntax;
mod transport;

#[cfg(test)]
mod tests;

use std::fmt;

use super::duration::Duration;
use super::model::BridgeConfig;
use super::valid::ValidConfig;

/// One problem in a configuration: where (`routes[0].bindings[2]`) and what.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ConfigError {
    /// The key the problem is about, e.g. `routes[0].policy.ack_after`.
    pub path: String,
    /// What is wrong, lowercase, without trailing punctuation.
    pub message: String,
}

/// Checks every rule of `config` and returns it as a [`ValidConfig`], or every problem found.
pub fn validate(config: &BridgeConfig) -> Result<ValidConfig, Vec<ConfigError>> {
    let mut v = Validator::new(config);
    v.telemetry();
    v.stores();
    v.sessions();
    v.receivers();
    v.senders();
    v.bindings();
    v.routes();
    if v.errors.is_empty() {
        Ok(ValidConfig::new(config.clone()))
    } else {
        Err(v.errors)
    }
}

/// Walks the document, collecting errors.
struct Validator<'a> {
    config: &'a BridgeConfig,
    index: ids::Index<'a>,
    errors: Vec<ConfigError>,
}

impl<'a> Validator<'a> {
    fn new(config: &'a BridgeConfig) -> Self {
        let mut errors = Vec::new();
        let index = ids::Index::build(config, &mut |path, message| {
            errors.push(ConfigError { path, message });
        });
        Validator {
            config,
            index,
            errors,
        }
    }

    fn error(&mut self, path: impl Into<String>, message: impl fmt::Display) {
        self.errors.push(ConfigError {
            path: path.into(),
            message: message.to_string(),
        });
    }

    /// Every duration the rules require to be greater than zero.
    fn positive(&mut self, path: impl Into<String>, d: Duration) {
        if d.is_zero() {
            self.error(path, "must be greater than zero");
        }
    }

    /// A multiplier: finite and at least 1.
    fn multiplier(&mut self, path: impl Into<String>, m: f64) {
        if !m.is_finite() || m < 1.0 {
            self.error(path, format!("multiplier must be at least 1.0, got {m}"));
        }
    }

    fn telemetry(&mut self) {
        let t = &self.config.telemetry;
        if let Some(endpoint) = &t.otlp_endpoint
            && let Err(e) = syntax::http_url(endpoint)
        {
            self.error("telemetry.otlp_endpoint", e);
        }
        if t.service_name.trim().is_empty() {
            self.error("telemetry.service_name", "must not be empty");
        }
        if !(0.0..=1.0).contains(&t.sampling_ratio) {
            self.error(
                "telemetry.sampling_ratio",
                format!("must be between 0.0 and 1.0, got {}", t.sampling_ratio),
            );
        }
        if t.resource_attributes.keys().any(|k| k.trim().is_empty()) {
            self.error(
                "telemetry.resource_attributes",
                "an attribute name must not be empty",
            );
        }
    }
}
