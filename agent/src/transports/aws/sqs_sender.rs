//! SQS as a [`Target`] of an [`AwsSender`](super::sender::AwsSender): one
//! queue, one `SendMessageBatch` call per batch.
//!
//! The queue URL is resolved on the first batch (`GetQueueUrl`) and kept;
//! a failure to resolve fails that batch's entries with its error (a
//! non-existent queue is permanent). Each entry's failure is its own: the
//! service's per-entry code decides transient or permanent, and the code is
//! kept in the error text, so it reaches the DLQ entry.

use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};
use futures::future::BoxFuture;

use super::batch::{BatchSink, entry_id, results};
use super::error::{classify, entry_error};
use super::message::{Outgoing, STRING};
use super::queue::Queue;
use super::sender::Target;
use super::session::Shared;
use crate::transports::SendError;

/// Sends batches to one SQS queue.
pub(crate) struct SqsSink {
    shared: Arc<Shared>,
    queue: Queue,
    delay: Option<i32>,
}

impl SqsSink {
    /// The sink of `queue` (name or URL); `delay`: per-message delay.
    pub fn new(shared: &Arc<Shared>, queue: &str, delay: Option<Duration>) -> Self {
        Self {
            shared: Arc::clone(shared),
            queue: Queue::new(queue),
            delay: delay.map(|d| i32::try_from(d.as_secs()).unwrap_or(i32::MAX)),
        }
    }

    fn entry(&self, index: usize, m: &Outgoing) -> Result<SendMessageBatchRequestEntry, SendError> {
        let mut entry = SendMessageBatchRequestEntry::builder()
            .id(entry_id(index))
            .message_body(&m.body)
            .set_message_group_id(m.group_id.clone())
            .set_message_deduplication_id(m.dedup_id.clone())
            .set_delay_seconds(self.delay);
        for (name, value) in &m.attributes {
            let value = MessageAttributeValue::builder()
                .data_type(STRING)
                .string_value(value)
                .build()
                .map_err(|e| SendError::Permanent(e.to_string()))?;
            entry = entry.message_attributes(name, value);
        }
        entry
            .build()
            .map_err(|e| SendError::Permanent(e.to_string()))
    }

    async fn send(&self, batch: &[Outgoing]) -> Vec<Result<(), SendError>> {
        let url = match self.queue.url(&self.shared).await {
            Ok(url) => url,
            Err(e) => return vec![Err(e.error); batch.len()],
        };
        let mut entries = Vec::with_capacity(batch.len());
        let mut refused = Vec::new();
        for (i, m) in batch.iter().enumerate() {
            match self.entry(i, m) {
                Ok(entry) => entries.push(entry),
                Err(e) => refused.push((entry_id(i), e)),
            }
        }
        if entries.is_empty() {
            return results(batch.len(), [], refused);
        }
        let result = self
            .shared
            .sqs()
            .await
            .send_message_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(|e| classify("SendMessageBatch", &e));
        self.shared.observed(&result);
        match result {
            Err(e) => vec![Err(e.error); batch.len()],
            Ok(out) => results(
                batch.len(),
                out.successful().iter().map(|s| s.id().to_owned()),
                out.failed()
                    .iter()
                    .map(|f| {
                        (
                            f.id().to_owned(),
                            entry_error(f.code(), f.sender_fault(), f.message()),
                        )
                    })
                    .chain(refused),
            ),
        }
    }
}

impl BatchSink for SqsSink {
    fn send_batch<'a>(
        &'a self,
        batch: &'a [Outgoing],
    ) -> BoxFuture<'a, Vec<Result<(), SendError>>> {
        Box::pin(self.send(batch))
    }
}

impl Target for SqsSink {
    fn describe(&self) -> String {
        format!("queue {}", self.queue.name())
    }

    fn is_fifo(&self) -> bool {
        self.queue.is_fifo()
    }

    fn matches(&self, address: &str) -> bool {
        self.queue.matches(address)
    }
}
