//! The SQS and SNS sender: pinned to one queue or topic (its [`Target`]),
//! concurrent sends coalesced into batch calls ([`batch`](super::batch)).
//!
//! - The binding address must name the target (a queue's bare name or URL, a
//!   topic's bare name or ARN); the validator refuses anything else, and a
//!   send to another address fails permanently.
//! - A message is checked before it is queued ([`message`](super::message)):
//!   what the service would refuse for its size, text or FIFO group fails at
//!   once, permanently, without spending a batch entry.
//! - Every send is bounded by the route's `send_timeout`: on expiry it
//!   resolves with [`SendError::Timeout`] (its entry may still be sent).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use ferry_shared::config::GroupId;
use ferry_shared::envelope::Envelope;
use tokio::sync::watch;

use super::batch::{BatchSink, Batcher};
use super::message::outgoing;
use super::session::Shared;
use crate::transports::{Address, SendError, SendFuture, Sender};

/// The queue or topic a sender is pinned to, and its batch call.
pub(crate) trait Target: BatchSink {
    /// `queue NAME` / `topic NAME`, for error texts.
    fn describe(&self) -> String;
    /// A FIFO queue or topic.
    fn is_fifo(&self) -> bool;
    /// Whether a binding address names this target.
    fn matches(&self, address: &str) -> bool;
}

/// Sends to one SQS queue or SNS topic.
pub struct AwsSender {
    target: Arc<dyn Target>,
    group_id: Option<GroupId>,
    send_timeout: Duration,
    batcher: Batcher,
    connected: watch::Receiver<bool>,
}

impl AwsSender {
    /// A sender on `shared`'s session to `target`; `group_id`: the FIFO
    /// group id rule; `send_timeout`: the bound of one send.
    pub(crate) fn new(
        shared: &Shared,
        target: impl Target,
        group_id: Option<GroupId>,
        send_timeout: Duration,
    ) -> Self {
        let target: Arc<dyn Target> = Arc::new(target);
        let batcher = Batcher::start(Arc::clone(&target), shared.token.clone(), |task| {
            shared.spawn(task);
        });
        Self {
            target,
            group_id,
            send_timeout,
            batcher,
            connected: shared.connected(),
        }
    }

    async fn send(&self, envelope: &Envelope, address: &Address) -> Result<(), SendError> {
        if !self.target.matches(address.as_str()) {
            return Err(SendError::Permanent(format!(
                "{address} is not the {} this sender is pinned to",
                self.target.describe()
            )));
        }
        let message = outgoing(
            envelope,
            self.target.is_fifo(),
            self.group_id.as_ref(),
            SystemTime::now(),
        )?;
        tokio::time::timeout(self.send_timeout, self.batcher.send(message))
            .await
            .unwrap_or(Err(SendError::Timeout(self.send_timeout)))
    }
}

impl Sender for AwsSender {
    fn send<'a>(&'a self, envelope: &'a Envelope, address: &'a Address) -> SendFuture<'a> {
        Box::pin(AwsSender::send(self, envelope, address))
    }

    fn connected(&self) -> watch::Receiver<bool> {
        self.connected.clone()
    }
}
