//! The RabbitMQ session: one connection, one channel in confirm mode, reconnects.
//!
//! A task owns the connection until the shutdown token fires:
//!
//! - it connects, opens a channel, puts it in confirm mode, hands it to the senders
//!   ([`Link`]) and only then publishes `true` on the connected watch;
//! - it watches the connection (its error events, and its status once a second); when the
//!   connection is lost it takes the channel away from the senders, publishes `false`, and
//!   connects again after an exponential backoff with jitter. Sends whose confirm was
//!   outstanding fail with a transient error (lapin fails their promises), so the caller
//!   retries: a duplicate is possible, a loss is not;
//! - when the broker closes only the channel (a publish to an exchange that does not exist
//!   closes it with 404), it opens a new channel on the same connection;
//! - on shutdown it closes the connection (bounded by a short grace).
//!
//! An outage is logged once, when it starts, and once when it ends.

use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use lapin::options::ConfirmSelectOptions;
use lapin::tcp::OwnedTLSConfig;
use lapin::uri::{AMQPUri, AMQPUserInfo};
use lapin::{Channel, Connection, ConnectionProperties, Event};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::confirms::{self, Awaiting};
use super::sender::RabbitmqSender;
use super::{RabbitmqError, RabbitmqSenderSettings, RabbitmqSettings};
use crate::transports::Session;
use crate::transports::backoff::Backoff;

/// A connection that lasted this long resets the reconnect backoff.
const STABLE_CONNECTION: Duration = Duration::from_secs(10);
/// How often the task looks at the connection and channel status (the error events come at
/// once; this catches a close that sent none).
const STATUS_CHECK: Duration = Duration::from_secs(1);
/// How long a shutdown waits for the connection to close.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// The channel the senders publish on, while there is one, and the confirm collector.
#[derive(Debug)]
pub(crate) struct Link {
    channel: Mutex<Option<Channel>>,
    /// Every publish's confirm goes to the session's collector (`confirms`), which decides it.
    pub confirms: mpsc::UnboundedSender<Awaiting>,
    /// Held while a publish is written, so delivery tags and frames go out in one order (the
    /// order of `send` calls).
    pub publishing: tokio::sync::Mutex<()>,
}

impl Link {
    /// A link without a channel, and its collector task (which ends when the last holder of
    /// the link is gone).
    fn new() -> Self {
        let (confirms, incoming) = mpsc::unbounded_channel();
        tokio::spawn(confirms::collect(incoming));
        Self {
            channel: Mutex::new(None),
            confirms,
            publishing: tokio::sync::Mutex::new(()),
        }
    }

    pub fn channel(&self) -> Option<Channel> {
        self.slot().clone()
    }

