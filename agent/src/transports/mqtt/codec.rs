//! MQTT packets in and out, for both protocol versions, on rumqttc's codec.
//!
//! `rumqttc::v5::mqttbytes` (v5) and `rumqttc::mqttbytes::v4` (v3.1.1) encode
//! and decode; this module appends the packets Ferry writes to one buffer and
//! turns what the broker sends into [`Incoming`], the same for both versions.
//! It holds no state: packet ids and what they mean are the event loop's.

use prost::bytes::{Bytes, BytesMut};
use rumqttc::mqttbytes::v4;
use rumqttc::v5::mqttbytes::v5;

use super::protocol::{Received, puback_error};
use super::settings::Qos;
use crate::transports::SendError;

/// What CONNECT says about the client.
#[derive(Clone, Debug)]
pub(crate) struct ConnectOptions {
    pub client_id: String,
    pub keep_alive_secs: u16,
    pub clean_start: bool,
    /// v5 only (v3.1.1 keeps a session until a clean connect).
    pub session_expiry_secs: u32,
    pub credentials: Option<(String, String)>,
    /// v5 receive maximum: how many unacknowledged QoS 1/2 publishes the
    /// broker may send us (a receiver's window).
    pub receive_maximum: Option<u16>,
    /// The largest packet we accept (announced in v5).
    pub max_incoming: u32,
}

/// A CONNACK, normalised.
#[derive(Debug)]
pub(crate) struct ConnAck {
    pub session_present: bool,
    /// Why the broker refused the connection, if it did.
    pub refused: Option<String>,
    pub receive_maximum: Option<u16>,
    pub max_packet_size: Option<u32>,
    pub server_keep_alive: Option<u16>,
}

/// A packet from the broker, normalised.
#[derive(Debug)]
pub(crate) enum Incoming {
    ConnAck(ConnAck),
    Publish(Received),
    PubAck {
        pkid: u16,
        refused: Option<SendError>,
    },
    PubRec {
        pkid: u16,
        refused: Option<SendError>,
    },
    PubRel {
        pkid: u16,
    },
    PubComp {
        pkid: u16,
    },
    SubAck {
        pkid: u16,
        refused: Vec<String>,
    },
    PingResp,
    /// A v5 DISCONNECT from the broker, with its reason.
    Disconnect(String),
    /// A packet a broker never sends to a client (CONNECT, SUBSCRIBE, ...).
    Unexpected(&'static str),
}

/// The protocol version a connection speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Codec {
    V5,
    V311,
}

/// A packet that cannot be encoded; only a publish can be too large.
#[derive(Debug)]
pub(crate) struct EncodeError(pub String);

impl Codec {
    pub fn connect(self, o: &ConnectOptions, buf: &mut BytesMut) -> Result<(), EncodeError> {
        match self {
            Codec::V5 => {
                let properties = v5::ConnectProperties {
                    session_expiry_interval: Some(o.session_expiry_secs),
                    receive_maximum: o.receive_maximum,
                    max_packet_size: Some(o.max_incoming),
                    ..v5::ConnectProperties::new()
                };
                let connect = v5::Connect {
                    keep_alive: o.keep_alive_secs,
                    client_id: o.client_id.clone(),
                    clean_start: o.clean_start,
                    properties: Some(properties),
                };
                let login = o
                    .credentials
                    .as_ref()
                    .map(|(u, p)| v5::Login::new(u.as_str(), p.as_str()));
                write_v5(&v5::Packet::Connect(connect, None, login), buf, None)
            }
            Codec::V311 => {
                let mut connect = v4::Connect::new(o.client_id.as_str());
                connect.keep_alive = o.keep_alive_secs;
                connect.clean_session = o.clean_start;
                if let Some((u, p)) = &o.credentials {
                    connect.set_login(u.as_str(), p.as_str());
                }
                write_v4(&v4::Packet::Connect(connect), buf, usize::MAX)
            }
        }
    }

    /// Acknowledges an incoming publish: PUBACK for QoS 1, PUBREC for QoS 2,
    /// nothing for QoS 0.
    pub fn ack(self, pkid: u16, qos: Qos, buf: &mut BytesMut) -> Result<(), EncodeError> {
        match (self, qos) {
            (_, Qos::AtMostOnce) => Ok(()),
            (Codec::V5, Qos::AtLeastOnce) => {
                write_v5(&v5::Packet::PubAck(v5::PubAck::new(pkid, None)), buf, None)
            }
            (Codec::V5, Qos::ExactlyOnce) => {
                write_v5(&v5::Packet::PubRec(v5::PubRec::new(pkid, None)), buf, None)
            }
            (Codec::V311, Qos::AtLeastOnce) => {
                write_v4(&v4::Packet::PubAck(v4::PubAck::new(pkid)), buf, usize::MAX)
            }
            (Codec::V311, Qos::ExactlyOnce) => {
                write_v4(&v4::Packet::PubRec(v4::PubRec::new(pkid)), buf, usize::MAX)
            }
        }
    }

