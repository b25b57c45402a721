//! The MQTT session: one connection, its event loop task, reconnects.
//!
//! The task polls the event loop (`eventloop`) without pause until the
//! shutdown token fires. On a connection error it fails every outstanding
//! send, discards the requests still queued, forgets the receiver's unacknowledged deliveries (the
//! broker redelivers them), publishes `false` on the connected watch, and
//! reconnects after an exponential backoff with jitter. On CONNACK it publishes
//! `true`, and subscribes again when the broker kept no session.
//!
//! An outage is logged once, not once per attempt: a warning when the broker
//! cannot be reached (or the connection is lost), naming the session, the
//! broker URL and the error; again only if the error changes; and one line
//! when it connects, with how many attempts failed and for how long.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::eventloop::{self, EventLoop};
use super::protocol::{Client, Event};
use super::receiver::{MqttReceiver, ReceiverFeed};
use super::sender::{self, MqttSender, Outbound, SenderShared};
use super::settings::{
    MqttReceiverSettings, MqttSenderSettings, MqttSessionSettings, Protocol, SettingsError,
};
use crate::transports::backoff::Backoff;
use crate::transports::{SendError, Session};

/// A connection that lasted this long resets the reconnect backoff.
const STABLE_CONNECTION: Duration = Duration::from_secs(10);
/// How long a graceful shutdown waits for the DISCONNECT to be written.
const DISCONNECT_GRACE: Duration = Duration::from_secs(1);

/// One MQTT connection, kept up until its shutdown token fires.
#[derive(Debug)]
pub struct MqttSession {
    name: String,
    protocol: Protocol,
    client: Client,
    senders: Arc<SenderShared>,
    connected: watch::Receiver<bool>,
    reconnects: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl MqttSession {
    /// Starts a session that only sends. Settings are checked first; the
    /// connection is made in the background (watch [`MqttSession::connected`]).
    /// Must be called inside a Tokio runtime.
    pub fn start(
        settings: MqttSessionSettings,
        shutdown: CancellationToken,
    ) -> Result<Self, SettingsError> {
        Self::spawn(settings, None, shutdown).map(|(session, _)| session)
    }

    /// Starts a session with a receiver of `receiver`'s topic filters (manual
    /// acknowledgements, v5 receive maximum = `max_in_flight`). It can send too.
    pub fn start_with_receiver(
        settings: MqttSessionSettings,
        receiver: MqttReceiverSettings,
        shutdown: CancellationToken,
    ) -> Result<(Self, MqttReceiver), SettingsError> {
        let (session, receiver) = Self::spawn(settings, Some(receiver), shutdown)?;
        match receiver {
            Some(receiver) => Ok((session, receiver)),
            None => Err(SettingsError::Invalid(
                "the receiver was not created".into(),
            )),
        }
    }

    fn spawn(
        settings: MqttSessionSettings,
        receiver: Option<MqttReceiverSettings>,
        shutdown: CancellationToken,
    ) -> Result<(Self, Option<MqttReceiver>), SettingsError> {
        let endpoint = settings.validate()?;
        if let Some(receiver) = &receiver {
            receiver.validate(&settings)?;
        }
        let (client, eventloop) = eventloop::create(&settings, &endpoint, receiver.as_ref())?;
        let (feed, receiver) = match receiver {
            Some(r) => {
                let (feed, receiver) = ReceiverFeed::new(r, settings.name.clone(), client.clone());
                (Some(feed), Some(receiver))
            }
            None => (None, None),
        };
        let senders = Arc::new(SenderShared {
            outbound: std::sync::Mutex::new(Outbound::new(settings.max_packet_bytes as usize)),
            progress: Notify::new(),
            deadlines: Notify::new(),
        });
        let (connected_tx, connected) = watch::channel(false);
        let reconnects = Arc::new(AtomicU64::new(0));
        let task = EventTask {
            name: settings.name.clone(),
            broker: settings.broker_url.clone(),
            outage: None,
            max_packet: settings.max_packet_bytes as usize,
            client: client.clone(),
            eventloop,
            feed,
            senders: Arc::clone(&senders),
            connected: connected_tx,
            reconnects: Arc::clone(&reconnects),
            backoff: Backoff::new(settings.reconnect_initial, settings.reconnect_max),
            disconnect_sent: false,
            deadlines: tokio::spawn(enforce_deadlines(Arc::clone(&senders))),
        };
        tracing::info!(
            session = %settings.name,
            broker = %settings.broker_url,
            client_id = %settings.client_id,
            protocol = ?settings.protocol,
            "starting mqtt session"
        );
        let task = tokio::spawn(task.run(shutdown));
        let session = Self {
            name: settings.name,
            protocol: settings.protocol,
            client,
            senders,
            connected,
            reconnects,
            task,
        };
        Ok((session, receiver))
    }

    /// The session's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A sender publishing on this session.
    pub fn sender(&self, settings: MqttSenderSettings) -> MqttSender {
        MqttSender::new(
            Arc::clone(&self.senders),
            self.client.clone(),
            self.protocol,
            settings,
            self.connected.clone(),
        )
    }

    /// The connected state: `true` from CONNACK (and, for a receiver that had
    /// to subscribe, SUBACK) until the connection is lost.
    pub fn connected(&self) -> watch::Receiver<bool> {
        self.connected.clone()
    }

    /// How many times the session connected again after its first connection.
    pub fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::Relaxed)
    }

    /// Drops the current connection (a clean DISCONNECT, the session is kept)
    /// and connects again: the broker redelivers every unacknowledged message.
    pub fn reconnect(&self) {
        if self.client.try_disconnect().is_err() {
            tracing::warn!(session = %self.name, "cannot queue a disconnect");
        }
    }

    /// Waits until the session's task has ended (after its shutdown token
    /// fired): the DISCONNECT is sent and every pending send has failed.
    pub async fn stopped(self) {
        if let Err(error) = self.task.await {
            tracing::error!(session = %self.name, %error, "mqtt session task failed");
        }
    }
}

