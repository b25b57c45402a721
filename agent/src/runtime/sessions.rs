//! Starting sessions, whatever their transport: [`start`] is the one place
//! that maps a session's configuration to a started [`RunningSession`] and
//! the receiver it carries. A transport is a folder under `transports/` plus
//! one arm in [`start`]; routes and drainers only see the transport-neutral
//! [`Sender`] and [`Receiver`] traits.
//!
//! Each started session is kept with its own cancellation token and a watcher
//! ([`SessionEntry`]), so one session can be stopped and started again
//! without touching the others.

use std::sync::Arc;
use std::time::Duration;

use ferry_shared::config::transport::Transport;
use ferry_shared::config::{
    Receiver as ReceiverConfig, Route, Sender as SenderConfig, Session as SessionConfig,
};
use futures::future::BoxFuture;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{BuildError, Deps, settings};
use crate::transports::aws::AwsSession;
use crate::transports::mqtt::{MqttSenderSettings, MqttSession, SettingsError};
use crate::transports::nats::{NatsSenderSettings, NatsSession};
use crate::transports::outbox_table::TableSession;
use crate::transports::rabbitmq::{RabbitmqSenderSettings, RabbitmqSession};
use crate::transports::{Address, Receiver, SendError, SendFuture, Sender, Session};

/// A started session of any transport.
pub(crate) trait RunningSession: Session {
    /// A sender on this session with `sender`'s options; `send_timeout` is
    /// the route's.
    fn sender(&self, sender: &SenderConfig, send_timeout: Duration) -> Arc<dyn Sender>;

    /// Resolves once the session has stopped (after its token fired).
    fn stopped(self: Box<Self>) -> BoxFuture<'static, ()>;
}

/// A session just started, with the receiver it carries (if it feeds a
/// route).
pub(crate) struct Started {
    pub session: Box<dyn RunningSession>,
    pub receiver: Option<Box<dyn Receiver>>,
}

/// Checks what [`start`] would refuse without starting anything: the
/// transport, the settings, one receiver per session.
pub(crate) fn check(
    session: &SessionConfig,
    feed: &[(&ReceiverConfig, &Route)],
) -> Result<(), BuildError> {
    one_receiver(session, feed)?;
    match session.transport {
        Transport::Mqtt => {
            let s = settings::mqtt_session(session, feed.first().map(|(_, r)| *r))?;
            let refused =
                |e: SettingsError| BuildError::Session(format!("session {}: {e}", session.id));
            s.validate().map_err(refused)?;
            if let Some((r, route)) = feed.first() {
                settings::mqtt_receiver(r, route)
                    .validate(&s)
                    .map_err(refused)?;
            }
            Ok(())
        }
        Transport::Sqs | Transport::Sns => {
            settings::aws_session(session)?;
            Ok(())
        }
        Transport::Rabbitmq => {
            sends_only(session, feed)?;
            RabbitmqSession::check(&settings::rabbitmq_session(session)?)
                .map_err(|e| refused(session, e))
        }
        Transport::Nats => {
            sends_only(session, feed)?;
            NatsSession::check(&settings::nats_session(session)?).map_err(|e| refused(session, e))
        }
        Transport::PostgresTable | Transport::MysqlTable => {
            table_receiver(session, feed).map(|_| ())
        }
    }
}