    pub fn pubrel(self, pkid: u16, buf: &mut BytesMut) -> Result<(), EncodeError> {
        match self {
            Codec::V5 => write_v5(&v5::Packet::PubRel(v5::PubRel::new(pkid, None)), buf, None),
            Codec::V311 => write_v4(&v4::Packet::PubRel(v4::PubRel::new(pkid)), buf, usize::MAX),
        }
    }

    pub fn pubcomp(self, pkid: u16, buf: &mut BytesMut) -> Result<(), EncodeError> {
        match self {
            Codec::V5 => write_v5(
                &v5::Packet::PubComp(v5::PubComp::new(pkid, None)),
                buf,
                None,
            ),
            Codec::V311 => write_v4(
                &v4::Packet::PubComp(v4::PubComp::new(pkid)),
                buf,
                usize::MAX,
            ),
        }
    }

    pub fn subscribe(
        self,
        pkid: u16,
        filters: &[(String, Qos)],
        buf: &mut BytesMut,
    ) -> Result<(), EncodeError> {
        match self {
            Codec::V5 => {
                let mut subscribe = v5::Subscribe::new_many(
                    filters
                        .iter()
                        .map(|(f, q)| v5::Filter::new(f.clone(), qos_v5(*q))),
                    None,
                );
                subscribe.pkid = pkid;
                write_v5(&v5::Packet::Subscribe(subscribe), buf, None)
            }
            Codec::V311 => {
                let mut subscribe = v4::Subscribe::new_many(
                    filters
                        .iter()
                        .map(|(f, q)| v4::SubscribeFilter::new(f.clone(), qos_v4(*q))),
                );
                subscribe.pkid = pkid;
                write_v4(&v4::Packet::Subscribe(subscribe), buf, usize::MAX)
            }
        }
    }

    pub fn pingreq(self, buf: &mut BytesMut) -> Result<(), EncodeError> {
        match self {
            Codec::V5 => write_v5(&v5::Packet::PingReq(v5::PingReq), buf, None),
            Codec::V311 => write_v4(&v4::Packet::PingReq, buf, usize::MAX),
        }
    }

    /// A normal disconnection: the broker keeps the session (v5: for the
    /// session expiry given in CONNECT).
    pub fn disconnect(self, buf: &mut BytesMut) -> Result<(), EncodeError> {
        match self {
            Codec::V5 => write_v5(
                &v5::Packet::Disconnect(v5::Disconnect::new(
                    v5::DisconnectReasonCode::NormalDisconnection,
                )),
                buf,
                None,
            ),
            Codec::V311 => write_v4(&v4::Packet::Disconnect, buf, usize::MAX),
        }
    }

    /// The next whole packet in `buf` (taken out of it), `None` when `buf`
    /// holds only part of one. An error means the connection cannot go on.
    pub fn decode(self, buf: &mut BytesMut, max: u32) -> Result<Option<Incoming>, String> {
        if buf.is_empty() {
            return Ok(None);
        }
        match self {
            Codec::V5 => {
                // Only a frame not yet whole is waited for. rumqttc's parser
                // takes the frame off the buffer before it parses it, so its
                // running out of bytes after that is a malformed packet, not a
                // short read: waiting would drop the packet without a word.
                let frame = match v5::check(buf.iter(), Some(max)) {
                    Ok(header) => header.frame_length(),
                    Err(rumqttc::v5::mqttbytes::Error::InsufficientBytes(_)) => return Ok(None),
                    Err(error) => return Err(decode_error_v5(&error)),
                };
                if let Some(reason) = short_disconnect(buf, frame) {
                    return Ok(Some(Incoming::Disconnect(reason)));
                }
                match v5::Packet::read(buf, Some(max)) {
                    Ok(packet) => Ok(Some(incoming_v5(packet))),
                    Err(error) => Err(decode_error_v5(&error)),
                }
            }
            Codec::V311 => match v4::Packet::read(buf, max as usize) {
                Ok(packet) => Ok(Some(incoming_v4(packet))),
                Err(rumqttc::mqttbytes::Error::InsufficientBytes(_)) => Ok(None),
                Err(error) => Err(decode_error_v4(&error)),
            },
        }
    }
}

