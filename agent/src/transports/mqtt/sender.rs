//! The MQTT sender: a send resolves on the PUBACK of its own publish.
//!
//! The event loop reports, in request order, when each publish is written
//! (`PublishWritten(pkid)`) and then the PUBACK of that packet id. So:
//!
//! - a send queues its request and its waiter **under one lock**, so the
//!   waiters' FIFO ([`Outbound::queued`]) is in the order of the request
//!   queue, and the order of `send` calls is the order on the wire;
//! - each "written" event takes the oldest waiter: QoS 0 resolves there, QoS
//!   1/2 moves to `inflight[pkid]` until its acknowledgement (a v5 reason code
//!   ≥ 0x80 becomes a [`SendError`]); a publish the loop could not encode
//!   (`PublishFailed`) fails the oldest waiter. The loop never reuses a packet
//!   id still in flight, so `inflight` has one waiter per id;
//! - **on every connection loss all waiters fail with a transient error**, and
//!   the publishes still queued are discarded (the loop resends nothing of an
//!   old connection), so a new connection carries only publishes whose waiters
//!   are alive. The caller retries; the broker may see a message twice, never
//!   lose one;
//! - while disconnected a send fails at once (the drainer does not send then);
//!   every send is bounded by `send_timeout`: its waiter carries its
//!   deadline, and a task of the session answers the waiters whose deadline
//!   passed ([`Outbound::expire`], one timer per session at the earliest
//!   deadline instead of one per send, which cost about 600 instructions per
//!   send). A waiter that timed out while queued keeps its place, empty, so
//!   the "written" events still meet the waiters in order.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use ferry_shared::envelope::Envelope;
use tokio::sync::{Notify, oneshot, watch};
use tokio::time::{Instant, timeout_at};

use super::packet_ids::PacketIdMap;
use super::protocol::{Client, PublishNotQueued};
use super::publish::Publish;
use super::settings::{MqttSenderSettings, Protocol, topic_problem};
use crate::transports::{Address, SendError, SendFuture, Sender};

/// Where a send learns its outcome.
type Outcome = oneshot::Receiver<Result<(), SendError>>;

/// A send waiting for its outcome, until its deadline.
#[derive(Debug)]
struct Waiter {
    /// `None` once answered by [`Outbound::expire`] (the place is kept).
    tx: Option<oneshot::Sender<Result<(), SendError>>>,
    deadline: Instant,
    /// The sender's `send_timeout`, for the error.
    timeout: Duration,
}

impl Waiter {
    fn answer(&mut self, outcome: Result<(), SendError>) {
        if let Some(tx) = self.tx.take() {
            // The caller may have gone: nothing to tell then.
            tx.send(outcome).ok();
        }
    }

    fn expire(&mut self, now: Instant) -> bool {
        let expired = self.deadline <= now;
        if expired {
            self.answer(Err(SendError::Timeout(self.timeout)));
        }
        expired
    }
}

/// The publishes of one session awaiting their outcome.
#[derive(Debug, Default)]
pub(crate) struct Outbound {
    connected: bool,
    stopped: bool,
    /// The largest packet that may be written (ours and the broker's limit).
    max_packet: usize,
    /// Requested, not yet written, in request order.
    queued: VecDeque<Waiter>,
    /// Written, awaiting PUBACK / PUBCOMP.
    inflight: PacketIdMap<Waiter>,
    /// No waiter's deadline is earlier (it may be earlier than every
    /// waiter's: answered waiters do not move it).
    earliest: Option<Instant>,
}

impl Outbound {
    pub fn new(max_packet: usize) -> Self {
        Self {
            max_packet,
            ..Self::default()
        }
    }

    pub fn on_connected(&mut self, ours: usize, broker: Option<u32>) {
        self.connected = true;
        self.max_packet = broker.map_or(ours, |b| ours.min(b as usize));
    }