/// Starts `session`, with a receiver for the route it feeds (at most one),
/// until `token` fires.
pub(crate) fn start(
    session: &SessionConfig,
    feed: &[(&ReceiverConfig, &Route)],
    token: CancellationToken,
) -> Result<Started, BuildError> {
    one_receiver(session, feed)?;
    match session.transport {
        Transport::Mqtt => start_mqtt(session, feed.first().copied(), token),
        Transport::Sqs | Transport::Sns => start_aws(session, feed.first().copied(), token),
        Transport::Rabbitmq => {
            sends_only(session, feed)?;
            let s = settings::rabbitmq_session(session)?;
            Ok(Started {
                session: Box::new(
                    RabbitmqSession::start(s, token).map_err(|e| refused(session, e))?,
                ),
                receiver: None,
            })
        }
        Transport::Nats => {
            sends_only(session, feed)?;
            let s = settings::nats_session(session)?;
            Ok(Started {
                session: Box::new(NatsSession::start(s, token).map_err(|e| refused(session, e))?),
                receiver: None,
            })
        }
        Transport::PostgresTable | Transport::MysqlTable => {
            let (session, receiver) = TableSession::start(table_receiver(session, feed)?, token);
            Ok(Started {
                session: Box::new(session),
                receiver: Some(Box::new(receiver)),
            })
        }
    }
}

/// An outbox-table session exists for its receiver.
fn table_receiver(
    session: &SessionConfig,
    feed: &[(&ReceiverConfig, &Route)],
) -> Result<crate::transports::outbox_table::TableSettings, BuildError> {
    match feed.first() {
        Some((r, _)) => settings::outbox_table(session, r),
        None => Err(BuildError::Unsupported(format!(
            "session {}: a {} session needs the receiver of a route",
            session.id, session.transport
        ))),
    }
}

fn refused(session: &SessionConfig, e: impl std::fmt::Display) -> BuildError {
    BuildError::Session(format!("session {}: {e}", session.id))
}

/// Ferry sends to RabbitMQ and NATS but does not receive from them.
fn sends_only(
    session: &SessionConfig,
    feed: &[(&ReceiverConfig, &Route)],
) -> Result<(), BuildError> {
    match feed.first() {
        Some((r, _)) => Err(BuildError::Unsupported(format!(
            "session {}: receiver {} cannot receive from {}; Ferry only sends there",
            session.id, r.id, session.transport
        ))),
        None => Ok(()),
    }
}

