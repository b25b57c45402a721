//! The MQTT receiver: deliveries out, PUBACKs back in receive order.
//!
//! Invariants:
//!
//! - **A PUBACK goes out only after its delivery is settled with an outcome
//!   that acknowledges, and only once every earlier QoS 1/2 delivery of the
//!   same connection has been acknowledged** (MQTT requires acks in the order
//!   the PUBLISHes arrived). The [`AckQueue`] holds the packet ids of one
//!   connection in receive order; a settle marks one entry, and the settled
//!   prefix is released to the request queue.
//! - **A delivery settled without acknowledgement stops acknowledging on its
//!   connection**: acknowledging later ones would be out of order, so they stay
//!   unacknowledged too and come back with it. Once every delivery of that
//!   connection is settled the receiver drops the connection; the broker then
//!   redelivers everything unacknowledged on the next one (persistent session).
//!   Later deliveries that were settled with an acknowledging outcome are
//!   therefore received twice — the at-least-once duplicate, never a loss.
//! - **A settle handle belongs to its connection.** After a reconnect the queue
//!   starts a new generation; a handle of the previous one is a no-op (its
//!   message is redelivered).
//! - **Nothing blocks the event loop.** Deliveries go into a bounded channel
//!   with `try_send`; the broker's receive window (v5 receive maximum =
//!   `max_in_flight`, a sixteenth of the channel's capacity) should keep it
//!   from filling. It does not always: v3.1.1 has no receive maximum, and
//!   Mosquitto 2.0.11 sends every queued message for the client as soon as
//!   one PUBACK arrives, far past the window. A delivery that finds the channel
//!   full therefore waits in an overflow queue behind it (receive order is
//!   kept: while the overflow is not empty, every delivery goes there, and
//!   [`MqttReceiver::recv`] takes from the overflow only when the channel is
//!   empty). Leaving it unacknowledged instead would block acknowledging on
//!   the connection and force a reconnect, on which the broker resends
//!   everything unacknowledged — a burst that overflows again: a reconnect
//!   storm with thousands of duplicates. Only past [`OVERFLOW_LIMIT`] (more
//!   than a broker can have unacknowledged, packet ids being 16-bit) is a
//!   QoS 1/2 message left unacknowledged as above and a QoS 0 message dropped
//!   (at most once).
//! - **The rest of a burst waits in the broker, as far as it can.** While
//!   the overflow holds more than one receive window the receiver holds the
//!   event loop's reads ([`Client::hold_reads`]); it releases them when the
//!   overflow is down to one window, so the loop reads on while the route
//!   takes that window, and when the receiver is dropped. Hold and release
//!   happen under the overflow's lock, so a held loop always has an overflow
//!   to wait for. The loop still reads while it awaits an answer of its own
//!   (`eventloop`), and what it reads then joins the overflow.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use tokio::sync::mpsc;

use super::properties::envelope_from;
use super::protocol::{Client, Received};
use super::settings::{MqttReceiverSettings, Qos};
use crate::transports::{Delivery, Outcome, Receiver, RecvFuture, SettleHandle};

/// The delivery channel holds this many receive windows.
const CHANNEL_SLACK: usize = 16;

/// Most deliveries waiting behind a full delivery channel. A broker cannot
/// have more QoS 1/2 messages unacknowledged on one connection than there are
/// packet ids.
pub(crate) const OVERFLOW_LIMIT: usize = u16::MAX as usize;

/// Deliveries that arrived while the channel was full, in receive order; all
/// of them were received after everything in the channel.
type Overflow = Arc<Mutex<VecDeque<Delivery>>>;

fn lock_overflow(overflow: &Mutex<VecDeque<Delivery>>) -> MutexGuard<'_, VecDeque<Delivery>> {
    overflow
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Receives the deliveries of one session's subscriptions.
#[derive(Debug)]
pub struct MqttReceiver {
    deliveries: mpsc::Receiver<Delivery>,
    overflow: Overflow,
    /// To release the event loop's reads once the overflow is down to
    /// `window` deliveries.
    client: Client,
    window: usize,
}

