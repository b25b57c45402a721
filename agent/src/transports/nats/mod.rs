//! NATS JetStream transport (`async-nats`): sessions and senders. Ferry only sends to NATS;
//! a session carries no receiver.
//!
//! - [`NatsSession`] owns one client. async-nats connects in the background and reconnects
//!   by itself (with its own backoff); its connection events drive the connected watch and
//!   the reconnect count.
//! - [`NatsSender`] publishes to the subject the binding address names and resolves on the
//!   stream's publish acknowledgement; see `sender`.

mod sender;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_nats::{Client, ConnectOptions, Event};
use ferry_shared::config::Secret;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use sender::NatsSender;

use crate::transports::Session;

/// How long a shutdown waits for the client to flush and close.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// How a NATS session authenticates (at most one).
#[derive(Clone, Debug, Default)]
pub enum NatsAuth {
    /// No credentials.
    #[default]
    None,
    /// A `.creds` file (user JWT and NKey seed).
    CredentialsFile(PathBuf),
    /// A token.
    Token(Secret),
    /// User name and password.
    UserPassword(String, Secret),
}

/// A NATS session's settings.
#[derive(Clone, Debug, Default)]
pub struct NatsSettings {
    /// The session id, for logs and the client name.
    pub name: String,
    /// `nats://host[:port]` or `tls://host[:port]`.
    pub url: String,
    /// Authentication.
    pub auth: NatsAuth,
    /// PEM CA certificates to trust for TLS.
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate and key for mutual TLS.
    pub client_cert: Option<(PathBuf, PathBuf)>,
}

/// A NATS sender's settings.
#[derive(Clone, Copy, Debug)]
pub struct NatsSenderSettings {
    /// The longest a send waits for its publish acknowledgement.
    pub send_timeout: Duration,
}

/// Why a NATS session cannot start.
#[derive(Debug, thiserror::Error)]
pub enum NatsError {
    /// The credentials file cannot be read or parsed.
    #[error("credentials_file {path}: {reason}")]
    Credentials {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

/// One NATS client, kept until its shutdown token fires.
#[derive(Debug)]
pub struct NatsSession {
    client: Arc<OnceLock<Client>>,
    connected: watch::Receiver<bool>,
    reconnects: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl NatsSession {
    /// Checks the settings and starts connecting in the background (watch
    /// [`Session::connected`]). Must be called inside a Tokio runtime.
    pub fn start(settings: NatsSettings, shutdown: CancellationToken) -> Result<Self, NatsError> {
        let (connected_tx, connected) = watch::channel(false);
        let reconnects = Arc::new(AtomicU64::new(0));
        let options = options(&settings, connected_tx, Arc::clone(&reconnects))?;
        let client = Arc::new(OnceLock::new());
        let slot = Arc::clone(&client);
        let (name, url) = (settings.name, settings.url);
        let task = tokio::spawn(async move {
            ferry_shared::auth::tls::install_default_provider();
            // With `retry_on_initial_connect` this returns at once and connects in the
            // background; it fails only on a URL it cannot parse.
            let nats = match options.connect(url.as_str()).await {
                Ok(c) => c,
                Err(e) => {
                    tracing::error!(session = %name, %url, error = %e, "cannot start the nats client");
                    return;
                }
            };
            slot.set(nats.clone()).ok();
            shutdown.cancelled().await;
            if tokio::time::timeout(CLOSE_GRACE, nats.drain())
                .await
                .is_err()
            {
                tracing::debug!(session = %name, "the nats client did not drain in time");
            }
        });
        Ok(Self {
            client,
            connected,
            reconnects,
            task,
        })
    }

    /// Checks the settings without connecting.
    pub fn check(settings: &NatsSettings) -> Result<(), NatsError> {
        options(settings, watch::channel(false).0, Arc::default()).map(|_| ())
    }

    /// A sender on this session.
    pub fn sender(&self, settings: NatsSenderSettings) -> NatsSender {
        NatsSender::new(Arc::clone(&self.client), settings, self.connected.clone())
    }

    /// Resolves once the client has drained (after the token fired).
    pub async fn stopped(self) {
        if let Err(e) = self.task.await {
            tracing::warn!(error = %e, "the nats session task failed");
        }
    }
}

impl Session for NatsSession {
    fn connected(&self) -> watch::Receiver<bool> {
        self.connected.clone()
    }

    fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::Relaxed)
    }
}

/// The client options: authentication, TLS, background connects, and the events that drive
/// the connected watch.
fn options(
    s: &NatsSettings,
    connected: watch::Sender<bool>,
    reconnects: Arc<AtomicU64>,
) -> Result<ConnectOptions, NatsError> {
    let mut options = match &s.auth {
        NatsAuth::None => ConnectOptions::new(),
        NatsAuth::CredentialsFile(path) => {
            let credentials = |reason: String| NatsError::Credentials {
                path: path.clone(),
                reason,
            };
            let text = std::fs::read_to_string(path).map_err(|e| credentials(e.to_string()))?;
            ConnectOptions::with_credentials(&text).map_err(|e| credentials(e.to_string()))?
        }
        NatsAuth::Token(token) => ConnectOptions::with_token(token.expose().to_owned()),
        NatsAuth::UserPassword(user, password) => {
            ConnectOptions::with_user_and_password(user.clone(), password.expose().to_owned())
        }
    };
    if let Some(ca) = &s.ca_file {
        options = options.add_root_certificates(ca.clone());
    }
    if let Some((cert, key)) = &s.client_cert {
        options = options.add_client_certificate(cert.clone(), key.clone());
    }
    let name = s.name.clone();
    let ever = Arc::new(AtomicBool::new(false));
    Ok(options
        .name(format!("ferry-{}", s.name))
        .retry_on_initial_connect()
        .event_callback(move |event| {
            let (connected, reconnects, ever, name) = (
                connected.clone(),
                Arc::clone(&reconnects),
                Arc::clone(&ever),
                name.clone(),
            );
            async move {
                match event {
                    Event::Connected => {
                        if ever.swap(true, Ordering::Relaxed) {
                            reconnects.fetch_add(1, Ordering::Relaxed);
                            tracing::info!(session = %name, "nats connected again");
                        } else {
                            tracing::info!(session = %name, "nats connected");
                        }
                        connected.send_replace(true);
                    }
                    Event::Disconnected | Event::Closed => {
                        tracing::warn!(session = %name, "nats connection lost; the client reconnects with backoff");
                        connected.send_replace(false);
                    }
                    other => tracing::debug!(session = %name, event = %other, "nats event"),
                }
            }
        }))
}
