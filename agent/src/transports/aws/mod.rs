//! AWS transports: SQS (receive and send) and SNS (send), on the AWS SDK.
//!
//! - [`AwsSession`] is one `sqs` or `sns` session: the SDK configuration
//!   (the standard credential chain plus the session's `region` and
//!   `endpoint_url`), its clients, and a connected state that means "the
//!   service answers" (see `session`).
//! - [`SqsReceiver`] long-polls one queue, keeps held messages invisible
//!   with a heartbeat and deletes them in batches after settle (see
//!   `sqs_receiver` for the invariants).
//! - [`AwsSender`] is pinned to one queue or topic and coalesces concurrent
//!   sends into `SendMessageBatch` / `PublishBatch` calls (`sender`, `batch`,
//!   `sqs_sender`, `sns_sender`).
//! - `message` maps envelopes to messages and back (attributes, FIFO ids,
//!   size); `error` is the one classification of AWS errors.

mod batch;
pub(crate) mod error;
mod message;
mod queue;
mod sender;
pub(crate) mod session;
mod sns_sender;
mod sqs_receiver;
mod sqs_sender;

pub use batch::MAX_ENTRIES;
pub use message::{MAX_ATTRIBUTES, MAX_MESSAGE_BYTES};
pub use sender::AwsSender;
pub use session::{AwsSession, AwsSessionSettings, Service};
pub use sqs_receiver::{SqsReceiver, SqsReceiverSettings};

use std::time::Duration;

use ferry_shared::config::GroupId;

/// The queue or topic a sender is pinned to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AwsTarget {
    /// An SQS queue by name or URL, with an optional per-message delay.
    Queue {
        /// Name or URL.
        queue: String,
        /// Per-message delay (standard queues).
        delay: Option<Duration>,
    },
    /// An SNS topic by name or ARN.
    Topic(String),
}

/// An AWS sender's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AwsSenderSettings {
    /// Where it sends.
    pub target: AwsTarget,
    /// FIFO group id rule.
    pub group_id: Option<GroupId>,
    /// Bound of one send.
    pub send_timeout: Duration,
}

impl AwsSession {
    /// A receiver of `settings.queue` on this (sqs) session.
    pub fn receiver(&self, settings: SqsReceiverSettings) -> SqsReceiver {
        SqsReceiver::start(&self.shared, settings)
    }

    /// A sender on this session.
    pub fn sender(&self, settings: AwsSenderSettings) -> AwsSender {
        match settings.target {
            AwsTarget::Queue { queue, delay } => AwsSender::new(
                &self.shared,
                sqs_sender::SqsSink::new(&self.shared, &queue, delay),
                settings.group_id,
                settings.send_timeout,
            ),
            AwsTarget::Topic(topic) => AwsSender::new(
                &self.shared,
                sns_sender::SnsSink::new(&self.shared, &topic),
                settings.group_id,
                settings.send_timeout,
            ),
        }
    }
}
