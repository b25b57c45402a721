//! SNS as a [`Target`] of an [`AwsSender`](super::sender::AwsSender): one
//! topic, one `PublishBatch` call per batch.
//!
//! A topic named by ARN is used as it is. A topic named by name is looked up
//! with `ListTopics` on the first batch (nothing is created) and its ARN
//! kept; a `NotFound` answer forgets it, so the next batch looks it up again
//! (a topic deleted and created again). A name no topic has is a permanent
//! `NotFound`. Each entry's failure is its own, with the service's code in
//! the error text.

use std::sync::{Arc, Mutex};

use aws_sdk_sns::types::{MessageAttributeValue, PublishBatchRequestEntry};
use futures::future::BoxFuture;

use super::batch::{BatchSink, entry_id, results};
use super::error::{AwsError, classify, entry_error};
use super::message::{Outgoing, STRING};
use super::sender::Target;
use super::session::Shared;
use crate::transports::SendError;

/// Sends batches to one SNS topic.
pub(crate) struct SnsSink {
    shared: Arc<Shared>,
    /// `topic_arn`, or `topic_name` to look up.
    configured: String,
    arn: Mutex<Option<String>>,
}

impl SnsSink {
    /// The sink of the topic `arn_or_name`.
    pub fn new(shared: &Arc<Shared>, arn_or_name: &str) -> Self {
        let arn = is_arn(arn_or_name).then(|| arn_or_name.to_owned());
        Self {
            shared: Arc::clone(shared),
            configured: arn_or_name.to_owned(),
            arn: Mutex::new(arn),
        }
    }

    fn name(&self) -> &str {
        name_of(&self.configured)
    }

    fn cached(&self) -> Option<String> {
        self.arn
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    fn set_cached(&self, arn: Option<String>) {
        *self
            .arn
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = arn;
    }

    /// The topic's ARN, looked up by name when not known.
    async fn arn(&self) -> Result<String, SendError> {
        if let Some(arn) = self.cached() {
            return Ok(arn);
        }
        let suffix = format!(":{}", self.name());
        let mut pages = self
            .shared
            .sns()
            .await
            .list_topics()
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            let result = page.map_err(|e| classify("ListTopics", &e));
            self.shared.observed(&result);
            let found = result
                .map_err(|e| e.error)?
                .topics()
                .iter()
                .filter_map(|t| t.topic_arn())
                .find(|arn| arn.ends_with(&suffix))
                .map(str::to_owned);
            if let Some(arn) = found {
                tracing::debug!(topic = %self.name(), %arn, "topic ARN resolved");
                self.set_cached(Some(arn.clone()));
                return Ok(arn);
            }
        }
        Err(SendError::Permanent(format!(
            "ListTopics: NotFound: no topic is named {}",
            self.name()
        )))
    }

    fn entry(index: usize, m: &Outgoing) -> Result<PublishBatchRequestEntry, SendError> {
        let mut entry = PublishBatchRequestEntry::builder()
            .id(entry_id(index))
            .message(&m.body)
            .set_message_group_id(m.group_id.clone())
            .set_message_deduplication_id(m.dedup_id.clone());
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
        let arn = match self.arn().await {
            Ok(arn) => arn,
            Err(e) => return vec![Err(e); batch.len()],
        };
        let mut entries = Vec::with_capacity(batch.len());
        let mut refused = Vec::new();
        for (i, m) in batch.iter().enumerate() {
            match Self::entry(i, m) {
                Ok(entry) => entries.push(entry),
                Err(e) => refused.push((entry_id(i), e)),
            }
        }
        if entries.is_empty() {
            return results(batch.len(), [], refused);
        }
        let result = self
            .shared
            .sns()
            .await
            .publish_batch()
            .topic_arn(arn)
            .set_publish_batch_request_entries(Some(entries))
            .send()
            .await
            .map_err(|e| classify("PublishBatch", &e));
        self.shared.observed(&result);
        match result {
            Err(AwsError { error, code, .. }) => {
                if code.as_deref() == Some("NotFound") && !is_arn(&self.configured) {
                    self.set_cached(None);
                }
                vec![Err(error); batch.len()]
            }
            Ok(out) => results(
                batch.len(),
                out.successful()
                    .iter()
                    .filter_map(|s| s.id().map(str::to_owned)),
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

impl BatchSink for SnsSink {
    fn send_batch<'a>(
        &'a self,
        batch: &'a [Outgoing],
    ) -> BoxFuture<'a, Vec<Result<(), SendError>>> {
        Box::pin(self.send(batch))
    }
}

impl Target for SnsSink {
    fn describe(&self) -> String {
        format!("topic {}", self.name())
    }

    fn is_fifo(&self) -> bool {
        self.name().ends_with(".fifo")
    }

    fn matches(&self, address: &str) -> bool {
        if is_arn(address) {
            match self.cached() {
                Some(arn) if is_arn(&self.configured) => address == arn,
                _ => name_of(address) == self.name(),
            }
        } else {
            address == self.name()
        }
    }
}

fn is_arn(s: &str) -> bool {
    s.starts_with("arn:")
}

fn name_of(s: &str) -> &str {
    if is_arn(s) {
        s.rsplit(':').next().unwrap_or(s)
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_arns() {
        assert_eq!(
            name_of("arn:aws:sns:us-east-1:123456789012:alerts.fifo"),
            "alerts.fifo"
        );
        assert_eq!(name_of("alerts"), "alerts");
    }
}