impl Session for MqttSession {
    fn connected(&self) -> watch::Receiver<bool> {
        MqttSession::connected(self)
    }

    fn reconnects(&self) -> u64 {
        MqttSession::reconnects(self)
    }
}

struct EventTask {
    name: String,
    /// The broker URL as configured, for the log lines of an outage.
    broker: String,
    /// Set from the first failed attempt (or lost connection) until CONNACK.
    outage: Option<Outage>,
    max_packet: usize,
    client: Client,
    eventloop: EventLoop,
    feed: Option<ReceiverFeed>,
    senders: Arc<SenderShared>,
    connected: watch::Sender<bool>,
    reconnects: Arc<AtomicU64>,
    backoff: Backoff,
    /// Our DISCONNECT was written on the current connection: its end is
    /// deliberate, not a lost connection.
    disconnect_sent: bool,
    /// [`enforce_deadlines`], ended once every waiter was answered at the
    /// session's stop.
    deadlines: JoinHandle<()>,
}

/// The session's one timer for its senders' deadlines, in a task of its own
/// (so that it never interrupts the event loop's `poll`, and answers sends
/// even while the event task shuts down): set for the earliest waiter's
/// deadline, it answers those past theirs ([`sender::Outbound::expire`]) and
/// is set again for the next, or left unset when none waits. A send whose
/// deadline became the earliest tells it (`SenderShared::deadlines`).
async fn enforce_deadlines(senders: Arc<SenderShared>) {
    let timer = tokio::time::sleep_until(Instant::now());
    tokio::pin!(timer);
    let mut set_for: Option<Instant> = None;
    let sooner = senders.deadlines.notified();
    tokio::pin!(sooner);
    loop {
        let earliest = tokio::select! {
            () = &mut timer, if set_for.is_some() => {
                set_for = None;
                sender::lock(&senders.outbound).expire(Instant::now())
            }
            () = &mut sooner => {
                sooner.set(senders.deadlines.notified());
                sender::lock(&senders.outbound).earliest()
            }
        };
        // Only ever sooner: a timer that fires early finds nothing past its
        // deadline and is set for the earliest left.
        if let Some(at) = earliest
            && set_for.is_none_or(|set| at < set)
        {
            timer.as_mut().reset(at);
            set_for = Some(at);
        }
    }
}

