//! The SQS receiver: long polling, a visibility heartbeat while a message is
//! held, deletes in batches after settle.
//!
//! Invariants:
//!
//! - **Back-pressure: no receive call while the route has no room.** The
//!   delivery channel holds one receive's worth (`max_messages`); the poller
//!   reserves that many slots before each `ReceiveMessage`, and the route
//!   takes a delivery only while it has room in flight. So a full route
//!   stops the polling, and what SQS hands out is at most `max_messages`
//!   beyond the route's window.
//! - **A message is deleted only after its delivery was settled with an
//!   outcome that acknowledges**, in `DeleteMessageBatch` calls of up to ten.
//!   A delete that fails transiently is retried on the next heartbeat tick,
//!   and the message stays under the heartbeat meanwhile; if it reappears
//!   anyway it is delivered again (at-least-once).
//! - **A non-acknowledging outcome makes the message visible again at once**
//!   (`ChangeMessageVisibility` to 0), so SQS redelivers it without waiting
//!   out the timeout. If that call fails, the timeout does the same later.
//! - **While held, a message stays invisible**: every message from receive to
//!   delete is extended to a full visibility timeout (the session's
//!   `visibility_timeout`, else the queue's own `VisibilityTimeout`) once a
//!   third of it has passed, so a slow destination does not make SQS hand it
//!   to another consumer. A third rather than half: the call itself takes
//!   time on a loaded service, and a short timeout leaves little room. If
//!   the agent dies, the extensions stop and each held message reappears
//!   within one timeout.
//! - `ApproximateReceiveCount` above one marks a delivery as redelivered;
//!   the id of every delivery of a message is its SQS message id. A message
//!   received more than `max_receives` times (the route's
//!   `max_replay_attempts` + 1), or for the last time the queue's redrive
//!   policy allows (`maxReceiveCount`; the first receive is always tried), is
//!   delivered with
//!   [`Defect::TooManyReceives`]: the route dead-letters it (poison) before
//!   SQS would move it to the queue's own dead-letter queue.
//! - The poller and the keeper (heartbeat, deletes) stop with the session;
//!   the keeper first deletes what was acknowledged and releases what is
//!   still held. A settle after that is a no-op (the message reappears).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, DeleteMessageBatchRequestEntry, Message,
    MessageSystemAttributeName, QueueAttributeName,
};
use ferry_shared::envelope::{Envelope, Source};
use prost::bytes::Bytes;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::batch::{MAX_ENTRIES, entry_id};
use super::error::{AwsError, classify};
use super::message::incoming;
use super::queue::Queue;
use super::session::Shared;
use crate::transports::{Defect, Delivery, Receiver, RecvFuture, SettleHandle};

/// The shortest heartbeat tick.
const MIN_TICK: Duration = Duration::from_millis(250);
/// Backoff bounds after a failed call of the poller.
const RETRY_FIRST: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(10);

/// An SQS receiver's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SqsReceiverSettings {
    /// The queue, by name or URL.
    pub queue: String,
    /// Long-poll wait per receive call (whole seconds, up to 20).
    pub wait_time: Duration,
    /// Visibility timeout of received messages; `None`: the queue's own.
    pub visibility_timeout: Option<Duration>,
    /// Messages per receive call, 1–10.
    pub max_messages: u8,
    /// Larger bodies are delivered with a [`Defect::Oversized`].
    pub max_payload_bytes: usize,
    /// A message received more often is delivered with a
    /// [`Defect::TooManyReceives`].
    pub max_receives: u32,
}

/// Receives the messages of one queue.
#[derive(Debug)]
pub struct SqsReceiver {
    deliveries: mpsc::Receiver<Delivery>,
}

impl SqsReceiver {
    /// Starts the poller on `shared`'s session.
    pub(crate) fn start(shared: &Arc<Shared>, settings: SqsReceiverSettings) -> Self {
        let max = usize::from(settings.max_messages.clamp(1, 10));
        let (tx, deliveries) = mpsc::channel(max);
        let poller = Poller {
            shared: Arc::clone(shared),
            queue: Queue::new(&settings.queue),
            settings,
            max,
        };
        shared.spawn(poller.run(tx));
        Self { deliveries }
    }
}

impl Receiver for SqsReceiver {
    fn recv(&mut self) -> RecvFuture<'_> {
        Box::pin(self.deliveries.recv())
    }
}

/// From the poller and the settle handles to the keeper.
#[derive(Debug)]
enum Event {
    /// A message was received (before its delivery is handed out).
    Held(String),
    /// A delivery was settled; `true`: delete it.
    Settled(String, bool),
}