impl MqttReceiver {
    /// The next delivery in receive order; `None` once the session stopped.
    /// Cancel-safe.
    pub async fn recv(&mut self) -> Option<Delivery> {
        {
            // Under the overflow's lock the feed cannot add to the channel
            // while the overflow is not empty: the channel's deliveries come
            // first, then the overflow's.
            let mut overflow = lock_overflow(&self.overflow);
            if !overflow.is_empty() {
                return match self.deliveries.try_recv() {
                    Ok(delivery) => Some(delivery),
                    Err(_) => {
                        let delivery = overflow.pop_front();
                        if overflow.len() <= self.window {
                            self.client.hold_reads(false);
                        }
                        delivery
                    }
                };
            }
        }
        self.deliveries.recv().await
    }
}

impl Drop for MqttReceiver {
    /// Nobody takes from the overflow any more: reads must not wait for it.
    /// The channel is closed first, so that the feed (which checks it under
    /// the overflow's lock) holds them no more.
    fn drop(&mut self) {
        self.deliveries.close();
        let _overflow = lock_overflow(&self.overflow);
        self.client.hold_reads(false);
    }
}

impl Receiver for MqttReceiver {
    fn recv(&mut self) -> RecvFuture<'_> {
        Box::pin(MqttReceiver::recv(self))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Waiting,
    Ack,
    Hold,
}

#[derive(Debug)]
struct Entry {
    pkid: u16,
    qos: Qos,
    state: State,
}

/// Identifies one entry of one connection's queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ticket {
    generation: u64,
    seq: u64,
}

/// The QoS 1/2 deliveries of the current connection, in receive order.
#[derive(Debug, Default)]
pub(crate) struct AckQueue {
    generation: u64,
    /// Sequence number of `entries.front()`.
    front_seq: u64,
    entries: VecDeque<Entry>,
    /// A delivery was settled without acknowledgement on this connection.
    blocked: bool,
    reconnect_requested: bool,
    /// Released acks the request queue has not taken yet, in order.
    ready: VecDeque<(u16, Qos)>,
}

impl AckQueue {
    /// A new connection: everything of the previous one is forgotten (it is
    /// redelivered by the broker).
    pub fn new_connection(&mut self) {
        self.generation += 1;
        self.front_seq = 0;
        self.entries.clear();
        self.blocked = false;
        self.reconnect_requested = false;
        self.ready.clear();
    }

    pub fn push(&mut self, pkid: u16, qos: Qos) -> Ticket {
        let seq = self.front_seq + self.entries.len() as u64;
        self.entries.push_back(Entry {
            pkid,
            qos,
            state: State::Waiting,
        });
        Ticket {
            generation: self.generation,
            seq,
        }
    }

    /// Records a settle; releases the acknowledgeable prefix into `ready`.
    pub fn settle(&mut self, ticket: Ticket, acknowledge: bool) {
        if ticket.generation != self.generation {
            return;
        }
        let Some(index) = ticket
            .seq
            .checked_sub(self.front_seq)
            .and_then(|i| usize::try_from(i).ok())
        else {
            return;
        };
        let Some(entry) = self.entries.get_mut(index) else {
            return;
        };
        if entry.state != State::Waiting {
            return;
        }
        entry.state = if acknowledge { State::Ack } else { State::Hold };
        while !self.blocked {
            match self.entries.front().map(|e| e.state) {
                Some(State::Ack) => {
                    if let Some(e) = self.entries.pop_front() {
                        self.ready.push_back((e.pkid, e.qos));
                        self.front_seq += 1;
                    }
                }
                Some(State::Hold) => self.blocked = true,
                Some(State::Waiting) | None => break,
            }
        }
    }

    /// Hands the released acks to the request queue, in order, as far as it takes
    /// them; the rest wait for the next flush.
    pub fn flush(&mut self, client: &Client) {
        while let Some(&(pkid, qos)) = self.ready.front() {
            if client.try_ack(pkid, qos).is_err() {
                break;
            }
            self.ready.pop_front();
        }
    }

