//! The two rumqttc clients (v5 and v3.1.1) behind one small surface.
//!
//! rumqttc has separate types per protocol version. The session, receiver and
//! sender only need: non-blocking requests (publish, ack, subscribe,
//! disconnect) and the events of the loop, normalised into [`Event`]. All
//! requests are `try_*`: a full request queue is reported, never awaited, so
//! nothing here can block the task that polls the event loop.

use std::time::Duration;

use prost::bytes::Bytes;
use rumqttc::v5::mqttbytes::v5::{Packet as PacketV5, PubAckReason, PublishProperties};
use rumqttc::{Outgoing, TlsConfiguration, Transport};

use super::settings::{
    Endpoint, MQTT_MAX_PACKET_BYTES, MqttReceiverSettings, MqttSessionSettings, Protocol, Qos,
    SettingsError,
};
use super::tls;
use crate::transports::SendError;

/// Requests queued between the clients and the event loop. Senders are bounded
/// by `max_outgoing_inflight`, acks by the receive window; this only needs to be
/// large enough for both at full speed.
const REQUEST_QUEUE: usize = 1024;

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
    /// A PUBLISH request left the queue and was written (`pkid` 0 for QoS 0).
    PublishWritten(u16),
    /// A PUBLISH request collided with an unacknowledged packet id and waits
    /// for that id's acknowledgement before it is written.
    PublishParked(u16),
    /// A SUBACK, with the filters the broker refused.
    Subscribed { refused: Vec<String> },
    /// Our DISCONNECT was written.
    DisconnectSent,
    /// Anything else (pings, our own acks, ...).
    Other,
}

/// Sends requests to the event loop without waiting.
#[derive(Clone, Debug)]
pub(crate) enum Client {
    V5(rumqttc::v5::AsyncClient),
    V311(rumqttc::AsyncClient),
}

/// The request queue is full (or the event loop is gone).
#[derive(Debug)]
pub(crate) struct QueueFull;

/// A publish the request queue did not take, with its properties handed back
/// for the next try when rumqttc returned them (so a send builds them once,
/// not once per try). Boxed: the error path is rare, the `Result` small.
#[derive(Debug)]
pub(crate) struct PublishNotQueued(pub Option<Box<PublishProperties>>);

impl Client {
    pub fn try_publish(
        &self,
        topic: &str,
        qos: Qos,
        retain: bool,
        payload: Bytes,
        properties: PublishProperties,
    ) -> Result<(), PublishNotQueued> {
        match self {
            Client::V5(c) => c
                .try_publish_with_properties(topic, qos_v5(qos), retain, payload, properties)
                .map_err(|e| match e {
                    rumqttc::v5::ClientError::Request(rumqttc::v5::Request::Publish(p))
                    | rumqttc::v5::ClientError::TryRequest(rumqttc::v5::Request::Publish(p)) => {
                        PublishNotQueued(p.properties.map(Box::new))
                    }
                    _ => PublishNotQueued(None),
                }),
            Client::V311(c) => c
                .try_publish(topic, qos_v3(qos), retain, payload.to_vec())
                .map_err(|_| PublishNotQueued(Some(Box::new(properties)))),
        }
    }

    /// Acknowledges the incoming publish `pkid` (PUBACK for QoS 1, PUBREC for
    /// QoS 2).
    pub fn try_ack(&self, pkid: u16, qos: Qos) -> Result<(), QueueFull> {
        match self {
            Client::V5(c) => {
                let mut publish =
                    rumqttc::v5::mqttbytes::v5::Publish::new("", qos_v5(qos), Bytes::new(), None);
                publish.pkid = pkid;
                c.try_ack(&publish).map_err(|_| QueueFull)
            }
            Client::V311(c) => {
                let mut publish = rumqttc::Publish::new("", qos_v3(qos), Vec::new());
                publish.pkid = pkid;
                c.try_ack(&publish).map_err(|_| QueueFull)
            }
        }
    }

    pub fn try_subscribe(&self, filters: &[(String, Qos)]) -> Result<(), QueueFull> {
        match self {
            Client::V5(c) => c
                .try_subscribe_many(
                    filters.iter().map(|(f, q)| {
                        rumqttc::v5::mqttbytes::v5::Filter::new(f.clone(), qos_v5(*q))
                    }),
                )
                .map_err(|_| QueueFull),
            Client::V311(c) => c
                .try_subscribe_many(
                    filters
                        .iter()
                        .map(|(f, q)| rumqttc::SubscribeFilter::new(f.clone(), qos_v3(*q))),
                )
                .map_err(|_| QueueFull),
        }
    }