/// A v5 DISCONNECT of `frame` bytes at the head of `buf` without properties
/// — no reason code (normal disconnection) or only one, as Mosquitto sends
/// it — taken off the buffer, with its reason. rumqttc refuses the first and
/// cannot parse the second (MQTT v5 §3.14.2.1 allows both).
fn short_disconnect(buf: &mut BytesMut, frame: usize) -> Option<String> {
    if buf.first() != Some(&0xe0) || frame > 3 {
        return None;
    }
    let packet = buf.split_to(frame);
    let code = packet.get(2).copied().unwrap_or(0);
    Some(match v5::DisconnectReasonCode::try_from(code) {
        Ok(reason) => format!("{reason:?}"),
        Err(_) => format!("reason code 0x{code:02X}"),
    })
}

fn write_v5(packet: &v5::Packet, buf: &mut BytesMut, max: Option<u32>) -> Result<(), EncodeError> {
    packet
        .write(buf, max)
        .map(drop)
        .map_err(|e| EncodeError(e.to_string()))
}

fn write_v4(packet: &v4::Packet, buf: &mut BytesMut, max: usize) -> Result<(), EncodeError> {
    packet
        .write(buf, max)
        .map(drop)
        .map_err(|e| EncodeError(e.to_string()))
}

/// What rumqttc's `TopicNotUtf8` means: it reports *any* string of a packet
/// that is not UTF-8 (a user property, a content type, a reason string) as the
/// topic's.
const NOT_UTF8: &str = "a string in it is not valid UTF-8 (topic or property)";

/// A v5 decoding error in words that are true. A packet that cannot be
/// decoded is the broker's fault and is named as such; rumqttc's own text
/// says "Topic not utf-8" for every non-UTF-8 string.
fn decode_error_v5(error: &rumqttc::v5::mqttbytes::Error) -> String {
    use rumqttc::v5::mqttbytes::Error;
    match error {
        Error::TopicNotUtf8 => malformed(NOT_UTF8),
        Error::PayloadSizeLimitExceeded { pkt_size, max } => {
            format!("the broker sent a packet of {pkt_size} bytes, more than the {max} accepted")
        }
        other => malformed(&other.to_string()),
    }
}

/// [`decode_error_v5`] for v3.1.1.
fn decode_error_v4(error: &rumqttc::mqttbytes::Error) -> String {
    use rumqttc::mqttbytes::Error;
    match error {
        Error::TopicNotUtf8 => malformed(NOT_UTF8),
        Error::PayloadSizeLimitExceeded(size) => {
            format!("the broker sent a packet of {size} bytes, more than accepted")
        }
        other => malformed(&other.to_string()),
    }
}

fn malformed(what: &str) -> String {
    format!("the broker sent a malformed packet: {what}")
}

