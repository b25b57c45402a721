//! What the session, its senders and its receiver ask of the connection, and
//! what the event loop (`eventloop`) reports back, for both protocol versions.
//!
//! [`Client`] queues requests without waiting: every `try_*` reports a full
//! queue, never awaits, so nothing here can block the task that runs the event
//! loop. Publishes and control requests (acknowledgements, subscriptions, the
//! disconnect) wait in two queues: the loop takes control requests first and
//! publishes only while the outgoing window has room, so an acknowledgement
//! never waits behind publishes the broker has no room for.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use prost::bytes::Bytes;
use rumqttc::v5::mqttbytes::v5::{PubAckReason, PublishProperties};
use tokio::sync::Notify;

use super::publish::Publish;
use super::settings::Qos;
use crate::transports::SendError;

/// Requests of each kind that may wait for the event loop. Senders are bounded
/// by `max_outgoing_inflight`, acks by the receive window; this only needs to be
/// large enough for both at full speed.
pub(super) const REQUEST_QUEUE: usize = 1024;

/// A message as it came off the wire, before it becomes an envelope.
#[derive(Debug)]
pub(crate) struct Received {
    pub topic: Bytes,
    pub qos: Qos,
    pub pkid: u16,
    /// The DUP flag: the broker sent it before on this session.
    pub dup: bool,
    pub payload: Bytes,
    /// v5 only.
    pub properties: Option<PublishProperties>,
}

/// What the event loop reported, in the terms Ferry needs.
#[derive(Debug)]
pub(crate) enum Event {
    /// CONNACK accepted.
    Connected {
        session_present: bool,
        /// The broker's maximum packet size (v5), if it announced one.
        max_packet_size: Option<u32>,
    },
    /// An incoming PUBLISH.
    Publish(Received),
    /// An incoming PUBACK (or PUBCOMP) for one of our publishes; the error
    /// when the broker refused it (v5 reason code ≥ 0x80).
    Acked {
        pkid: u16,
        refused: Option<SendError>,
    },
    /// The oldest publish request not yet reported was written, with packet
    /// id `pkid` (0 for QoS 0).
    PublishWritten(u16),
    /// The oldest publish request not yet reported cannot be sent (larger
    /// than the broker's maximum packet size); nothing was written.
    PublishFailed(SendError),
    /// A SUBACK, with the filters the broker refused.
    Subscribed { refused: Vec<String> },
    /// Our DISCONNECT was written; the connection ends with the next poll.
    DisconnectSent,
}

/// Any other request.
#[derive(Debug)]
pub(crate) enum Control {
    /// Acknowledge the incoming publish `pkid`.
    Ack {
        pkid: u16,
        qos: Qos,
    },
    Subscribe(Vec<(String, Qos)>),
    Disconnect,
}

/// The requests not yet taken by the event loop, in request order.
#[derive(Debug, Default)]
pub(crate) struct Requests {
    pub publishes: VecDeque<Publish>,
    pub control: VecDeque<Control>,
}

#[derive(Debug, Default)]
struct Shared {
    requests: Mutex<Requests>,
    /// Signalled on every request: the loop may have something to write.
    /// Also when reads are released.
    wake: Notify,
    /// More than a receive window waits behind the receiver's full channel:
    /// the loop reads only while it awaits an answer (`eventloop`,
    /// invariants).
    hold_reads: AtomicBool,
}

/// Queues requests for the event loop of one session. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub(crate) struct Client {
    shared: Arc<Shared>,
}

/// The request queue is full.
#[derive(Debug)]
pub(crate) struct QueueFull;

/// A publish the request queue did not take, handed back for the next try
/// (so a send encodes it once, not once per try).
#[derive(Debug)]
pub(crate) struct PublishNotQueued(pub Publish);

impl Client {
    pub fn try_publish(&self, publish: Publish) -> Result<(), PublishNotQueued> {
        {
            let mut requests = self.lock();
            if requests.publishes.len() >= REQUEST_QUEUE {
                return Err(PublishNotQueued(publish));
            }
            requests.publishes.push_back(publish);
        }
        self.shared.wake.notify_one();
        Ok(())
    }

    /// Acknowledges the incoming publish `pkid` (PUBACK for QoS 1, PUBREC for
    /// QoS 2).
    pub fn try_ack(&self, pkid: u16, qos: Qos) -> Result<(), QueueFull> {
        self.try_control(Control::Ack { pkid, qos })
    }