    pub fn try_disconnect(&self) -> Result<(), QueueFull> {
        match self {
            Client::V5(c) => c.try_disconnect().map_err(|_| QueueFull),
            Client::V311(c) => c.try_disconnect().map_err(|_| QueueFull),
        }
    }
}

/// The rumqttc event loop of either version.
pub(crate) enum EventLoop {
    V5(Box<rumqttc::v5::EventLoop>),
    V311(Box<rumqttc::EventLoop>),
}

impl EventLoop {
    /// The next event; an error means the connection is gone (the next poll
    /// reconnects).
    pub async fn poll(&mut self) -> Result<Event, String> {
        match self {
            EventLoop::V5(ev) => match ev.poll().await {
                Ok(rumqttc::v5::Event::Incoming(packet)) => Ok(incoming_v5(packet)),
                Ok(rumqttc::v5::Event::Outgoing(out)) => Ok(outgoing(out)),
                Err(e) => Err(connection_error_v5(&e)),
            },
            EventLoop::V311(ev) => match ev.poll().await {
                Ok(rumqttc::Event::Incoming(packet)) => Ok(incoming_v3(packet)),
                Ok(rumqttc::Event::Outgoing(out)) => Ok(outgoing(out)),
                Err(e) => Err(connection_error_v3(&e)),
            },
        }
    }

    /// After a connection loss: takes every request still queued out of the
    /// request channel and drops the publishes and acks among them, together
    /// with the publishes rumqttc kept for retransmission. Their senders have
    /// been failed (they retry, on the new connection, in their own order) and
    /// acks of the old connection are meaningless on a new one. Subscriptions
    /// are kept.
    pub fn discard_unsent(&mut self) {
        match self {
            EventLoop::V5(ev) => {
                ev.clean();
                ev.pending.retain(|r| {
                    !matches!(
                        r,
                        rumqttc::v5::Request::Publish(_)
                            | rumqttc::v5::Request::PubAck(_)
                            | rumqttc::v5::Request::PubRec(_)
                    )
                });
            }
            EventLoop::V311(ev) => {
                ev.clean();
                ev.pending.retain(|r| {
                    !matches!(
                        r,
                        rumqttc::Request::Publish(_)
                            | rumqttc::Request::PubAck(_)
                            | rumqttc::Request::PubRec(_)
                    )
                });
            }
        }
    }
}

/// What rumqttc's `TopicNotUtf8` means: it reports *any* string of a packet
/// that is not UTF-8 (a user property, a content type, a reason string) as the
/// topic's.
const NOT_UTF8: &str = "a string in it is not valid UTF-8 (topic or property)";

/// A v5 connection error in words that are true. A packet that cannot be
/// decoded is the broker's fault and is named as such; rumqttc's own text
/// says "Topic not utf-8" for every non-UTF-8 string.
fn connection_error_v5(error: &rumqttc::v5::ConnectionError) -> String {
    use rumqttc::v5::mqttbytes::Error;
    use rumqttc::v5::{ConnectionError, StateError};
    match error {
        ConnectionError::MqttState(StateError::Deserialization(e)) => match e {
            Error::TopicNotUtf8 => malformed(NOT_UTF8),
            Error::Io(_) | Error::PayloadSizeLimitExceeded { .. } => error.to_string(),
            other => malformed(&other.to_string()),
        },
        other => other.to_string(),
    }
}

/// [`connection_error_v5`] for v3.1.1.
fn connection_error_v3(error: &rumqttc::ConnectionError) -> String {
    use rumqttc::{ConnectionError, Error, StateError};
    match error {
        ConnectionError::MqttState(StateError::Deserialization(e)) => match e {
            Error::TopicNotUtf8 => malformed(NOT_UTF8),
            Error::Io(_) | Error::PayloadSizeLimitExceeded(_) => error.to_string(),
            other => malformed(&other.to_string()),
        },
        other => other.to_string(),
    }
}

fn malformed(what: &str) -> String {
    format!("the broker sent a malformed packet: {what}")
}