    /// Queues a send's waiter; `true` when its deadline is now the earliest
    /// (the session's timer must be set sooner: [`SenderShared::deadlines`]).
    fn push(
        &mut self,
        tx: oneshot::Sender<Result<(), SendError>>,
        deadline: Instant,
        timeout: Duration,
    ) -> bool {
        let sooner = self.earliest.is_none_or(|e| deadline < e);
        if sooner {
            self.earliest = Some(deadline);
        }
        self.queued.push_back(Waiter {
            tx: Some(tx),
            deadline,
            timeout,
        });
        sooner
    }

    pub fn on_written(&mut self, pkid: u16) {
        let Some(mut waiter) = self.queued.pop_front() else {
            tracing::warn!(pkid, "a publish was written that no sender waits for");
            return;
        };
        if pkid == 0 {
            waiter.answer(Ok(()));
        } else if waiter.tx.is_some() {
            self.inflight.insert(pkid, waiter);
        }
    }

    pub fn on_failed(&mut self, error: SendError) {
        if let Some(mut waiter) = self.queued.pop_front() {
            waiter.answer(Err(error));
        }
    }

    pub fn on_acked(&mut self, pkid: u16, refused: Option<SendError>) {
        if let Some(mut waiter) = self.inflight.remove(&pkid) {
            waiter.answer(refused.map_or(Ok(()), Err));
        }
    }

    /// The earliest deadline of a waiter, or earlier; `None` without waiters.
    pub fn earliest(&self) -> Option<Instant> {
        self.earliest
    }

    /// Answers every waiter whose deadline is `now` or earlier with
    /// [`SendError::Timeout`] (a queued one keeps its place), and returns the
    /// earliest deadline of those left.
    pub fn expire(&mut self, now: Instant) -> Option<Instant> {
        self.inflight.retain(|_, waiter| !waiter.expire(now));
        for waiter in &mut self.queued {
            waiter.expire(now);
        }
        self.earliest = self
            .queued
            .iter()
            .filter(|w| w.tx.is_some())
            .chain(self.inflight.values())
            .map(|w| w.deadline)
            .min();
        self.earliest
    }

    /// Fails every waiter; the session is disconnected (or stopped) until the
    /// next [`Outbound::on_connected`].
    pub fn fail_all(&mut self, error: &SendError) {
        self.connected = false;
        for mut waiter in self
            .queued
            .drain(..)
            .chain(self.inflight.drain().map(|(_, w)| w))
        {
            waiter.answer(Err(error.clone()));
        }
        self.earliest = None;
    }

    pub fn stop(&mut self) {
        self.stopped = true;
        self.fail_all(&SendError::Transient("the session stopped".into()));
    }
}

pub(crate) fn lock(outbound: &Mutex<Outbound>) -> MutexGuard<'_, Outbound> {
    outbound
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What the session shares with its senders.
#[derive(Debug)]
pub(crate) struct SenderShared {
    pub outbound: Mutex<Outbound>,
    /// Signalled after every event of the loop: the request queue may have
    /// room again.
    pub progress: Notify,
    /// Signalled when a waiter's deadline became the earliest (from none,
    /// usually): the session sets its timer for it.
    pub deadlines: Notify,
}

/// Publishes envelopes on one MQTT session. Cheap to clone; clones share the
/// session and its order.
#[derive(Clone, Debug)]
pub struct MqttSender {
    shared: Arc<SenderShared>,
    client: Client,
    protocol: Protocol,
    settings: MqttSenderSettings,
    connected: watch::Receiver<bool>,
}

impl MqttSender {
    pub(crate) fn new(
        shared: Arc<SenderShared>,
        client: Client,
        protocol: Protocol,
        settings: MqttSenderSettings,
        connected: watch::Receiver<bool>,
    ) -> Self {
        Self {
            shared,
            client,
            protocol,
            settings,
            connected,
        }
    }

