//! The RabbitMQ sender: a send resolves on the broker's publisher confirm.
//!
//! - The address is `EXCHANGE/ROUTING_KEY` ([`amqp_address`]); a malformed one is a permanent
//!   error.
//! - A publish is written under the session's publishing lock, so sends leave in the order
//!   they were started and each confirm matches its own delivery tag; the confirm is awaited
//!   outside the lock, so many confirms are outstanding at once.
//! - Outcomes (decided by the session's confirm collector, `confirms`): an ack is acceptance;
//!   a returned message (`mandatory` and no queue bound for the routing key) is a permanent
//!   error, the broker dropped the message; a nack is transient (the broker could not take it now); a lost connection or a
//!   closed channel before the confirm is transient, and the message may or may not have
//!   arrived; no channel (disconnected) fails at once, transient; every send is bounded by
//!   `send_timeout`.

use std::sync::Arc;
use std::time::SystemTime;

use ferry_shared::address::amqp_address;
use ferry_shared::envelope::Envelope;
use lapin::options::BasicPublishOptions;
use lapin::types::ShortString;
use tokio::sync::{oneshot, watch};
use tokio::time::{Instant, timeout_at};

use super::RabbitmqSenderSettings;
use super::confirms::Awaiting;
use super::properties::properties_for;
use super::session::Link;
use crate::transports::{Address, SendError, SendFuture, Sender};

/// Publishes envelopes on one RabbitMQ session. Cheap to clone.
#[derive(Clone, Debug)]
pub struct RabbitmqSender {
    link: Arc<Link>,
    settings: RabbitmqSenderSettings,
    connected: watch::Receiver<bool>,
}

impl RabbitmqSender {
    pub(crate) fn new(
        link: Arc<Link>,
        settings: RabbitmqSenderSettings,
        connected: watch::Receiver<bool>,
    ) -> Self {
        Self {
            link,
            settings,
            connected,
        }
    }

    /// Publishes `envelope` to `address` (`EXCHANGE/ROUTING_KEY`) and resolves on its confirm.
    pub async fn send(&self, envelope: &Envelope, address: &Address) -> Result<(), SendError> {
        let timeout = self.settings.send_timeout;
        let deadline = Instant::now() + timeout;
        let (exchange, routing_key) =
            amqp_address(address.as_str()).map_err(SendError::Permanent)?;
        let (exchange, routing_key) = (
            ShortString::try_new(exchange).map_err(|e| SendError::Permanent(e.to_string()))?,
            ShortString::try_new(routing_key).map_err(|e| SendError::Permanent(e.to_string()))?,
        );
        let properties = properties_for(envelope, SystemTime::now())?;
        let options = BasicPublishOptions {
            mandatory: self.settings.mandatory,
            immediate: false,
        };
        let key = (
            envelope.id.clone(),
            exchange.to_string(),
            routing_key.to_string(),
        );
        let confirm = {
            let Ok(_order) = timeout_at(deadline, self.link.publishing.lock()).await else {
                return Err(SendError::Timeout(timeout));
            };
            let channel = self
                .link
                .channel()
                .ok_or_else(|| SendError::Transient("not connected to rabbitmq".into()))?;
            let publish = channel.basic_publish(
                exchange,
                routing_key,
                options,
                &envelope.payload,
                properties,
            );
            match timeout_at(deadline, publish).await {
                Err(_) => return Err(SendError::Timeout(timeout)),
                Ok(Err(e)) => return Err(SendError::Transient(format!("publish failed: {e}"))),
                Ok(Ok(confirm)) => confirm,
            }
        };
        let (reply, decided) = oneshot::channel();
        self.link
            .confirms
            .send(Awaiting {
                key,
                confirm,
                reply,
            })
            .map_err(|_| SendError::Transient("the rabbitmq session stopped".into()))?;
        match timeout_at(deadline, decided).await {
            Err(_) => Err(SendError::Timeout(timeout)),
            Ok(Err(_)) => Err(SendError::Transient("the rabbitmq session stopped".into())),
            Ok(Ok(outcome)) => outcome,
        }
    }
}

impl Sender for RabbitmqSender {
    fn send<'a>(&'a self, envelope: &'a Envelope, address: &'a Address) -> SendFuture<'a> {
        Box::pin(RabbitmqSender::send(self, envelope, address))
    }

    fn connected(&self) -> watch::Receiver<bool> {
        self.connected.clone()
    }
}
