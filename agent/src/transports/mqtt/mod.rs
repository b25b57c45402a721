//! MQTT transport: sessions, a receiver and senders, on a client of our own.
//!
//! - [`MqttSession`] owns one connection (v5 by default, v3.1.1 as an option;
//!   `tcp://`, TLS `ssl://` or a local broker's `unix://` socket), polls its
//!   event loop in a task until the shutdown token fires, reconnects with
//!   backoff and publishes its connected state.
//!   [`MqttSession::start_with_receiver`] adds a [`MqttReceiver`];
//!   [`MqttSession::sender`] makes [`MqttSender`]s.
//! - The receiver acknowledges in receive order, only after settle; see
//!   `receiver` for the invariants. The sender resolves on the PUBACK of its own
//!   publish; see `sender`.
//! - `eventloop` owns each session's socket and batches its writes (ADR 0008),
//!   and `low_water` its reads of the broker's answers (ADR 0019);
//!   `protocol` is the request queue and the events between it and the
//!   session; `codec` encodes and decodes packets of both versions on
//!   rumqttc's `mqttbytes`, except the publishes Ferry sends, which
//!   `publish` encodes from the envelope; `properties` maps the properties of
//!   a received publish to the envelope; `tls` builds the rustls
//!   configuration.
//!
//! A session meant to receive should keep `clean_start` off with a session
//! expiry, so the broker holds QoS 1 messages while the agent is down. Cancel a
//! session's token only after the routes using it have stopped: settles that
//! arrive after the session stopped are no-ops (the broker redelivers).

mod codec;
mod eventloop;
mod low_water;
mod packet_ids;
mod properties;
mod protocol;
mod publish;
mod receiver;
mod sender;
mod session;
mod settings;
mod tls;

pub use properties::{TRACEPARENT_HEADER, TRACESTATE_HEADER};
pub use receiver::MqttReceiver;
pub use sender::MqttSender;
pub use session::MqttSession;
pub use settings::{
    MQTT_MAX_PACKET_BYTES, MqttReceiverSettings, MqttSenderSettings, MqttSessionSettings, Protocol,
    Qos, SettingsError,
};
