//! A RabbitMQ queue per test on the local broker.
//!
//! [`TestQueue::declare`] declares an exclusive queue with a unique name on the broker named by
//! `$FERRY_TEST_AMQP` (default `amqp://127.0.0.1:5672/%2f`, user `guest`) and consumes it into
//! memory. The broker deletes an exclusive queue when the connection that declared it closes,
//! so a test that fails leaves nothing behind; any connection may still publish to it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};

use crate::{ids, wait};

/// The broker used when `$FERRY_TEST_AMQP` is not set.
pub const DEFAULT_URL: &str = "amqp://127.0.0.1:5672/%2f";

/// The test broker's URL.
pub fn url() -> String {
    std::env::var("FERRY_TEST_AMQP").unwrap_or_else(|_| DEFAULT_URL.to_owned())
}

/// One message taken from a test queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// The `message_id` property.
    pub message_id: Option<String>,
    /// AMQP delivery mode (2: persistent).
    pub delivery_mode: Option<u8>,
    /// Headers whose value is a string (first value of an array).
    pub headers: BTreeMap<String, String>,
    /// The body.
    pub payload: Vec<u8>,
}

/// An exclusive queue consumed into memory for the life of the value.
pub struct TestQueue {
    /// The queue's name (also its routing key on the default exchange).
    pub name: String,
    received: Arc<Mutex<Vec<Received>>>,
    connection: Connection,
}

fn text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        AMQPValue::FieldArray(a) => a.as_slice().first().and_then(text),
        _ => None,
    }
}

impl TestQueue {
    /// Declares a queue named `{prefix}-<unique>` and starts consuming it.
    pub async fn declare(prefix: &str) -> anyhow::Result<Self> {
        let url = url();
        let connection = Connection::connect(&url, ConnectionProperties::default())
            .await
            .with_context(|| format!("connecting to RabbitMQ at {url} (set FERRY_TEST_AMQP)"))?;
        let channel = connection.create_channel().await?;
        let name = ids::unique(prefix);
        channel
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions {
                    exclusive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        let mut consumer = channel
            .basic_consume(
                name.as_str().into(),
                "ferry-test".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let received = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&received);
        tokio::spawn(async move {
            while let Some(Ok(delivery)) = consumer.next().await {
                let p = &delivery.properties;
                let headers = p
                    .headers()
                    .as_ref()
                    .map(|h| {
                        h.inner()
                            .iter()
                            .filter_map(|(k, v)| Some((k.as_str().to_owned(), text(v)?)))
                            .collect()
                    })
                    .unwrap_or_default();
                let message = Received {
                    message_id: p.message_id().as_ref().map(|s| s.as_str().to_owned()),
                    delivery_mode: *p.delivery_mode(),
                    headers,
                    payload: delivery.data.clone(),
                };
                if let Ok(mut all) = sink.lock() {
                    all.push(message);
                }
                delivery.ack(BasicAckOptions::default()).await.ok();
            }
        });
        Ok(Self {
            name,
            received,
            connection,
        })
    }

    /// Everything received so far, in arrival order.
    pub fn received(&self) -> Vec<Received> {
        self.received.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// Waits until `pred` holds for what was received, and returns it.
    pub async fn wait_until(
        &self,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&[Received]) -> bool,
    ) -> anyhow::Result<Vec<Received>> {
        wait::until_ok(timeout, what, || {
            let all = self.received();
            std::future::ready(if pred(&all) {
                Ok(all)
            } else {
                Err(anyhow::anyhow!("{} received so far", all.len()))
            })
        })
        .await
    }

    /// Closes the connection; the broker deletes the queue.
    pub async fn delete(self) {
        self.connection.close(200, "done".into()).await.ok();
    }
}