/// Builds the client and its event loop for a session; nothing connects yet.
pub(crate) fn create(
    settings: &MqttSessionSettings,
    endpoint: &Endpoint,
    receiver: Option<&MqttReceiverSettings>,
) -> Result<(Client, EventLoop), SettingsError> {
    let transport = if endpoint.tls {
        Transport::Tls(TlsConfiguration::Rustls(tls::client_config(
            settings.ca_file.as_deref(),
        )?))
    } else {
        Transport::Tcp
    };
    let connect_timeout = settings.connect_timeout.as_secs().max(1);
    let max_packet = settings.max_packet_bytes;
    // A receiving session accepts any packet the broker may send: announcing
    // a smaller maximum makes the broker discard larger messages silently
    // (MQTT v5 §3.1.2.11.4), and a smaller incoming limit would drop the
    // connection on one and get it redelivered forever. A message too large
    // for the route is dead-lettered as `oversized` by the route instead.
    // rumqttc takes the announced v5 maximum as its incoming limit too.
    let max_incoming = if receiver.is_some() {
        MQTT_MAX_PACKET_BYTES
    } else {
        max_packet
    };
    // Validated: whole seconds in 5..=65535 (rumqttc asserts on less).
    let keep_alive = Duration::from_secs(settings.keep_alive.as_secs());
    match settings.protocol {
        Protocol::V5 => {
            let mut options = rumqttc::v5::MqttOptions::new(
                settings.client_id.clone(),
                endpoint.host.clone(),
                endpoint.port,
            );
            options
                .set_transport(transport)
                .set_keep_alive(keep_alive)
                .set_clean_start(settings.clean_start)
                .set_connection_timeout(connect_timeout)
                .set_request_channel_capacity(REQUEST_QUEUE)
                .set_max_packet_size(Some(max_incoming))
                .set_outgoing_inflight_upper_limit(settings.max_outgoing_inflight)
                .set_session_expiry_interval(Some(
                    u32::try_from(settings.session_expiry.as_secs()).unwrap_or(u32::MAX),
                ));
            let mut network = rumqttc::NetworkOptions::new();
            network.set_tcp_nodelay(true);
            network.set_connection_timeout(connect_timeout);
            options.set_network_options(network);
            if let Some(username) = &settings.username {
                options.set_credentials(
                    username.clone(),
                    settings
                        .password
                        .as_ref()
                        .map(|p| p.expose().to_owned())
                        .unwrap_or_default(),
                );
            }
            if let Some(receiver) = receiver {
                options
                    .set_manual_acks(true)
                    .set_receive_maximum(Some(receiver.max_in_flight));
            }
            let (client, eventloop) = rumqttc::v5::AsyncClient::new(options, REQUEST_QUEUE);
            Ok((Client::V5(client), EventLoop::V5(Box::new(eventloop))))
        }
        Protocol::V311 => {
            let mut options = rumqttc::MqttOptions::new(
                settings.client_id.clone(),
                endpoint.host.clone(),
                endpoint.port,
            );
            options
                .set_transport(transport)
                .set_keep_alive(keep_alive)
                // Validated: the client id is not empty (rumqttc asserts).
                .set_clean_session(settings.clean_start)
                .set_request_channel_capacity(REQUEST_QUEUE)
                .set_max_packet_size(max_incoming as usize, max_packet as usize)
                .set_inflight(settings.max_outgoing_inflight);
            if let Some(username) = &settings.username {
                options.set_credentials(
                    username.clone(),
                    settings
                        .password
                        .as_ref()
                        .map(|p| p.expose().to_owned())
                        .unwrap_or_default(),
                );
            }
            if receiver.is_some() {
                options.set_manual_acks(true);
            }
            let (client, mut eventloop) = rumqttc::AsyncClient::new(options, REQUEST_QUEUE);
            eventloop.network_options.set_tcp_nodelay(true);
            eventloop
                .network_options
                .set_connection_timeout(connect_timeout);
            Ok((Client::V311(client), EventLoop::V311(Box::new(eventloop))))
        }
    }
}

fn qos_v5(qos: Qos) -> rumqttc::v5::mqttbytes::QoS {
    use rumqttc::v5::mqttbytes::QoS;
    match qos {
        Qos::AtMostOnce => QoS::AtMostOnce,
        Qos::AtLeastOnce => QoS::AtLeastOnce,
        Qos::ExactlyOnce => QoS::ExactlyOnce,
    }
}

fn qos_v3(qos: Qos) -> rumqttc::QoS {
    match qos {
        Qos::AtMostOnce => rumqttc::QoS::AtMostOnce,
        Qos::AtLeastOnce => rumqttc::QoS::AtLeastOnce,
        Qos::ExactlyOnce => rumqttc::QoS::ExactlyOnce,
    }
}

