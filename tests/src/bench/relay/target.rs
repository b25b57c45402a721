//! The relay's destinations: a JetStream stream or a RabbitMQ queue made for one run, consumed
//! into a [`SharedTally`], and the one-at-a-time publisher of the [`minimal`](super::minimal)
//! relay.
//!
//! - JetStream: a stream capturing `{unique}.>` (`ferry_tests::nats`); the relays publish on
//!   `{unique}.events` and a pull consumer without acks reads what the stream stored, so a row
//!   counts as delivered once the stream holds it.
//! - RabbitMQ: a queue with a unique name on the default exchange, declared exclusive by the
//!   consuming connection (the broker deletes it when that connection closes); the consumer
//!   takes deliveries without acks.
//!
//! A consumer that stops (its connection lost) shows as [`Destination::is_running`] false; the
//! run then fails rather than waiting for rows that cannot arrive.

use anyhow::{Context, bail};
use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use tokio::task::JoinHandle;

use crate::bench::collector::SharedTally;
use crate::bench::payload::Clock;
use crate::ids;
use crate::nats::{self, TestStream};
use crate::rabbitmq;

/// AMQP delivery mode of a persistent message.
const PERSISTENT: u8 = 2;

/// Where the relays publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// A NATS JetStream stream.
    Nats,
    /// A RabbitMQ queue.
    Rabbitmq,
}

impl Target {
    /// `nats` or `rabbitmq`: the transport's name in Ferry's configuration.
    pub fn name(self) -> &'static str {
        match self {
            Self::Nats => "nats",
            Self::Rabbitmq => "rabbitmq",
        }
    }

    /// The broker's URL.
    pub fn url(self) -> String {
        match self {
            Self::Nats => nats::url(),
            Self::Rabbitmq => rabbitmq::url(),
        }
    }
}

/// What holds one run's destination open.
enum Place {
    Nats {
        stream: TestStream,
        subject: String,
    },
    Rabbitmq {
        queue: String,
        connection: Connection,
    },
}

/// A destination made for one run, consumed into a tally.
pub struct Destination {
    target: Target,
    place: Place,
    tally: SharedTally,
    consumer: JoinHandle<anyhow::Result<()>>,
}

