//! An SQS queue as a receiver or sender names it: a bare name, resolved to
//! its URL once (`GetQueueUrl`), or a URL taken as it is.

use tokio::sync::OnceCell;

use super::error::{AwsError, classify};
use super::session::Shared;

/// One queue, by name or URL.
#[derive(Debug)]
pub(crate) struct Queue {
    configured: String,
    url: OnceCell<String>,
}

impl Queue {
    /// The queue `name_or_url` names.
    pub fn new(name_or_url: &str) -> Self {
        let url = OnceCell::new();
        if is_url(name_or_url) {
            url.set(name_or_url.trim_end_matches('/').to_owned()).ok();
        }
        Self {
            configured: name_or_url.to_owned(),
            url,
        }
    }

    /// The queue's name (a URL's last path segment).
    pub fn name(&self) -> &str {
        name_of(&self.configured)
    }

    /// As configured.
    pub fn configured(&self) -> &str {
        &self.configured
    }

    /// A FIFO queue (name ending in `.fifo`).
    pub fn is_fifo(&self) -> bool {
        self.name().ends_with(".fifo")
    }

    /// Whether a binding address names this queue (its bare name or its URL).
    pub fn matches(&self, address: &str) -> bool {
        if is_url(address) {
            match self.url.get() {
                Some(url) => address.trim_end_matches('/') == url,
                None => name_of(address) == self.name(),
            }
        } else {
            address == self.name()
        }
    }

    /// The queue URL, resolved on first use.
    pub async fn url(&self, shared: &Shared) -> Result<&str, AwsError> {
        self.url
            .get_or_try_init(|| async {
                let result = shared
                    .sqs()
                    .await
                    .get_queue_url()
                    .queue_name(self.name())
                    .send()
                    .await
                    .map_err(|e| classify("GetQueueUrl", &e));
                shared.observed(&result);
                let url = result?.queue_url().unwrap_or_default().to_owned();
                tracing::debug!(queue = %self.name(), %url, "queue URL resolved");
                Ok(url)
            })
            .await
            .map(String::as_str)
    }
}

fn is_url(s: &str) -> bool {
    s.contains("://")
}

fn name_of(s: &str) -> &str {
    if is_url(s) {
        s.trim_end_matches('/').rsplit('/').next().unwrap_or(s)
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_urls_and_addresses() {
        let by_url = Queue::new("http://127.0.0.1:5000/123456789012/orders.fifo/");
        assert_eq!(by_url.name(), "orders.fifo");
        assert!(by_url.is_fifo());
        assert!(by_url.matches("orders.fifo"));
        assert!(by_url.matches("http://127.0.0.1:5000/123456789012/orders.fifo"));
        assert!(!by_url.matches("http://127.0.0.1:5000/999999999999/orders.fifo"));
        let by_name = Queue::new("events");
        assert!(!by_name.is_fifo());
        assert!(by_name.matches("https://sqs.us-east-1.amazonaws.com/1/events"));
        assert!(!by_name.matches("other"));
    }
}