    /// True once per connection, when acknowledging is blocked and every
    /// delivery of the connection is settled: time to reconnect so the broker
    /// redelivers.
    pub fn take_reconnect_request(&mut self) -> bool {
        if self.blocked
            && !self.reconnect_requested
            && self.entries.iter().all(|e| e.state != State::Waiting)
        {
            self.reconnect_requested = true;
            return true;
        }
        false
    }

    #[cfg(test)]
    fn ready(&self) -> Vec<u16> {
        self.ready.iter().map(|(p, _)| *p).collect()
    }
}

fn lock(acks: &Mutex<AckQueue>) -> MutexGuard<'_, AckQueue> {
    // The queue stays consistent between statements; a panic elsewhere while
    // holding the lock does not make it unusable.
    acks.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The session task's side of a receiver.
pub(crate) struct ReceiverFeed {
    settings: MqttReceiverSettings,
    session_id: String,
    client: Client,
    acks: Arc<Mutex<AckQueue>>,
    tx: mpsc::Sender<Delivery>,
    overflow: Overflow,
    /// The overflow was used on the current connection (logged once each).
    overflowed: bool,
}

impl ReceiverFeed {
    pub fn new(
        settings: MqttReceiverSettings,
        session_id: String,
        client: Client,
    ) -> (Self, MqttReceiver) {
        // Room beyond the receive window: Mosquitto 2.0.11 sends well past it
        // under a burst; what does not fit waits in the overflow.
        let capacity = usize::from(settings.max_in_flight).saturating_mul(CHANNEL_SLACK);
        let (tx, rx) = mpsc::channel(capacity);
        let overflow = Overflow::default();
        let receiver = MqttReceiver {
            deliveries: rx,
            overflow: Arc::clone(&overflow),
            client: client.clone(),
            window: usize::from(settings.max_in_flight),
        };
        let feed = Self {
            settings,
            session_id,
            client,
            acks: Arc::new(Mutex::new(AckQueue::default())),
            tx,
            overflow,
            overflowed: false,
        };
        (feed, receiver)
    }

    /// A CONNACK: a new generation; subscribes when the broker has no session
    /// (first connection, or the session expired). True when a SUBSCRIBE was
    /// queued.
    pub fn on_connected(&mut self, session_present: bool) -> bool {
        lock(&self.acks).new_connection();
        self.overflowed = false;
        if session_present {
            return false;
        }
        {
            if self.client.try_subscribe(&self.settings.filters).is_err() {
                tracing::error!(
                    session = %self.session_id,
                    "cannot queue the subscription; reconnecting"
                );
                // Best effort: if even this does not fit, the next reconnect
                // (keep-alive, error) subscribes again.
                self.client.try_disconnect().ok();
                false
            } else {
                tracing::debug!(session = %self.session_id, filters = ?self.settings.filters, "subscribing");
                true
            }
        }
    }

    /// When this connection is being closed on purpose so that the broker
    /// redelivers what was left unacknowledged: how many deliveries that is.
    pub fn redelivery_requested(&self) -> Option<usize> {
        let acks = lock(&self.acks);
        acks.reconnect_requested.then_some(acks.entries.len())
    }

    /// The connection is gone: settles of its deliveries become no-ops.
    pub fn on_disconnected(&mut self) {
        lock(&self.acks).new_connection();
    }

    pub fn on_publish(&mut self, received: Received) {
        let qos = received.qos;
        let pkid = received.pkid;
        let redelivered = received.dup;
        let (envelope, defect) = envelope_from(
            received,
            &self.session_id,
            self.settings.max_payload_bytes,
            self.settings.trust_message_id,
            SystemTime::now(),
        );
        let settle = if qos == Qos::AtMostOnce {
            SettleHandle::noop()
        } else {
            let ticket = lock(&self.acks).push(pkid, qos);
            let acks = Arc::clone(&self.acks);
            let client = self.client.clone();
            SettleHandle::new(move |outcome: Outcome| {
                if !outcome.acknowledges() {
                    tracing::debug!(pkid, ?outcome, "delivery settled without acknowledgement");
                }
                let mut queue = lock(&acks);
                queue.settle(ticket, outcome.acknowledges());
                queue.flush(&client);
                if queue.take_reconnect_request() {
                    // The session logs the reconnect, with how many wait.
                    tracing::debug!(
                        "a delivery was left unacknowledged; reconnecting so the broker redelivers"
                    );
                    client.try_disconnect().ok();
                }
            })
        };
        let delivery = Delivery {
            envelope,
            defect,
            redelivered,
            source_retries: false,
            settle,
        };
        self.deliver(delivery, qos);
    }