    pub fn try_subscribe(&self, filters: &[(String, Qos)]) -> Result<(), QueueFull> {
        self.try_control(Control::Subscribe(filters.to_vec()))
    }

    pub fn try_disconnect(&self) -> Result<(), QueueFull> {
        self.try_control(Control::Disconnect)
    }

    fn try_control(&self, control: Control) -> Result<(), QueueFull> {
        {
            let mut requests = self.lock();
            if requests.control.len() >= REQUEST_QUEUE {
                return Err(QueueFull);
            }
            requests.control.push_back(control);
        }
        self.shared.wake.notify_one();
        Ok(())
    }

    /// The queues, for the event loop to take from.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Requests> {
        self.shared
            .requests
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Asks the event loop to hold its reads (`true`) or to read again.
    pub fn hold_reads(&self, hold: bool) {
        if self.shared.hold_reads.swap(hold, Ordering::Relaxed) && !hold {
            self.shared.wake.notify_one();
        }
    }

    pub(crate) fn reads_held(&self) -> bool {
        self.shared.hold_reads.load(Ordering::Relaxed)
    }

    /// Resolves when a request was queued since the last time it resolved.
    pub(crate) async fn requested(&self) {
        self.shared.wake.notified().await;
    }

    /// After a connection loss: drops every request still queued. The senders
    /// of the publishes have been failed (they retry, on the new connection,
    /// in their own order); acknowledgements of the old connection mean
    /// nothing on a new one; the receiver subscribes again on CONNACK when
    /// the broker kept no session, and a disconnect asked for is done.
    pub fn discard_unsent(&self) {
        let mut requests = self.lock();
        requests.publishes.clear();
        requests.control.clear();
    }
}

/// A v5 PUBACK reason code ≥ 0x80 as a send error: permanent when the same
/// message can never be accepted, transient otherwise.
pub(crate) fn puback_error(reason: &PubAckReason, detail: Option<String>) -> Option<SendError> {
    let what = |code: &str| match &detail {
        Some(detail) => format!("broker refused the publish: {code} ({detail})"),
        None => format!("broker refused the publish: {code}"),
    };
    match reason {
        PubAckReason::Success | PubAckReason::NoMatchingSubscribers => None,
        PubAckReason::NotAuthorized => Some(SendError::Permanent(what("not authorized (0x87)"))),
        PubAckReason::TopicNameInvalid => {
            Some(SendError::Permanent(what("topic name invalid (0x90)")))
        }
        PubAckReason::PayloadFormatInvalid => {
            Some(SendError::Permanent(what("payload format invalid (0x99)")))
        }
        PubAckReason::QuotaExceeded => Some(SendError::Transient(what("quota exceeded (0x97)"))),
        PubAckReason::PacketIdentifierInUse => Some(SendError::Transient(what(
            "packet identifier in use (0x91)",
        ))),
        PubAckReason::UnspecifiedError => {
            Some(SendError::Transient(what("unspecified error (0x80)")))
        }
        PubAckReason::ImplementationSpecificError => Some(SendError::Transient(what(
            "implementation specific error (0x83)",
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn puback_reasons() {
        assert_eq!(puback_error(&PubAckReason::Success, None), None);
        assert_eq!(
            puback_error(&PubAckReason::NoMatchingSubscribers, None),
            None
        );
        assert!(puback_error(&PubAckReason::NotAuthorized, None).is_some_and(|e| e.is_permanent()));
        assert!(
            puback_error(&PubAckReason::TopicNameInvalid, None).is_some_and(|e| e.is_permanent())
        );
        assert!(matches!(
            puback_error(&PubAckReason::QuotaExceeded, Some("slow down".into())),
            Some(SendError::Transient(m)) if m.contains("slow down")
        ));
    }

    #[test]
    fn full_queues_hand_the_request_back_and_a_loss_empties_them() {
        let client = Client::default();
        let publish = || {
            let e = crate::stores::conformance::envelope("a");
            Publish::v5(
                "t",
                Qos::AtLeastOnce,
                false,
                &e,
                std::time::SystemTime::now(),
            )
            .expect("a valid publish")
        };
        for _ in 0..REQUEST_QUEUE {
            assert!(client.try_publish(publish()).is_ok());
            assert!(client.try_ack(1, Qos::AtLeastOnce).is_ok());
        }
        assert!(matches!(
            client.try_publish(publish()),
            Err(PublishNotQueued(_))
        ));
        assert!(client.try_disconnect().is_err());
        client.discard_unsent();
        let requests = client.lock();
        assert!(requests.publishes.is_empty() && requests.control.is_empty());
    }
}