struct Poller {
    shared: Arc<Shared>,
    queue: Queue,
    settings: SqsReceiverSettings,
    max: usize,
}

impl Poller {
    async fn run(self, tx: mpsc::Sender<Delivery>) {
        let token = self.shared.token.clone();
        let resolved = tokio::select! {
            () = token.cancelled() => None,
            resolved = self.resolve() => Some(resolved),
        };
        let Some(Resolved {
            url,
            visibility,
            redrive_max,
        }) = resolved
        else {
            return;
        };
        // SQS moves a message away instead of handing it out once more when
        // its receive count would pass `maxReceiveCount`: the receive before
        // that is Ferry's last chance (but the first is always tried).
        let max_receives = match redrive_max {
            Some(m) => self.settings.max_receives.min(m.saturating_sub(1).max(1)),
            None => self.settings.max_receives,
        };
        let (events, rx) = mpsc::unbounded_channel();
        let keeper = Keeper {
            shared: Arc::clone(&self.shared),
            url: url.clone(),
            visibility,
            held: HashMap::new(),
            deletes: Vec::new(),
        };
        self.shared.spawn(keeper.run(rx));
        let mut backoff = RETRY_FIRST;
        loop {
            let permits = tokio::select! {
                () = token.cancelled() => return,
                permits = tx.reserve_many(self.max) => match permits {
                    Ok(permits) => permits,
                    Err(_) => return, // the route is gone
                },
            };
            let received = tokio::select! {
                () = token.cancelled() => return,
                received = self.receive(&url) => received,
            };
            self.shared.observed(&received);
            let messages = match received {
                Ok(messages) => {
                    backoff = RETRY_FIRST;
                    messages
                }
                Err(e) => {
                    tracing::warn!(queue = %self.queue.name(), error = %e.error, "receiving failed");
                    drop(permits);
                    if !sleep_or_cancel(&token, backoff).await {
                        return;
                    }
                    backoff = (backoff * 2).min(RETRY_MAX);
                    continue;
                }
            };
            for (permit, message) in permits.zip(messages) {
                if let Some(delivery) = self.delivery(message, max_receives, &events) {
                    permit.send(delivery);
                }
            }
        }
    }

    /// The queue URL, the visibility timeout to extend by and the redrive
    /// limit, retried until the service answers.
    async fn resolve(&self) -> Resolved {
        let mut backoff = RETRY_FIRST;
        loop {
            match self.try_resolve().await {
                Ok(resolved) => return resolved,
                Err(e) => {
                    tracing::warn!(queue = %self.queue.name(), error = %e.error, "cannot resolve the queue");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(RETRY_MAX);
                }
            }
        }
    }

    async fn try_resolve(&self) -> Result<Resolved, AwsError> {
        let url = self.queue.url(&self.shared).await?.to_owned();
        let result = self
            .shared
            .sqs()
            .await
            .get_queue_attributes()
            .queue_url(&url)
            .attribute_names(QueueAttributeName::VisibilityTimeout)
            .attribute_names(QueueAttributeName::RedrivePolicy)
            .send()
            .await
            .map_err(|e| classify("GetQueueAttributes", &e));
        self.shared.observed(&result);
        let out = result?;
        let attribute = |name: &QueueAttributeName| out.attributes().and_then(|a| a.get(name));
        let queue_visibility = attribute(&QueueAttributeName::VisibilityTimeout)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(30);
        let visibility = self
            .settings
            .visibility_timeout
            .unwrap_or(Duration::from_secs(queue_visibility.max(1)));
        let redrive_max = attribute(&QueueAttributeName::RedrivePolicy)
            .and_then(|policy| max_receive_count(policy));
        Ok(Resolved {
            url,
            visibility,
            redrive_max,
        })
    }

    async fn receive(&self, url: &str) -> Result<Vec<Message>, AwsError> {
        let secs = |d: Duration| i32::try_from(d.as_secs()).unwrap_or(i32::MAX);
        self.shared
            .sqs()
            .await
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(i32::try_from(self.max).unwrap_or(10))
            .wait_time_seconds(secs(self.settings.wait_time))
            .set_visibility_timeout(self.settings.visibility_timeout.map(secs))
            .message_attribute_names("All")
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .send()
            .await
            .map(|out| out.messages.unwrap_or_default())
            .map_err(|e| classify("ReceiveMessage", &e))
    }

