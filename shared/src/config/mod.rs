//! The bridge configuration: the YAML document, its loading and its validation.
//!
//! One document describes one bridge, in the shape of the reference bridge (see
//! `docs/configuration.md` for every key and default):
//!
//! - [`model`], [`transport`], [`store`], [`route`]: the document as serde types, unknown keys
//!   denied, defaults named (`default_*` functions);
//! - [`duration`]: durations written with units (`100ms`, `1s`, `15m`);
//! - [`secret`]: the secret fields (passwords), printed and shown as `***`;
//! - [`env`] and [`load`]: `${VAR}` / `${VAR:-default}` expansion on the raw text, then parsing
//!   with line and column on errors;
//! - [`validate()`]: the pure validator both halves run, returning every problem as
//!   `path: message`, or a [`ValidConfig`], the only form the rest of Ferry accepts.
//!
//! [`check_bytes`] and [`check_file`] do both steps, for the control plane (YAML bytes over
//! gRPC) and the agent (a file).

pub mod duration;
pub mod env;
pub mod load;
pub mod model;
pub mod route;
pub mod secret;
pub mod store;
pub mod transport;
mod valid;
pub mod validate;

use std::fmt;
use std::path::Path;

pub use duration::{Duration, DurationError};
pub use env::{Env, EnvError, ProcessEnv};
pub use load::{
    LoadError, MAX_CONFIG_BYTES, load_bytes, load_file, load_file_with_env, load_str, parse,
};
pub use model::{Bridge, BridgeConfig, Telemetry};
pub use route::{
    AckAfter, DeliveryMode, DispatchMode, DrainPoll, DrainStrategy, FailureAction, Policy,
    RetryBackoff, Route, RouteSession,
};
pub use secret::{MASK, Secret};
pub use store::{DlqStoreConfig, LeaseStoreConfig, OutboxStoreConfig, Stores};
pub use transport::{
    Binding, DEFAULT_PENDING_STATUS, DEFAULT_SENT_STATUS, GroupId, MqttSession, OnSent, OrderBy,
    ProtocolVersion, Receiver, Sender, Session, SqsSession, StateColumn, TableColumns,
    TableSession, Transport,
};
pub use valid::ValidConfig;
pub use validate::{ConfigError, validate};

/// Why a document was refused: it did not load, or it loaded and is invalid.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// Unreadable, too large, not UTF-8, an expansion error, or not YAML of the right shape.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// Loaded, but breaks these rules.
    #[error("{}", DisplayErrors(.0))]
    Invalid(Vec<ConfigError>),
}

impl CheckError {
    /// Every problem as one `path: message` (or load error) string each.
    pub fn messages(&self) -> Vec<String> {
        match self {
            CheckError::Load(e) => vec![e.to_string()],
            CheckError::Invalid(errors) => errors.iter().map(ToString::to_string).collect(),
        }
    }
}

struct DisplayErrors<'a>(&'a [ConfigError]);

impl fmt::Display for DisplayErrors<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

/// Loads YAML bytes (size-checked, `${VAR}` expanded from `env`) and validates them.
pub fn check_bytes(bytes: &[u8], env: &dyn Env) -> Result<ValidConfig, CheckError> {
    let config = load_bytes(bytes, env)?;
    validate(&config).map_err(CheckError::Invalid)
}

/// Loads a file (`${VAR}` expanded from `env`) and validates it.
pub fn check_file(path: &Path, env: &dyn Env) -> Result<ValidConfig, CheckError> {
    let config = load_file_with_env(path, env)?;
    validate(&config).map_err(CheckError::Invalid)
}