    /// Publishes `envelope` on topic `address` and resolves on its PUBACK
    /// (QoS 1), PUBCOMP (QoS 2), or once written (QoS 0).
    pub async fn send(&self, envelope: &Envelope, address: &Address) -> Result<(), SendError> {
        let deadline = Instant::now() + self.settings.send_timeout;
        let topic = address.as_str();
        if let Some(problem) = topic_problem(topic) {
            return Err(SendError::Permanent(format!("{problem}: {topic:?}")));
        }
        let now = SystemTime::now();
        let (qos, retain) = (self.settings.qos, self.settings.retain);
        // Encoded once; a full request queue hands it back for the next try.
        let publish = match self.protocol {
            Protocol::V5 => Publish::v5(topic, qos, retain, envelope, now)?,
            Protocol::V311 => Publish::v311(topic, qos, retain, envelope, now)?,
        };
        let size = publish.len();
        // The request queue nearly always has room: a send registers for the
        // loop's progress only after finding it full, then tries once more
        // before it waits, so a wake-up between the two is not missed.
        let outcome = match self.try_queue(publish, size, deadline)? {
            Ok(outcome) => outcome,
            Err(mut publish) => loop {
                let progress = self.shared.progress.notified();
                tokio::pin!(progress);
                progress.as_mut().enable();
                match self.try_queue(publish, size, deadline)? {
                    Ok(outcome) => break outcome,
                    Err(returned) => publish = returned,
                }
                if timeout_at(deadline, progress).await.is_err() {
                    return Err(SendError::Timeout(self.settings.send_timeout));
                }
            },
        };
        // Answered by the session, at the latest when the deadline passed.
        outcome
            .await
            .unwrap_or_else(|_| Err(SendError::Transient("the session stopped".into())))
    }

    /// Queues `publish` (`size` bytes) with its waiter under one lock (see
    /// the module's invariants), or hands it back when the request queue is
    /// full.
    fn try_queue(
        &self,
        publish: Publish,
        size: usize,
        deadline: Instant,
    ) -> Result<Result<Outcome, Publish>, SendError> {
        let mut outbound = lock(&self.shared.outbound);
        if outbound.stopped {
            return Err(SendError::Transient("the session stopped".into()));
        }
        if !outbound.connected {
            return Err(SendError::Transient("not connected to the broker".into()));
        }
        if size > outbound.max_packet {
            return Err(SendError::Oversized(format!(
                "a publish of {size} bytes exceeds the maximum packet size of {} bytes",
                outbound.max_packet
            )));
        }
        match self.client.try_publish(publish) {
            Ok(()) => {
                let (tx, rx) = oneshot::channel();
                if outbound.push(tx, deadline, self.settings.send_timeout) {
                    self.shared.deadlines.notify_one();
                }
                Ok(Ok(rx))
            }
            Err(PublishNotQueued(returned)) => Ok(Err(returned)),
        }
    }
}