    fn delivery(
        &self,
        message: Message,
        max_receives: u32,
        events: &mpsc::UnboundedSender<Event>,
    ) -> Option<Delivery> {
        let receipt = message.receipt_handle?;
        let receive_count = message
            .attributes
            .as_ref()
            .and_then(|a| a.get(&MessageSystemAttributeName::ApproximateReceiveCount))
            .and_then(|c| c.parse::<u32>().ok())
            .unwrap_or(1);
        let attributes = message
            .message_attributes
            .unwrap_or_default()
            .into_iter()
            .filter(|(_, v)| v.data_type.starts_with("String") || v.data_type.starts_with("Number"))
            .filter_map(|(k, v)| v.string_value.map(|s| (k, s)));
        let (headers, trace) = incoming(attributes);
        let payload = Bytes::from(message.body.unwrap_or_default());
        let defect = if payload.len() > self.settings.max_payload_bytes {
            Some(Defect::Oversized {
                size: payload.len(),
                limit: self.settings.max_payload_bytes,
            })
        } else if receive_count > max_receives {
            Some(Defect::TooManyReceives {
                receives: receive_count,
                limit: max_receives,
            })
        } else {
            None
        };
        let envelope = Envelope {
            id: message.message_id.unwrap_or_else(crate::ids::new_id),
            headers,
            payload,
            content_type: None,
            source: Source {
                transport: "sqs".into(),
                session_id: self.shared.settings.id.clone(),
                address: self.queue.configured().to_owned(),
                received_at: SystemTime::now(),
            },
            expires_at: None,
            trace,
        };
        events.send(Event::Held(receipt.clone())).ok();
        let settled = events.clone();
        Some(Delivery {
            envelope,
            defect,
            redelivered: receive_count > 1,
            source_retries: false,
            settle: SettleHandle::new(move |outcome| {
                settled
                    .send(Event::Settled(receipt, outcome.acknowledges()))
                    .ok();
            }),
        })
    }
}

/// What the poller learns about its queue before polling.
struct Resolved {
    url: String,
    visibility: Duration,
    /// The redrive policy's `maxReceiveCount`, when the queue has one.
    redrive_max: Option<u32>,
}

/// `maxReceiveCount` of a `RedrivePolicy` attribute
/// (`{"deadLetterTargetArn":"…","maxReceiveCount":"5"}`; the count may be a
/// string or a number).
fn max_receive_count(policy: &str) -> Option<u32> {
    let value: serde_json::Value = serde_json::from_str(policy).ok()?;
    match value.get("maxReceiveCount")? {
        serde_json::Value::String(s) => s.parse().ok(),
        serde_json::Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
        _ => None,
    }
}

/// Sleeps `d`; false when the token fired first.
async fn sleep_or_cancel(token: &tokio_util::sync::CancellationToken, d: Duration) -> bool {
    tokio::select! {
        () = token.cancelled() => false,
        () = tokio::time::sleep(d) => true,
    }
}

/// Heartbeat, deletes and releases of one receiver's held messages.
struct Keeper {
    shared: Arc<Shared>,
    url: String,
    visibility: Duration,
    /// Receipt handle → when its visibility was last set.
    held: HashMap<String, Instant>,
    /// Acknowledged, not deleted yet (still held).
    deletes: Vec<String>,
}