fn incoming_v5(packet: v5::Packet) -> Incoming {
    match packet {
        v5::Packet::ConnAck(connack) => {
            let properties = connack.properties;
            let reason = properties.as_ref().and_then(|p| p.reason_string.clone());
            let refused = (connack.code != v5::ConnectReturnCode::Success).then(|| match reason {
                Some(reason) => format!("{:?} ({reason})", connack.code),
                None => format!("{:?}", connack.code),
            });
            Incoming::ConnAck(ConnAck {
                session_present: connack.session_present,
                refused,
                receive_maximum: properties.as_ref().and_then(|p| p.receive_max),
                max_packet_size: properties.as_ref().and_then(|p| p.max_packet_size),
                server_keep_alive: properties.as_ref().and_then(|p| p.server_keep_alive),
            })
        }
        v5::Packet::Publish(p) => Incoming::Publish(Received {
            topic: p.topic,
            qos: from_v5(p.qos),
            pkid: p.pkid,
            dup: p.dup,
            payload: p.payload,
            properties: p.properties,
        }),
        v5::Packet::PubAck(ack) => Incoming::PubAck {
            pkid: ack.pkid,
            refused: puback_error(&ack.reason, ack.properties.and_then(|p| p.reason_string)),
        },
        v5::Packet::PubRec(rec) => Incoming::PubRec {
            pkid: rec.pkid,
            refused: puback_error(
                &pubrec_reason(&rec.reason),
                rec.properties.and_then(|p| p.reason_string),
            ),
        },
        v5::Packet::PubRel(rel) => Incoming::PubRel { pkid: rel.pkid },
        v5::Packet::PubComp(comp) => Incoming::PubComp { pkid: comp.pkid },
        v5::Packet::SubAck(suback) => Incoming::SubAck {
            pkid: suback.pkid,
            refused: suback
                .return_codes
                .iter()
                .filter(|c| !matches!(c, v5::SubscribeReasonCode::Success(_)))
                .map(|c| format!("{c:?}"))
                .collect(),
        },
        v5::Packet::PingResp(_) => Incoming::PingResp,
        v5::Packet::Disconnect(d) => {
            Incoming::Disconnect(match d.properties.and_then(|p| p.reason_string) {
                Some(reason) => format!("{:?} ({reason})", d.reason_code),
                None => format!("{:?}", d.reason_code),
            })
        }
        v5::Packet::Auth(_) => Incoming::Unexpected("AUTH"),
        v5::Packet::Connect(..) => Incoming::Unexpected("CONNECT"),
        v5::Packet::PingReq(_) => Incoming::Unexpected("PINGREQ"),
        v5::Packet::Subscribe(_) => Incoming::Unexpected("SUBSCRIBE"),
        v5::Packet::Unsubscribe(_) => Incoming::Unexpected("UNSUBSCRIBE"),
        v5::Packet::UnsubAck(_) => Incoming::Unexpected("UNSUBACK"),
    }
}

fn incoming_v4(packet: v4::Packet) -> Incoming {
    match packet {
        v4::Packet::ConnAck(connack) => Incoming::ConnAck(ConnAck {
            session_present: connack.session_present,
            refused: (connack.code != v4::ConnectReturnCode::Success)
                .then(|| format!("{:?}", connack.code)),
            receive_maximum: None,
            max_packet_size: None,
            server_keep_alive: None,
        }),
        v4::Packet::Publish(p) => Incoming::Publish(Received {
            topic: Bytes::from(p.topic.into_bytes()),
            qos: from_v4(p.qos),
            pkid: p.pkid,
            dup: p.dup,
            payload: p.payload,
            properties: None,
        }),
        v4::Packet::PubAck(ack) => Incoming::PubAck {
            pkid: ack.pkid,
            refused: None,
        },
        v4::Packet::PubRec(rec) => Incoming::PubRec {
            pkid: rec.pkid,
            refused: None,
        },
        v4::Packet::PubRel(rel) => Incoming::PubRel { pkid: rel.pkid },
        v4::Packet::PubComp(comp) => Incoming::PubComp { pkid: comp.pkid },
        v4::Packet::SubAck(suback) => Incoming::SubAck {
            pkid: suback.pkid,
            refused: suback
                .return_codes
                .iter()
                .filter(|c| !matches!(c, v4::SubscribeReasonCode::Success(_)))
                .map(|c| format!("{c:?}"))
                .collect(),
        },
        v4::Packet::PingResp => Incoming::PingResp,
        v4::Packet::Disconnect => Incoming::Unexpected("DISCONNECT"),
        v4::Packet::Connect(_) => Incoming::Unexpected("CONNECT"),
        v4::Packet::PingReq => Incoming::Unexpected("PINGREQ"),
        v4::Packet::Subscribe(_) => Incoming::Unexpected("SUBSCRIBE"),
        v4::Packet::Unsubscribe(_) => Incoming::Unexpected("UNSUBSCRIBE"),
        v4::Packet::UnsubAck(_) => Incoming::Unexpected("UNSUBACK"),
    }
}