fn one_receiver(
    session: &SessionConfig,
    feed: &[(&ReceiverConfig, &Route)],
) -> Result<(), BuildError> {
    if feed.len() > 1 {
        return Err(BuildError::Unsupported(format!(
            "session {}: a session carries one receiver; give receivers {} sessions of their own",
            session.id,
            feed.iter()
                .map(|(r, _)| r.id.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok(())
}

fn start_mqtt(
    session: &SessionConfig,
    feed: Option<(&ReceiverConfig, &Route)>,
    token: CancellationToken,
) -> Result<Started, BuildError> {
    let s = settings::mqtt_session(session, feed.map(|(_, route)| route))?;
    let refused = |e: SettingsError| BuildError::Session(format!("session {}: {e}", session.id));
    Ok(match feed {
        Some((r, route)) => {
            let (m, rx) =
                MqttSession::start_with_receiver(s, settings::mqtt_receiver(r, route), token)
                    .map_err(refused)?;
            Started {
                session: Box::new(m),
                receiver: Some(Box::new(rx)),
            }
        }
        None => Started {
            session: Box::new(MqttSession::start(s, token).map_err(refused)?),
            receiver: None,
        },
    })
}

impl RunningSession for MqttSession {
    fn sender(&self, sender: &SenderConfig, send_timeout: Duration) -> Arc<dyn Sender> {
        Arc::new(MqttSession::sender(
            self,
            MqttSenderSettings {
                qos: settings::qos(sender.options.sender.qos()),
                retain: sender.options.sender.retain(),
                send_timeout,
            },
        ))
    }

    fn stopped(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(MqttSession::stopped(*self))
    }
}

fn start_aws(
    session: &SessionConfig,
    feed: Option<(&ReceiverConfig, &Route)>,
    token: CancellationToken,
) -> Result<Started, BuildError> {
    let s = settings::aws_session(session)?;
    let aws = AwsSession::start(s, token);
    let receiver = match feed {
        Some((r, route)) => {
            let rx = aws.receiver(settings::sqs_receiver(session, r, route)?);
            Some(Box::new(rx) as Box<dyn Receiver>)
        }
        None => None,
    };
    Ok(Started {
        session: Box::new(aws),
        receiver,
    })
}

impl RunningSession for AwsSession {
    fn sender(&self, sender: &SenderConfig, send_timeout: Duration) -> Arc<dyn Sender> {
        Arc::new(AwsSession::sender(
            self,
            settings::aws_sender(sender, send_timeout),
        ))
    }

    fn stopped(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(AwsSession::stopped(*self))
    }
}

impl RunningSession for RabbitmqSession {
    fn sender(&self, sender: &SenderConfig, send_timeout: Duration) -> Arc<dyn Sender> {
        Arc::new(RabbitmqSession::sender(
            self,
            RabbitmqSenderSettings {
                mandatory: sender.options.sender.mandatory(),
                send_timeout,
            },
        ))
    }

    fn stopped(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(RabbitmqSession::stopped(*self))
    }
}

impl RunningSession for NatsSession {
    fn sender(&self, _sender: &SenderConfig, send_timeout: Duration) -> Arc<dyn Sender> {
        Arc::new(NatsSession::sender(
            self,
            NatsSenderSettings { send_timeout },
        ))
    }

    fn stopped(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(NatsSession::stopped(*self))
    }
}

impl RunningSession for TableSession {
    /// The validator refuses senders on an outbox-table session; one that gets here anyway
    /// refuses every message.
    fn sender(&self, _sender: &SenderConfig, _send_timeout: Duration) -> Arc<dyn Sender> {
        Arc::new(ReceiveOnly(self.connected()))
    }

    fn stopped(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(TableSession::stopped(*self))
    }
}

/// The sender of a session Ferry only receives from.
struct ReceiveOnly(tokio::sync::watch::Receiver<bool>);

impl Sender for ReceiveOnly {
    fn send<'a>(
        &'a self,
        _: &'a ferry_shared::envelope::Envelope,
        _: &'a Address,
    ) -> SendFuture<'a> {
        Box::pin(async {
            Err(SendError::Permanent(
                "Ferry does not send to an outbox-table session".into(),
            ))
        })
    }

    fn connected(&self) -> tokio::sync::watch::Receiver<bool> {
        self.0.clone()
    }
}

/// One running session: the session, its token, its watcher.
pub(crate) struct SessionEntry {
    pub session: Box<dyn RunningSession>,
    token: CancellationToken,
    watcher: JoinHandle<()>,
}

impl SessionEntry {
    /// Keeps `session` (started with `token`) and watches its connected
    /// state for readiness and the session gauges. `restarted`: this bridge
    /// ran the session before, so its first connection counts as a
    /// reconnect (a restart is visible in `ferry_session_reconnects_total`).
    pub fn watch(
        id: &str,
        session: Box<dyn RunningSession>,
        token: CancellationToken,
        deps: &Deps,
        bridge_id: &str,
        restarted: bool,
    ) -> Self {
        let condition = deps.readiness.condition(format!("session {id} connected"));
        let gauge = deps.metrics.session(bridge_id, id);
        let mut connected = session.connected();
        let stop = token.clone();
        let watcher = tokio::spawn(async move {
            let mut ever = restarted;
            loop {
                let up = *connected.borrow_and_update();
                condition.set(up);
                gauge.set_connected(up, up && ever);
                ever |= up;
                tokio::select! {
                    () = stop.cancelled() => break,
                    changed = connected.changed() => if changed.is_err() { break },
                }
            }
        });
        Self {
            session,
            token,
            watcher,
        }
    }

    /// Disconnects and waits for the session and its watcher to end.
    pub async fn stop(self, bound: Duration) {
        self.token.cancel();
        self.session.stopped().await;
        super::join_all("watcher", vec![self.watcher], bound).await;
    }
}