impl Destination {
    /// Makes the stream or queue and starts consuming it.
    pub async fn create(target: Target, clock: Clock) -> anyhow::Result<Self> {
        let tally = SharedTally::default();
        let (place, consumer) = match target {
            Target::Nats => {
                let stream = TestStream::create("ferry_bench_relay").await?;
                let subject = format!("{}.events", stream.subject);
                let messages = stream
                    .context
                    .get_stream(&stream.name)
                    .await?
                    .create_consumer(consumer::pull::Config {
                        ack_policy: consumer::AckPolicy::None,
                        ..Default::default()
                    })
                    .await
                    .context("creating the stream's consumer")?
                    .messages()
                    .await
                    .context("reading the stream")?;
                let sink = tally.clone();
                let consumer = tokio::spawn(async move {
                    let mut messages = messages;
                    while let Some(message) = messages.next().await {
                        let message = message.context("reading the stream")?;
                        sink.record(&message.payload, clock);
                    }
                    bail!("the stream's consumer ended")
                });
                (Place::Nats { stream, subject }, consumer)
            }
            Target::Rabbitmq => {
                let connection = connect_rabbitmq().await?;
                let channel = connection.create_channel().await?;
                let queue = ids::unique("ferry-bench-relay");
                channel
                    .queue_declare(
                        short(&queue)?,
                        QueueDeclareOptions {
                            exclusive: true,
                            ..QueueDeclareOptions::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .with_context(|| format!("declaring the queue {queue}"))?;
                let mut deliveries = channel
                    .basic_consume(
                        short(&queue)?,
                        short("ferry-bench")?,
                        BasicConsumeOptions {
                            no_ack: true,
                            ..BasicConsumeOptions::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .context("consuming the queue")?;
                let sink = tally.clone();
                let consumer = tokio::spawn(async move {
                    while let Some(delivery) = deliveries.next().await {
                        let delivery = delivery.context("consuming the queue")?;
                        sink.record(&delivery.data, clock);
                    }
                    bail!("the queue's consumer ended")
                });
                (Place::Rabbitmq { queue, connection }, consumer)
            }
        };
        Ok(Self {
            target,
            place,
            tally,
            consumer,
        })
    }

    /// Ferry's binding address: the subject, or `/QUEUE` (the default exchange).
    pub fn address(&self) -> String {
        match &self.place {
            Place::Nats { subject, .. } => subject.clone(),
            Place::Rabbitmq { queue, .. } => format!("/{queue}"),
        }
    }

    /// What the consumer has counted.
    pub fn tally(&self) -> &SharedTally {
        &self.tally
    }

    /// Fails if the consumer has stopped.
    pub fn check_running(&self) -> anyhow::Result<()> {
        if self.consumer.is_finished() {
            bail!("the {} consumer stopped", self.target.name());
        }
        Ok(())
    }

    /// A publisher of its own (its own connection, as another process would have).
    pub async fn publisher(&self) -> anyhow::Result<Publisher> {
        Ok(match &self.place {
            Place::Nats { subject, .. } => {
                let url = nats::url();
                let client = async_nats::connect(url.as_str())
                    .await
                    .with_context(|| format!("connecting to NATS at {url}"))?;
                Publisher::Nats {
                    context: jetstream::new(client),
                    subject: subject.clone(),
                }
            }
            Place::Rabbitmq { queue, .. } => {
                let connection = connect_rabbitmq().await?;
                let channel = connection.create_channel().await?;
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await
                    .context("turning publisher confirms on")?;
                Publisher::Rabbitmq {
                    channel,
                    routing_key: short(queue)?,
                    _connection: connection,
                }
            }
        })
    }

    /// Deletes the stream, or closes the connection (and with it the queue).
    pub async fn delete(self) {
        self.consumer.abort();
        match self.place {
            Place::Nats { stream, .. } => {
                if let Err(error) = stream.delete().await {
                    eprintln!("  deleting the stream: {error:#}");
                }
            }
            Place::Rabbitmq { connection, .. } => {
                connection.close(200, "done".into()).await.ok();
            }
        }
    }
}

/// Publishes one message at a time and waits for the broker to take it.
pub enum Publisher {
    Nats {
        context: jetstream::Context,
        subject: String,
    },
    Rabbitmq {
        channel: Channel,
        routing_key: ShortString,
        _connection: Connection,
    },
}

impl Publisher {
    /// Publishes `payload` and resolves on the stream's ack or the broker's confirm.
    pub async fn send(&self, payload: Vec<u8>) -> anyhow::Result<()> {
        match self {
            Self::Nats { context, subject } => {
                context
                    .publish(subject.clone(), payload.into())
                    .await
                    .context("publishing to JetStream")?
                    .await
                    .context("waiting for the stream's ack")?;
            }
            Self::Rabbitmq {
                channel,
                routing_key,
                ..
            } => {
                let confirmation = channel
                    .basic_publish(
                        ShortString::default(),
                        routing_key.clone(),
                        BasicPublishOptions::default(),
                        &payload,
                        BasicProperties::default().with_delivery_mode(PERSISTENT),
                    )
                    .await
                    .context("publishing to RabbitMQ")?
                    .await
                    .context("waiting for the broker's confirm")?;
                if !matches!(confirmation, Confirmation::Ack(_)) {
                    bail!("RabbitMQ did not take the message: {confirmation:?}");
                }
            }
        }
        Ok(())
    }
}

async fn connect_rabbitmq() -> anyhow::Result<Connection> {
    let url = rabbitmq::url();
    Connection::connect(&url, ConnectionProperties::default())
        .await
        .with_context(|| format!("connecting to RabbitMQ at {url}"))
}

fn short(text: &str) -> anyhow::Result<ShortString> {
    ShortString::try_new(text).map_err(|error| anyhow::anyhow!("{text:?}: {error}"))
}