impl Sender for MqttSender {
    fn send<'a>(&'a self, envelope: &'a Envelope, address: &'a Address) -> SendFuture<'a> {
        Box::pin(MqttSender::send(self, envelope, address))
    }

    fn connected(&self) -> watch::Receiver<bool> {
        self.connected.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(30);

    fn waiter(outbound: &mut Outbound) -> Outcome {
        waiter_until(outbound, Instant::now() + TIMEOUT)
    }

    fn waiter_until(outbound: &mut Outbound, deadline: Instant) -> Outcome {
        let (tx, rx) = oneshot::channel();
        outbound.push(tx, deadline, TIMEOUT);
        rx
    }

    /// The waiters of a session connected with a 1 KiB packet limit.
    fn connected() -> Outbound {
        let mut o = Outbound::new(1024);
        o.on_connected(1024, None);
        o
    }

    /// The instant `secs` seconds after the call.
    fn seconds_from_now() -> impl Fn(u64) -> Instant {
        let start = Instant::now();
        move |secs| start + Duration::from_secs(secs)
    }

    fn timed_out(rx: &mut Outcome) -> bool {
        matches!(rx.try_recv(), Ok(Err(SendError::Timeout(TIMEOUT))))
    }

    /// `push` tells when a deadline became the earliest, so that the
    /// session sets its timer sooner.
    #[test]
    fn a_push_tells_when_its_deadline_is_the_earliest() {
        let mut o = connected();
        let at = seconds_from_now();
        let mut push = |deadline| o.push(oneshot::channel().0, deadline, TIMEOUT);
        assert!(push(at(2)), "the first");
        assert!(!push(at(3)), "later");
        assert!(!push(at(2)), "as early");
        assert!(push(at(1)), "earlier");
        assert_eq!(o.earliest(), Some(at(1)));
    }

    #[test]
    fn waiters_past_their_deadline_time_out_and_a_queued_one_keeps_its_place() {
        let mut o = connected();
        let at = seconds_from_now();
        let mut a = waiter_until(&mut o, at(1)); // written, never acknowledged
        let mut b = waiter_until(&mut o, at(3)); // written, acknowledged in time
        let mut c = waiter_until(&mut o, at(2)); // still queued at its deadline
        let mut d = waiter_until(&mut o, at(4)); // queued behind it
        assert_eq!(o.earliest(), Some(at(1)));
        o.on_written(1);
        o.on_written(2);
        assert_eq!(o.expire(at(1)), Some(at(2)));
        assert!(timed_out(&mut a));
        o.on_acked(1, None); // too late: nobody waits
        o.on_acked(2, None);
        assert_eq!(b.try_recv().ok(), Some(Ok(())));
        assert_eq!(o.expire(at(2)), Some(at(4)));
        assert!(timed_out(&mut c));
        // c's publish is written after all: it still takes c's place, not d's.
        o.on_written(3);
        o.on_written(4);
        assert_eq!(o.expire(at(3)), Some(at(4)));
        o.on_acked(4, None);
        assert_eq!(d.try_recv().ok(), Some(Ok(())));
        assert_eq!(o.expire(at(4)), None);
        assert!(o.inflight.is_empty() && o.queued.is_empty());
    }

    #[test]
    fn written_events_match_waiters_in_order_and_acks_resolve_them() {
        let mut o = connected();
        let mut a = waiter(&mut o);
        let mut b = waiter(&mut o);
        let mut c = waiter(&mut o);
        o.on_written(1);
        o.on_written(2);
        o.on_written(0); // QoS 0: done when written
        assert_eq!(c.try_recv().ok(), Some(Ok(())));
        o.on_acked(2, Some(SendError::Permanent("no".into())));
        o.on_acked(1, None);
        assert_eq!(a.try_recv().ok(), Some(Ok(())));
        assert!(
            b.try_recv()
                .is_ok_and(|r| r.is_err_and(|e| e.is_permanent()))
        );
    }

    #[test]
    fn a_publish_that_cannot_be_written_fails_its_own_waiter() {
        let mut o = connected();
        let mut a = waiter(&mut o);
        let mut b = waiter(&mut o);
        o.on_failed(SendError::Oversized("too large".into()));
        o.on_written(1);
        o.on_acked(1, None);
        assert!(matches!(a.try_recv(), Ok(Err(SendError::Oversized(_)))));
        assert_eq!(b.try_recv().ok(), Some(Ok(())));
    }

    #[test]
    fn a_connection_loss_fails_every_waiter() {
        let mut o = Outbound::new(1024);
        o.on_connected(1024, Some(100));
        assert_eq!(o.max_packet, 100);
        let mut a = waiter(&mut o);
        let mut b = waiter(&mut o);
        o.on_written(1);
        o.fail_all(&SendError::Transient("lost".into()));
        assert!(!o.connected);
        for rx in [&mut a, &mut b] {
            assert!(matches!(rx.try_recv(), Ok(Err(SendError::Transient(_)))));
        }
    }
}