    fn set(&self, channel: Option<Channel>) {
        *self.slot() = channel;
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<Channel>> {
        self.channel.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One RabbitMQ connection, kept up until its shutdown token fires.
#[derive(Debug)]
pub struct RabbitmqSession {
    link: Arc<Link>,
    connected: watch::Receiver<bool>,
    reconnects: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl RabbitmqSession {
    /// Checks the settings and starts connecting in the background (watch
    /// [`Session::connected`]). Must be called inside a Tokio runtime.
    pub fn start(
        settings: RabbitmqSettings,
        shutdown: CancellationToken,
    ) -> Result<Self, RabbitmqError> {
        let target = Target::new(&settings)?;
        let link = Arc::new(Link::new());
        let (connected_tx, connected) = watch::channel(false);
        let reconnects = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(
            Supervisor {
                name: settings.name.clone(),
                target,
                link: Arc::clone(&link),
                connected: connected_tx,
                reconnects: Arc::clone(&reconnects),
                backoff: Backoff::new(settings.reconnect_initial, settings.reconnect_max),
            }
            .run(shutdown),
        );
        Ok(Self {
            link,
            connected,
            reconnects,
            task,
        })
    }

    /// Checks the settings without connecting.
    pub fn check(settings: &RabbitmqSettings) -> Result<(), RabbitmqError> {
        Target::new(settings).map(|_| ())
    }

    /// A sender on this session.
    pub fn sender(&self, settings: RabbitmqSenderSettings) -> RabbitmqSender {
        RabbitmqSender::new(Arc::clone(&self.link), settings, self.connected.clone())
    }

    /// Resolves once the task has closed the connection (after the token fired).
    pub async fn stopped(self) {
        if let Err(e) = self.task.await {
            tracing::warn!(error = %e, "the rabbitmq session task failed");
        }
    }
}

impl Session for RabbitmqSession {
    fn connected(&self) -> watch::Receiver<bool> {
        self.connected.clone()
    }

    fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::Relaxed)
    }
}

/// Where and how to connect.
struct Target {
    /// The URL as configured (no credentials), for logs.
    url: String,
    uri: AMQPUri,
    tls: Option<String>,
}

impl Target {
    fn new(s: &RabbitmqSettings) -> Result<Self, RabbitmqError> {
        let mut uri = AMQPUri::from_str(&s.url).map_err(|reason| RabbitmqError::Url {
            url: s.url.clone(),
            reason,
        })?;
        if let Some(username) = &s.username {
            uri.authority.userinfo = AMQPUserInfo {
                username: username.clone(),
                password: s
                    .password
                    .as_ref()
                    .map(|p| p.expose().to_owned())
                    .unwrap_or_default(),
            };
        }
        let tls = s
            .ca_file
            .as_ref()
            .map(|path| {
                std::fs::read_to_string(path).map_err(|e| RabbitmqError::CaFile {
                    path: path.clone(),
                    reason: e.to_string(),
                })
            })
            .transpose()?;
        Ok(Self {
            url: s.url.clone(),
            uri,
            tls,
        })
    }

    async fn connect(&self) -> Result<(Connection, Channel), lapin::Error> {
        ferry_shared::auth::tls::install_default_provider();
        let tls = OwnedTLSConfig {
            identity: None,
            cert_chain: self.tls.clone(),
        };
        let runtime = lapin::runtime::default_runtime()?;
        let connection = Connection::connect_uri_with_config(
            self.uri.clone(),
            ConnectionProperties::default(),
            tls,
            runtime,
        )
        .await?;
        match open_channel(&connection).await {
            Ok(channel) => Ok((connection, channel)),
            Err(e) => {
                connection.close(200, "no channel".into()).await.ok();
                Err(e)
            }
        }
    }
}

async fn open_channel(connection: &Connection) -> Result<Channel, lapin::Error> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

struct Supervisor {
    name: String,
    target: Target,
    link: Arc<Link>,
    connected: watch::Sender<bool>,
    reconnects: Arc<AtomicU64>,
    backoff: Backoff,
}

/// How a connection ended.
enum Ended {
    Shutdown,
    Lost(String),
}

impl Supervisor {
    async fn run(mut self, shutdown: CancellationToken) {
        let (session, url) = (self.name.clone(), self.target.url.clone());
        let mut ever_connected = false;
        let mut outage: Option<(Instant, u64)> = None;
        loop {
            let attempt = tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                attempt = self.target.connect() => attempt,
            };
            let lost = match attempt {
                Ok((connection, channel)) => {
                    if ever_connected {
                        self.reconnects.fetch_add(1, Ordering::Relaxed);
                    }
                    ever_connected = true;
                    match outage.take() {
                        Some((since, failed)) => {
                            tracing::info!(%session, %url, failed, down_for = ?since.elapsed(), "rabbitmq connected again")
                        }
                        None => tracing::info!(%session, %url, "rabbitmq connected"),
                    }
                    let up_at = Instant::now();
                    self.link.set(Some(channel.clone()));
                    self.connected.send_replace(true);
                    let ended = self.watch(&connection, channel, &shutdown).await;
                    self.link.set(None);
                    self.connected.send_replace(false);
                    match ended {
                        Ended::Shutdown => {
                            tokio::time::timeout(
                                CLOSE_GRACE,
                                connection.close(200, "shutdown".into()),
                            )
                            .await
                            .ok();
                            break;
                        }
                        Ended::Lost(reason) => {
                            if up_at.elapsed() >= STABLE_CONNECTION {
                                self.backoff.reset();
                            }
                            tracing::warn!(%session, %url, %reason, retry_max = ?self.backoff.max, "rabbitmq connection lost; reconnecting with backoff (logged again when connected)");
                            outage = Some((Instant::now(), 0));
                            drop(connection);
                            None
                        }
                    }
                }
                Err(error) => Some(error),
            };
            if let Some(error) = lost {
                match &mut outage {
                    Some((_, failed)) => {
                        *failed += 1;
                        tracing::debug!(%session, %error, "rabbitmq connection failed; retrying");
                    }
                    None => {
                        tracing::warn!(%session, %url, %error, retry_max = ?self.backoff.max, "cannot reach rabbitmq; retrying with backoff until it answers (logged again when connected)");
                        outage = Some((Instant::now(), 1));
                    }
                }
            }
            let delay = self.backoff.next_delay();
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(delay) => {}
            }
        }
        self.link.set(None);
        self.connected.send_replace(false);
    }

    /// Waits until the connection is lost or the token fires, reopening the channel when the
    /// broker closed only the channel.
    async fn watch(
        &self,
        connection: &Connection,
        mut channel: Channel,
        shutdown: &CancellationToken,
    ) -> Ended {
        let mut events = Box::pin(connection.events_listener());
        let mut tick = tokio::time::interval(STATUS_CHECK);
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return Ended::Shutdown,
                event = events.next() => match event {
                    Some(Event::Error(e)) => return Ended::Lost(e.to_string()),
                    Some(_) => {}
                    None => return Ended::Lost("the connection closed".into()),
                },
                _ = tick.tick() => {}
            }
            if !connection.status().connected() {
                return Ended::Lost("the connection closed".into());
            }
            if !channel.status().connected() {
                self.link.set(None);
                match open_channel(connection).await {
                    Ok(fresh) => {
                        tracing::info!(session = %self.name, "the broker closed the rabbitmq channel; opened a new one");
                        channel = fresh;
                        self.link.set(Some(channel.clone()));
                    }
                    Err(e) => return Ended::Lost(format!("cannot open a channel: {e}")),
                }
            }
        }
    }
}