impl Keeper {
    async fn run(mut self, mut events: mpsc::UnboundedReceiver<Event>) {
        let token = self.shared.token.clone();
        let mut tick = tokio::time::interval((self.visibility / 6).max(MIN_TICK));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let mut releases = Vec::new();
            tokio::select! {
                () = token.cancelled() => break,
                event = events.recv() => {
                    let Some(event) = event else { break };
                    self.apply(event, &mut releases);
                    while let Ok(event) = events.try_recv() {
                        self.apply(event, &mut releases);
                    }
                }
                _ = tick.tick() => self.heartbeat().await,
            }
            self.release(releases).await;
            self.delete().await;
        }
        // Stopping: what was acknowledged is deleted, the rest released.
        let mut releases = Vec::new();
        while let Ok(event) = events.try_recv() {
            self.apply(event, &mut releases);
        }
        self.delete().await;
        releases.extend(
            self.held
                .keys()
                .filter(|h| !self.deletes.contains(h))
                .cloned(),
        );
        self.release(releases).await;
    }

    fn apply(&mut self, event: Event, releases: &mut Vec<String>) {
        match event {
            Event::Held(receipt) => {
                self.held.insert(receipt, Instant::now());
            }
            Event::Settled(receipt, true) => {
                if self.held.contains_key(&receipt) {
                    self.deletes.push(receipt);
                }
            }
            Event::Settled(receipt, false) => {
                if self.held.remove(&receipt).is_some() {
                    releases.push(receipt);
                }
            }
        }
    }

    /// Deletes the acknowledged messages; what fails transiently stays for
    /// the next round.
    async fn delete(&mut self) {
        let pending = std::mem::take(&mut self.deletes);
        for chunk in pending.chunks(MAX_ENTRIES) {
            let entries = chunk
                .iter()
                .enumerate()
                .filter_map(|(i, h)| {
                    DeleteMessageBatchRequestEntry::builder()
                        .id(entry_id(i))
                        .receipt_handle(h)
                        .build()
                        .ok()
                })
                .collect();
            let result = self
                .shared
                .sqs()
                .await
                .delete_message_batch()
                .queue_url(&self.url)
                .set_entries(Some(entries))
                .send()
                .await
                .map_err(|e| classify("DeleteMessageBatch", &e));
            self.shared.observed(&result);
            match result {
                Err(e) => {
                    tracing::warn!(error = %e.error, "deleting received messages failed; retrying");
                    self.deletes.extend(chunk.iter().cloned());
                }
                Ok(out) => {
                    let mut failed = vec![false; chunk.len()];
                    for f in out.failed() {
                        let Some(i) = f.id().parse::<usize>().ok().filter(|i| *i < chunk.len())
                        else {
                            continue;
                        };
                        if f.sender_fault() {
                            // The receipt handle expired: the message is
                            // visible again and will be delivered again.
                            tracing::warn!(
                                code = f.code(),
                                "a received message could not be deleted"
                            );
                        } else {
                            failed[i] = true;
                        }
                    }
                    for (handle, failed) in chunk.iter().zip(failed) {
                        if failed {
                            self.deletes.push(handle.clone());
                        } else {
                            self.held.remove(handle);
                        }
                    }
                }
            }
        }
    }

    /// Makes `receipts` visible again at once.
    async fn release(&self, receipts: Vec<String>) {
        for chunk in receipts.chunks(MAX_ENTRIES) {
            if let Err(e) = self.change_visibility(chunk, 0).await {
                tracing::debug!(error = %e.error, "releasing messages failed; they reappear after their timeout");
            }
        }
    }

    /// Extends every held message whose last extension is a third of a
    /// timeout old.
    async fn heartbeat(&mut self) {
        let now = Instant::now();
        let due: Vec<String> = self
            .held
            .iter()
            .filter(|(_, at)| now.duration_since(**at) >= self.visibility / 3)
            .map(|(h, _)| h.clone())
            .collect();
        let secs = i32::try_from(self.visibility.as_secs()).unwrap_or(i32::MAX);
        for chunk in due.chunks(MAX_ENTRIES) {
            match self.change_visibility(chunk, secs).await {
                Ok(failed) => {
                    for (i, handle) in chunk.iter().enumerate() {
                        if !failed.contains(&i)
                            && let Some(at) = self.held.get_mut(handle)
                        {
                            *at = now;
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e.error, "extending the visibility of held messages failed")
                }
            }
        }
    }

    /// Sets the visibility timeout of `receipts`; the indexes that failed.
    async fn change_visibility(
        &self,
        receipts: &[String],
        secs: i32,
    ) -> Result<Vec<usize>, AwsError> {
        let entries = receipts
            .iter()
            .enumerate()
            .filter_map(|(i, h)| {
                ChangeMessageVisibilityBatchRequestEntry::builder()
                    .id(entry_id(i))
                    .receipt_handle(h)
                    .visibility_timeout(secs)
                    .build()
                    .ok()
            })
            .collect();
        let result = self
            .shared
            .sqs()
            .await
            .change_message_visibility_batch()
            .queue_url(&self.url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(|e| classify("ChangeMessageVisibilityBatch", &e));
        self.shared.observed(&result);
        Ok(result?
            .failed()
            .iter()
            .filter_map(|f| {
                tracing::debug!(
                    code = f.code(),
                    "changing the visibility of a message failed"
                );
                f.id().parse::<usize>().ok()
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redrive_policy_limits() {
        let arn = "arn:aws:sqs:us-east-1:123456789012:dlq";
        let as_string = format!(r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":"4"}}"#);
        assert_eq!(max_receive_count(&as_string), Some(4));
        let as_number = format!(r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":7}}"#);
        assert_eq!(max_receive_count(&as_number), Some(7));
        assert_eq!(max_receive_count("{}"), None);
        assert_eq!(max_receive_count("not json"), None);
    }
}