impl EventTask {
    async fn run(mut self, shutdown: CancellationToken) {
        let mut connected_at: Option<Instant> = None;
        let mut ever_connected = false;
        // Made once: a new one per event registers with the token and
        // unregisters again each time.
        let cancelled = shutdown.cancelled();
        tokio::pin!(cancelled);
        loop {
            let polled = tokio::select! {
                biased;
                () = &mut cancelled => break,
                polled = self.eventloop.poll() => polled,
            };
            match polled {
                Ok(first) => {
                    // Every event the loop has ready is handled before the
                    // acks are flushed and the senders woken, once: per
                    // event, that cost about as much as handling it.
                    let mut next = Some(first);
                    while let Some(event) = next {
                        if let Event::Connected { .. } = event {
                            if ever_connected {
                                self.reconnects.fetch_add(1, Ordering::Relaxed);
                            }
                            ever_connected = true;
                            connected_at = Some(Instant::now());
                            self.disconnect_sent = false;
                        }
                        self.handle(event);
                        next = self.eventloop.ready();
                    }
                    if let Some(feed) = &mut self.feed {
                        feed.flush();
                    }
                    self.senders.progress.notify_waiters();
                }
                Err(error) => {
                    let lasted = connected_at.take().map(|at| at.elapsed());
                    // Our own DISCONNECT (the receiver asking for redelivery,
                    // or `reconnect`) is not a lost connection.
                    let redeliver = self.feed.as_ref().and_then(|f| f.redelivery_requested());
                    let deliberate = std::mem::take(&mut self.disconnect_sent);
                    self.on_connection_lost(&format!("connection lost: {error}"));
                    if lasted.is_some_and(|d| d >= STABLE_CONNECTION) {
                        self.backoff.reset();
                    }
                    let delay = self.backoff.next_delay();
                    if let Some(unacknowledged) = redeliver {
                        tracing::info!(
                            session = %self.name,
                            unacknowledged,
                            ?delay,
                            "reconnecting so the broker redelivers {unacknowledged} unacknowledged messages"
                        );
                    } else if deliberate && lasted.is_some() {
                        tracing::info!(session = %self.name, ?delay, "reconnecting as requested");
                    } else {
                        self.connection_failed(error, lasted.is_some(), delay);
                    }
                    tokio::select! {
                        biased;
                        () = &mut cancelled => break,
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
        self.shut_down(connected_at.is_some()).await;
    }

    /// Logs a lost connection or a failed attempt once per outage (and again
    /// when the error changes); the other attempts at debug level.
    fn connection_failed(&mut self, error: String, was_connected: bool, delay: Duration) {
        let (session, broker, retry_max) = (&self.name, &self.broker, self.backoff.max);
        match &mut self.outage {
            Some(outage) if outage.error == error => {
                outage.failed += 1;
                tracing::debug!(%session, %error, ?delay, "mqtt connection failed; retrying");
            }
            Some(outage) => {
                outage.failed += 1;
                tracing::warn!(%session, %broker, %error, failed = outage.failed, "mqtt broker still unreachable, with another error; retrying");
                outage.error = error;
            }
            None => {
                if was_connected {
                    tracing::warn!(%session, %broker, %error, ?retry_max, "mqtt connection lost; reconnecting with backoff (logged again when connected)");
                } else {
                    tracing::warn!(%session, %broker, %error, ?retry_max, "cannot reach the mqtt broker; retrying with backoff until it answers (logged again when connected)");
                }
                self.outage = Some(Outage {
                    since: Instant::now(),
                    failed: u64::from(!was_connected),
                    error,
                });
            }
        }
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Connected {
                session_present,
                max_packet_size,
            } => {
                // A receiver that had to subscribe is connected once subscribed.
                let subscribing = match &mut self.feed {
                    Some(feed) => feed.on_connected(session_present),
                    None => false,
                };
                sender::lock(&self.senders.outbound).on_connected(self.max_packet, max_packet_size);
                if !subscribing {
                    self.connected.send_replace(true);
                }
                match self.outage.take() {
                    Some(outage) => tracing::info!(
                        session = %self.name,
                        broker = %self.broker,
                        session_present,
                        failed_attempts = outage.failed,
                        unreachable_for = ?outage.since.elapsed(),
                        "mqtt connected"
                    ),
                    None => {
                        tracing::info!(session = %self.name, broker = %self.broker, session_present, "mqtt connected")
                    }
                }
            }
            Event::Publish(received) => match &mut self.feed {
                Some(feed) => feed.on_publish(received),
                None => tracing::warn!(
                    session = %self.name,
                    topic = %String::from_utf8_lossy(&received.topic),
                    "a publish arrived on a session without a receiver; ignored"
                ),
            },
            Event::Acked { pkid, refused } => {
                sender::lock(&self.senders.outbound).on_acked(pkid, refused);
            }
            Event::PublishWritten(pkid) => {
                sender::lock(&self.senders.outbound).on_written(pkid);
            }
            Event::PublishFailed(error) => {
                sender::lock(&self.senders.outbound).on_failed(error);
            }
            Event::Subscribed { refused } => {
                self.connected.send_replace(true);
                if refused.is_empty() {
                    tracing::info!(session = %self.name, "subscribed");
                } else {
                    tracing::error!(session = %self.name, ?refused, "the broker refused subscriptions");
                }
            }
            Event::DisconnectSent => self.disconnect_sent = true,
        }
    }

    /// The connection is gone (the event loop already dropped it). Order matters:
    /// first the receiver's acks become stale, then — under the senders' lock,
    /// so no send slips in between — the leftover requests are discarded and
    /// every waiter fails.
    fn on_connection_lost(&mut self, why: &str) {
        if let Some(feed) = &mut self.feed {
            feed.on_disconnected();
        }
        {
            let mut outbound = sender::lock(&self.senders.outbound);
            self.eventloop.discard_unsent();
            outbound.fail_all(&SendError::Transient(why.to_owned()));
        }
        self.connected.send_replace(false);
        self.senders.progress.notify_waiters();
    }

    async fn shut_down(mut self, connected: bool) {
        if connected && self.client.try_disconnect().is_ok() {
            // Unacknowledged deliveries stay with the broker's session.
            let written = tokio::time::timeout(DISCONNECT_GRACE, async {
                loop {
                    match self.eventloop.poll().await {
                        Ok(Event::DisconnectSent) | Err(_) => break,
                        Ok(_) => {}
                    }
                }
            })
            .await;
            if written.is_err() {
                tracing::warn!(session = %self.name, "the disconnect was not written in time");
            }
        }
        if let Some(feed) = &mut self.feed {
            feed.on_disconnected();
        }
        sender::lock(&self.senders.outbound).stop();
        // Every waiter is answered and no send can wait any more.
        self.deadlines.abort();
        self.connected.send_replace(false);
        self.senders.progress.notify_waiters();
        tracing::info!(session = %self.name, "mqtt session stopped");
    }
}

/// A broker outage as the log tells it: since when, how many attempts failed,
/// and the error last logged.
#[derive(Debug)]
struct Outage {
    since: Instant,
    failed: u64,
    error: String,
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;
    use rumqttc::v5::mqttbytes::v5::{Packet, PubAck};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;
    use crate::transports::Address;
    use crate::transports::mqtt::eventloop::test_connack;
    use crate::transports::mqtt::protocol::REQUEST_QUEUE;

    /// A broker that accepts one connection, answers its CONNECT and then
    /// reads everything and acknowledges nothing.
    async fn silent_broker() -> u16 {
        fake_broker(None, false).await
    }

    /// A broker that accepts one connection and answers its CONNECT, with
    /// `receive_max` if any; then it acknowledges every QoS 1 publish if
    /// `ack`, or else reads everything and acknowledges nothing.
    async fn fake_broker(receive_max: Option<u16>, ack: bool) -> u16 {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let port = listener.local_addr().expect("bound").port();
        tokio::spawn(async move {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            let mut buf = [0u8; 4096];
            let _ = socket.read(&mut buf).await;
            let mut out = prost::bytes::BytesMut::new();
            let connack = test_connack(receive_max, None);
            connack.write(&mut out, None).expect("encodable");
            let _ = socket.write_all(&out).await;
            let mut read = prost::bytes::BytesMut::new();
            while socket.read_buf(&mut read).await.is_ok_and(|n| n > 0) {
                if !ack {
                    read.clear();
                    continue;
                }
                out.clear();
                loop {
                    match Packet::read(&mut read, None) {
                        Ok(Packet::Publish(publish)) => {
                            let puback = Packet::PubAck(PubAck::new(publish.pkid, None));
                            puback.write(&mut out, None).expect("encodable");
                        }
                        Ok(_) => {}
                        // The rest of the packet is still to come.
                        Err(rumqttc::v5::mqttbytes::Error::InsufficientBytes(_)) => break,
                        Err(e) => panic!("the fake broker cannot read a packet: {e}"),
                    }
                }
                if socket.write_all(&out).await.is_err() {
                    return;
                }
            }
        });
        port
    }

    /// A session connected to [`silent_broker`], and the token that stops it.
    async fn connected_to_a_silent_broker() -> (MqttSession, CancellationToken) {
        connected_to(silent_broker().await).await
    }

    /// A session connected to the broker on `port`, and the token that
    /// stops it.
    async fn connected_to(port: u16) -> (MqttSession, CancellationToken) {
        let shutdown = CancellationToken::new();
        let settings = MqttSessionSettings::new("t", format!("tcp://127.0.0.1:{port}"), "c-t");
        let session = MqttSession::start(settings, shutdown.clone()).expect("started");
        let mut connected = session.connected();
        tokio::time::timeout(Duration::from_secs(10), connected.wait_for(|c| *c))
            .await
            .expect("connected in time")
            .expect("session alive");
        (session, shutdown)
    }

    /// A send that is never acknowledged fails with a timeout at its
    /// deadline, through the session's one timer, and so does the next one
    /// after the session had no send waiting (the timer is set again).
    #[tokio::test]
    async fn an_unacknowledged_send_times_out_at_its_deadline() {
        let (session, shutdown) = connected_to_a_silent_broker().await;
        let timeout = Duration::from_millis(300);
        let sender = session.sender(MqttSenderSettings {
            send_timeout: timeout,
            ..MqttSenderSettings::default()
        });
        let envelope = crate::stores::conformance::envelope("a");
        let address = Address::new(Arc::from("t/a"));
        for _ in 0..2 {
            let started = Instant::now();
            let outcome =
                tokio::time::timeout(Duration::from_secs(10), sender.send(&envelope, &address))
                    .await
                    .expect("answered");
            let took = started.elapsed();
            assert!(
                matches!(outcome, Err(SendError::Timeout(t)) if t == timeout),
                "{outcome:?}"
            );
            assert!(took >= timeout && took < Duration::from_secs(3), "{took:?}");
        }
        shutdown.cancel();
        session.stopped().await;
    }

    /// A send with a shorter timeout than the one already waiting times out
    /// at its own deadline (the timer is set sooner), and the waiting one is
    /// answered when the session stops.
    #[tokio::test]
    async fn a_shorter_deadline_than_the_one_waiting_is_kept() {
        let (session, shutdown) = connected_to_a_silent_broker().await;
        let sender = |timeout| {
            session.sender(MqttSenderSettings {
                send_timeout: timeout,
                ..MqttSenderSettings::default()
            })
        };
        let (slow, quick) = (
            sender(Duration::from_secs(60)),
            sender(Duration::from_millis(300)),
        );
        let envelope = crate::stores::conformance::envelope("a");
        let address = Address::new(Arc::from("t/a"));
        let waiting = slow.send(&envelope, &address);
        tokio::pin!(waiting);
        // The slow send queues its waiter (and sets the timer for a minute).
        assert!(
            tokio::time::timeout(Duration::from_millis(100), &mut waiting)
                .await
                .is_err()
        );
        let started = Instant::now();
        let outcome =
            tokio::time::timeout(Duration::from_secs(10), quick.send(&envelope, &address))
                .await
                .expect("answered before the slow one's deadline");
        assert!(matches!(outcome, Err(SendError::Timeout(_))), "{outcome:?}");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
        shutdown.cancel();
        let outcome = tokio::time::timeout(Duration::from_secs(10), &mut waiting)
            .await
            .expect("answered at the stop");
        assert!(
            matches!(outcome, Err(SendError::Transient(_))),
            "{outcome:?}"
        );
        session.stopped().await;
    }

    /// Sends past the request queue's capacity wait for the loop's progress
    /// and are all sent: a broker that takes one publish at a time holds
    /// back all but one, so most of them find the queue full at first, and
    /// wait again and again. (On two workers, so that the event loop runs
    /// beside the sends: a wake-up lost between a send's failed try and its
    /// registration would leave it waiting until its timeout. That race can
    /// only be made likely, not certain.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sends_that_find_the_request_queue_full_wait_and_are_sent() {
        let (session, shutdown) = connected_to(fake_broker(Some(1), true).await).await;
        let sender = session.sender(MqttSenderSettings::default());
        let envelope = crate::stores::conformance::envelope("a");
        let address = Address::new(Arc::from("t/a"));
        let sends: futures::stream::FuturesUnordered<_> = (0..REQUEST_QUEUE + 200)
            .map(|_| sender.send(&envelope, &address))
            .collect();
        let outcomes: Vec<_> = tokio::time::timeout(Duration::from_secs(20), sends.collect())
            .await
            .expect("every send answered");
        assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
        shutdown.cancel();
        session.stopped().await;
    }
}
