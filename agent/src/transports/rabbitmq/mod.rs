//! RabbitMQ transport (AMQP 0-9-1 on `lapin`): sessions and senders. Ferry only sends to
//! RabbitMQ; a session carries no receiver.
//!
//! - [`RabbitmqSession`] keeps one connection with one channel in confirm mode, reconnects
//!   with backoff, opens a new channel when the broker closed the old one, and publishes its
//!   connected state; see `session`.
//! - [`RabbitmqSender`] publishes to `EXCHANGE/ROUTING_KEY` (the binding address, see
//!   [`ferry_shared::address::amqp_address`]) and resolves on the broker's confirm; see
//!   `sender` for what each outcome means; `confirms` matches confirms and returned messages
//!   to their sends.
//! - `properties` maps the envelope to AMQP basic properties.

mod confirms;
mod properties;
mod sender;
mod session;

use std::path::PathBuf;
use std::time::Duration;

use ferry_shared::config::Secret;

pub use sender::RabbitmqSender;
pub use session::RabbitmqSession;

/// A RabbitMQ session's settings.
#[derive(Clone, Debug)]
pub struct RabbitmqSettings {
    /// The session id, for logs.
    pub name: String,
    /// `amqp://host[:port][/vhost]` or `amqps://…`, without credentials.
    pub url: String,
    /// User name (the broker's `guest` when unset).
    pub username: Option<String>,
    /// Password.
    pub password: Option<Secret>,
    /// PEM CA certificates to trust for `amqps://` (default: the platform's roots).
    pub ca_file: Option<PathBuf>,
    /// First reconnect delay.
    pub reconnect_initial: Duration,
    /// Longest reconnect delay.
    pub reconnect_max: Duration,
}

impl RabbitmqSettings {
    /// Settings with the default reconnect delays (100 ms doubling up to 10 s).
    pub fn new(name: impl Into<String>, url: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            url: url.into(),
            username: None,
            password: None,
            ca_file: None,
            reconnect_initial: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(10),
        }
    }
}

/// A RabbitMQ sender's settings.
#[derive(Clone, Copy, Debug)]
pub struct RabbitmqSenderSettings {
    /// Publish with `mandatory`: an unroutable message comes back and fails permanently.
    pub mandatory: bool,
    /// The longest a send waits for its confirm.
    pub send_timeout: Duration,
}

/// Why a RabbitMQ session cannot start.
#[derive(Debug, thiserror::Error)]
pub enum RabbitmqError {
    /// The URL does not parse.
    #[error("invalid rabbitmq url {url:?}: {reason}")]
    Url {
        /// The URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// The CA file cannot be read.
    #[error("cannot read ca_file {path}: {reason}")]
    CaFile {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}