    /// Into the channel, or behind it into the overflow when the channel is
    /// full or the overflow not empty (receive order).
    fn deliver(&mut self, delivery: Delivery, qos: Qos) {
        let mut overflow = lock_overflow(&self.overflow);
        // Under the lock: a receiver being dropped closes the channel, then
        // releases the reads under it.
        if self.tx.is_closed() {
            drop(overflow);
            delivery.settle.settle(Outcome::Shutdown);
            return;
        }
        let delivery = if overflow.is_empty() {
            match self.tx.try_send(delivery) {
                Ok(()) => return,
                Err(mpsc::error::TrySendError::Full(delivery)) => delivery,
                Err(mpsc::error::TrySendError::Closed(delivery)) => {
                    drop(overflow);
                    delivery.settle.settle(Outcome::Shutdown);
                    return;
                }
            }
        } else {
            delivery
        };
        if overflow.len() < OVERFLOW_LIMIT {
            if !self.overflowed {
                self.overflowed = true;
                tracing::info!(
                    session = %self.session_id,
                    max_in_flight = self.settings.max_in_flight,
                    unacknowledged = lock(&self.acks).entries.len(),
                    "the broker sent past the receive window; deliveries wait behind the full delivery channel"
                );
            }
            overflow.push_back(delivery);
            if overflow.len() > usize::from(self.settings.max_in_flight) {
                self.client.hold_reads(true);
            }
            return;
        }
        drop(overflow);
        tracing::warn!(
            session = %self.session_id,
            unacknowledged = lock(&self.acks).entries.len(),
            id = %delivery.envelope.id,
            ?qos,
            "delivery channel and overflow full (the broker ignored the receive window); \
             leaving the message unacknowledged"
        );
        delivery.settle.settle(Outcome::BackPressure);
    }