fn from_v5(qos: rumqttc::v5::mqttbytes::QoS) -> Qos {
    use rumqttc::v5::mqttbytes::QoS;
    match qos {
        QoS::AtMostOnce => Qos::AtMostOnce,
        QoS::AtLeastOnce => Qos::AtLeastOnce,
        QoS::ExactlyOnce => Qos::ExactlyOnce,
    }
}

fn from_v3(qos: rumqttc::QoS) -> Qos {
    match qos {
        rumqttc::QoS::AtMostOnce => Qos::AtMostOnce,
        rumqttc::QoS::AtLeastOnce => Qos::AtLeastOnce,
        rumqttc::QoS::ExactlyOnce => Qos::ExactlyOnce,
    }
}

fn outgoing(out: Outgoing) -> Event {
    match out {
        Outgoing::Publish(pkid) => Event::PublishWritten(pkid),
        Outgoing::AwaitAck(pkid) => Event::PublishParked(pkid),
        Outgoing::Disconnect => Event::DisconnectSent,
        _ => Event::Other,
    }
}

fn incoming_v5(packet: PacketV5) -> Event {
    use rumqttc::v5::mqttbytes::v5::SubscribeReasonCode;
    match packet {
        PacketV5::ConnAck(connack) => Event::Connected {
            session_present: connack.session_present,
            max_packet_size: connack.properties.and_then(|p| p.max_packet_size),
        },
        PacketV5::Publish(p) => Event::Publish(Received {
            topic: p.topic,
            qos: from_v5(p.qos),
            pkid: p.pkid,
            dup: p.dup,
            payload: p.payload,
            properties: p.properties,
        }),
        PacketV5::PubAck(ack) => Event::Acked {
            pkid: ack.pkid,
            refused: puback_error(&ack.reason, ack.properties.and_then(|p| p.reason_string)),
        },
        PacketV5::PubComp(comp) => Event::Acked {
            pkid: comp.pkid,
            refused: None,
        },
        PacketV5::SubAck(suback) => Event::Subscribed {
            refused: suback
                .return_codes
                .iter()
                .filter(|c| !matches!(c, SubscribeReasonCode::Success(_)))
                .map(|c| format!("{c:?}"))
                .collect(),
        },
        _ => Event::Other,
    }
}

fn incoming_v3(packet: rumqttc::Packet) -> Event {
    match packet {
        rumqttc::Packet::ConnAck(connack) => Event::Connected {
            session_present: connack.session_present,
            max_packet_size: None,
        },
        rumqttc::Packet::Publish(p) => Event::Publish(Received {
            topic: Bytes::from(p.topic.into_bytes()),
            qos: from_v3(p.qos),
            pkid: p.pkid,
            dup: p.dup,
            payload: p.payload,
            properties: None,
        }),
        rumqttc::Packet::PubAck(ack) => Event::Acked {
            pkid: ack.pkid,
            refused: None,
        },
        rumqttc::Packet::PubComp(comp) => Event::Acked {
            pkid: comp.pkid,
            refused: None,
        },
        rumqttc::Packet::SubAck(suback) => Event::Subscribed {
            refused: suback
                .return_codes
                .iter()
                .filter(|c| !matches!(c, rumqttc::SubscribeReasonCode::Success(_)))
                .map(|c| format!("{c:?}"))
                .collect(),
        },
        _ => Event::Other,
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
    fn a_non_utf8_string_is_a_malformed_packet_not_a_topic() {
        use rumqttc::v5::mqttbytes::Error;
        use rumqttc::v5::{ConnectionError, StateError};
        let e = ConnectionError::MqttState(StateError::Deserialization(Error::TopicNotUtf8));
        let text = connection_error_v5(&e);
        assert_eq!(
            text,
            "the broker sent a malformed packet: a string in it is not valid UTF-8 (topic or property)"
        );
        let e = ConnectionError::MqttState(StateError::Deserialization(Error::MalformedPacket));
        assert!(connection_error_v5(&e).starts_with("the broker sent a malformed packet"));
        let e = ConnectionError::MqttState(StateError::ConnectionAborted);
        assert_eq!(connection_error_v5(&e), e.to_string());
        let e = rumqttc::ConnectionError::MqttState(rumqttc::StateError::Deserialization(
            rumqttc::Error::TopicNotUtf8,
        ));
        assert!(connection_error_v3(&e).contains("topic or property"));
    }

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
}