/// PUBREC and PUBACK share their reason codes.
fn pubrec_reason(reason: &v5::PubRecReason) -> v5::PubAckReason {
    use v5::{PubAckReason as A, PubRecReason as R};
    match reason {
        R::Success => A::Success,
        R::NoMatchingSubscribers => A::NoMatchingSubscribers,
        R::UnspecifiedError => A::UnspecifiedError,
        R::ImplementationSpecificError => A::ImplementationSpecificError,
        R::NotAuthorized => A::NotAuthorized,
        R::TopicNameInvalid => A::TopicNameInvalid,
        R::PacketIdentifierInUse => A::PacketIdentifierInUse,
        R::QuotaExceeded => A::QuotaExceeded,
        R::PayloadFormatInvalid => A::PayloadFormatInvalid,
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

fn qos_v4(qos: Qos) -> rumqttc::mqttbytes::QoS {
    use rumqttc::mqttbytes::QoS;
    match qos {
        Qos::AtMostOnce => QoS::AtMostOnce,
        Qos::AtLeastOnce => QoS::AtLeastOnce,
        Qos::ExactlyOnce => QoS::ExactlyOnce,
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

fn from_v4(qos: rumqttc::mqttbytes::QoS) -> Qos {
    use rumqttc::mqttbytes::QoS;
    match qos {
        QoS::AtMostOnce => Qos::AtMostOnce,
        QoS::AtLeastOnce => Qos::AtLeastOnce,
        QoS::ExactlyOnce => Qos::ExactlyOnce,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transports::mqtt::publish::Publish;

    #[test]
    fn a_non_utf8_string_is_a_malformed_packet_not_a_topic() {
        use rumqttc::v5::mqttbytes::Error;
        assert_eq!(
            decode_error_v5(&Error::TopicNotUtf8),
            "the broker sent a malformed packet: a string in it is not valid UTF-8 (topic or property)"
        );
        assert!(
            decode_error_v5(&Error::MalformedPacket)
                .starts_with("the broker sent a malformed packet")
        );
        assert!(
            decode_error_v4(&rumqttc::mqttbytes::Error::TopicNotUtf8).contains("topic or property")
        );
    }

    /// A DISCONNECT without properties, as Mosquitto sends it (reason code
    /// only) or with nothing at all, is the broker's DISCONNECT with its
    /// reason; one with properties still goes through rumqttc.
    #[test]
    fn short_disconnects_carry_their_reason() {
        let cases: [(&[u8], &str); 4] = [
            (&[0xe0, 0x00], "NormalDisconnection"),
            (&[0xe0, 0x01, 0x8e], "SessionTakenOver"),
            (&[0xe0, 0x01, 0x8b], "ServerShuttingDown"),
            (&[0xe0, 0x02, 0x8b, 0x00], "ServerShuttingDown"),
        ];
        for (bytes, reason) in cases {
            let mut buf = BytesMut::from(bytes);
            buf.extend_from_slice(&[0xd0, 0x00]); // a PINGRESP behind it
            match Codec::V5.decode(&mut buf, 1024) {
                Ok(Some(Incoming::Disconnect(r))) => assert_eq!(r, reason, "{bytes:?}"),
                other => panic!("{bytes:?}: {other:?}"),
            }
            assert!(matches!(
                Codec::V5.decode(&mut buf, 1024),
                Ok(Some(Incoming::PingResp))
            ));
        }
        // Half a DISCONNECT waits for the rest.
        assert!(matches!(
            Codec::V5.decode(&mut BytesMut::from(&[0xe0, 0x01][..]), 1024),
            Ok(None)
        ));
    }

    /// A whole frame rumqttc cannot parse is a malformed packet: it is not
    /// waited for (the frame is already off the buffer).
    #[test]
    fn a_whole_frame_that_cannot_be_parsed_is_malformed() {
        // A SUBACK of remaining length 1: its packet id is cut short.
        let mut buf = BytesMut::from(&[0x90, 0x01, 0x00][..]);
        assert!(matches!(
            Codec::V5.decode(&mut buf, 1024),
            Err(e) if e.starts_with("the broker sent a malformed packet")
        ));
    }

    /// A publish the client writes decodes back (the broker's view), and
    /// half a packet is not a packet yet.
    #[test]
    fn packets_round_trip_and_partial_input_waits() {
        let envelope = crate::stores::conformance::envelope("a");
        let now = std::time::SystemTime::now();
        for codec in [Codec::V5, Codec::V311] {
            let publish = match codec {
                Codec::V5 => Publish::v5("a/b", Qos::AtLeastOnce, false, &envelope, now),
                Codec::V311 => Publish::v311("a/b", Qos::AtLeastOnce, false, &envelope, now),
            };
            let mut buf = BytesMut::new();
            publish.expect("a valid publish").write(7, &mut buf);
            let whole = buf.clone();
            let mut half = BytesMut::from(&whole[..whole.len() / 2]);
            assert!(matches!(codec.decode(&mut half, 1024), Ok(None)));
            match codec.decode(&mut buf, 1024) {
                Ok(Some(Incoming::Publish(p))) => {
                    assert_eq!((p.pkid, &p.payload), (7, &envelope.payload));
                }
                other => panic!("{codec:?}: {other:?}"),
            }
            assert!(buf.is_empty());
        }
    }
}