    /// Hands released acks to the request queue (called after each event: it may
    /// have room again).
    pub fn flush(&mut self) {
        let mut queue = lock(&self.acks);
        queue.flush(&self.client);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acks_leave_in_receive_order() {
        let mut q = AckQueue::default();
        q.new_connection();
        let a = q.push(1, Qos::AtLeastOnce);
        let b = q.push(2, Qos::AtLeastOnce);
        let c = q.push(3, Qos::AtLeastOnce);
        q.settle(c, true);
        q.settle(b, true);
        assert!(q.ready().is_empty(), "nothing before the first is settled");
        q.settle(a, true);
        assert_eq!(q.ready(), [1, 2, 3]);
    }

    #[test]
    fn an_unacknowledged_delivery_blocks_later_acks_and_asks_for_a_reconnect() {
        let mut q = AckQueue::default();
        q.new_connection();
        let a = q.push(1, Qos::AtLeastOnce);
        let b = q.push(2, Qos::AtLeastOnce);
        let c = q.push(3, Qos::AtLeastOnce);
        q.settle(a, true);
        q.settle(b, false);
        assert!(!q.take_reconnect_request(), "c is still being processed");
        q.settle(c, true);
        assert_eq!(q.ready(), [1]);
        assert!(q.take_reconnect_request());
        assert!(!q.take_reconnect_request(), "once per connection");
    }

    #[test]
    fn handles_of_an_old_connection_are_no_ops() {
        let mut q = AckQueue::default();
        q.new_connection();
        let old = q.push(1, Qos::AtLeastOnce);
        q.new_connection();
        let new = q.push(1, Qos::AtLeastOnce);
        q.settle(old, true);
        assert!(q.ready().is_empty());
        q.settle(new, true);
        assert_eq!(q.ready(), [1]);
    }

    fn received(pkid: u16) -> Received {
        Received {
            topic: prost::bytes::Bytes::from_static(b"t"),
            qos: Qos::AtLeastOnce,
            pkid,
            dup: false,
            payload: prost::bytes::Bytes::from(pkid.to_string()),
            properties: None,
        }
    }

    /// A connected receiver with a receive window of 2 (a channel of 32).
    fn window_of_two() -> (Client, ReceiverFeed, MqttReceiver) {
        let mut settings = MqttReceiverSettings::new(vec![("t".into(), Qos::AtLeastOnce)]);
        settings.max_in_flight = 2;
        let client = Client::default();
        let (mut feed, receiver) = ReceiverFeed::new(settings, "s".into(), client.clone());
        feed.on_connected(true);
        (client, feed, receiver)
    }

    /// Mosquitto 2.0.11 sends past the receive window: what does not fit the
    /// channel waits behind it, in receive order, and every delivery can be
    /// acknowledged (no reconnect).
    #[tokio::test]
    async fn a_burst_past_the_channel_waits_in_order_and_is_acknowledged() {
        let (client, mut feed, mut receiver) = window_of_two();
        for pkid in 1..=32 {
            feed.on_publish(received(pkid));
        }
        assert!(!client.reads_held(), "the channel holds the window");
        for pkid in 33..=34 {
            feed.on_publish(received(pkid));
        }
        assert!(!client.reads_held(), "one window in the overflow");
        for pkid in 35..=40 {
            feed.on_publish(received(pkid));
        }
        assert!(
            client.reads_held(),
            "more than a window holds the loop's reads"
        );
        let mut got = Vec::new();
        for pkid in 41..=50 {
            // Interleaved: the channel has room again, the overflow is not empty.
            let d = receiver.recv().await.expect("a delivery");
            got.push(String::from_utf8_lossy(&d.envelope.payload).into_owned());
            d.settle.settle(Outcome::Sent);
            feed.on_publish(received(pkid));
        }
        while got.len() < 50 {
            let d = receiver.recv().await.expect("a delivery");
            got.push(String::from_utf8_lossy(&d.envelope.payload).into_owned());
            d.settle.settle(Outcome::Sent);
        }
        let want: Vec<String> = (1..=50).map(|p: u16| p.to_string()).collect();
        assert_eq!(got, want);
        assert!(!client.reads_held(), "released at one window");
        let mut acks = lock(&feed.acks);
        assert!(acks.entries.is_empty(), "every delivery acknowledged");
        assert!(!acks.blocked && !acks.take_reconnect_request());
    }

    /// Reads are held while more than a window waits in the overflow,
    /// released at one window, and released for good when the receiver is
    /// dropped.
    #[tokio::test]
    async fn reads_are_held_past_one_window_in_the_overflow() {
        let (client, mut feed, mut receiver) = window_of_two();
        for pkid in 1..=37 {
            feed.on_publish(received(pkid)); // 32 in the channel, 5 in the overflow
        }
        assert!(client.reads_held());
        for _ in 0..32 + 2 {
            let d = receiver.recv().await.expect("a delivery");
            d.settle.settle(Outcome::Sent);
        }
        assert!(client.reads_held(), "three still wait in the overflow");
        let d = receiver.recv().await.expect("a delivery");
        d.settle.settle(Outcome::Sent);
        assert!(!client.reads_held(), "released at one window");
        for pkid in 38..=80 {
            feed.on_publish(received(pkid));
        }
        assert!(client.reads_held());
        drop(receiver);
        assert!(
            !client.reads_held(),
            "released when the receiver is dropped"
        );
        feed.on_publish(received(81));
        assert!(!client.reads_held(), "a closed receiver holds nothing");
    }

    #[test]
    fn a_settle_counts_once() {
        let mut q = AckQueue::default();
        q.new_connection();
        let a = q.push(1, Qos::AtLeastOnce);
        let b = q.push(2, Qos::AtLeastOnce);
        q.settle(b, false);
        q.settle(b, true);
        q.settle(a, true);
        assert_eq!(q.ready(), [1]);
    }
}
