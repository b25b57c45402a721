//! The readings: a publisher on the plant broker at a steady pace, and one
//! subscriber on the upstream broker that counts what reaches each
//! destination ([`Tally`]).
//!
//! A reading is JSON: `{"seq":17,"sensor":"line-1/temperature","celsius":21.7,
//! "published_us":812345}`, its sequence number counting from 0 and its
//! publish time in microseconds since the run started ([`Clock`]), so the
//! subscriber measures publish → arrival on the same clock.
//!
//! Each MQTT client's event loop runs in a task of its own and is polled
//! without pause (a `poll` is never cancelled by a `select!`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Filter, Packet, SubscribeReasonCode};
use rumqttc::v5::{AsyncClient, Event, EventLoop, MqttOptions};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::tally::Tally;

/// Where readings are published on the plant broker.
pub const TOPIC: &str = "sensors/line-1/temperature";
/// Pause before polling again after a connection error.
const RECONNECT_DELAY: Duration = Duration::from_millis(200);
/// How long a stopped publisher waits for the broker to acknowledge what it
/// already sent.
const ACK_GRACE: Duration = Duration::from_secs(5);
/// Requests queued for one client's event loop.
const CLIENT_QUEUE: usize = 1024;

/// The run's clock: microseconds since it started.
#[derive(Debug, Clone, Copy)]
pub struct Clock(Instant);

impl Clock {
    /// A clock starting now.
    pub fn start() -> Self {
        Self(Instant::now())
    }

    /// Time since the start.
    pub fn elapsed(&self) -> Duration {
        self.0.elapsed()
    }

    fn micros(&self) -> u64 {
        u64::try_from(self.0.elapsed().as_micros()).unwrap_or(u64::MAX)
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Reading {
    seq: u64,
    sensor: String,
    celsius: f64,
    published_us: u64,
}

/// How many readings were handed to the client and how many the plant
/// broker acknowledged (PUBACK); the broker acknowledges in order, so the
/// acknowledged ones are readings `0..acknowledged`.
#[derive(Debug, Default)]
pub struct Published {
    queued: AtomicU64,
    acknowledged: AtomicU64,
}

impl Published {
    /// Readings handed to the client; no larger sequence number exists.
    pub fn queued(&self) -> u64 {
        self.queued.load(Ordering::SeqCst)
    }

    /// Readings the plant broker acknowledged.
    pub fn acknowledged(&self) -> u64 {
        self.acknowledged.load(Ordering::SeqCst)
    }
}

/// Publishes readings until stopped.
pub struct Publisher {
    stop: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
}

impl Publisher {
    /// Connects to the plant broker at `port` and publishes `rate` readings
    /// per second (QoS 1) until [`Publisher::stop`], counting in `counts`.
    pub fn start(port: u16, rate: f64, clock: Clock, counts: Arc<Published>) -> Self {
        let mut options = MqttOptions::new("quickstart-publisher", "127.0.0.1", port);
        options
            .set_clean_start(true)
            .set_request_channel_capacity(CLIENT_QUEUE);
        let (client, eventloop) = AsyncClient::new(options, CLIENT_QUEUE);
        let stop = CancellationToken::new();
        let acks = tokio::spawn(count_acks(eventloop, Arc::clone(&counts)));
        let period = Duration::from_secs_f64(1.0 / rate);
        let task = tokio::spawn(publish(
            client,
            acks,
            period,
            clock,
            Arc::clone(&counts),
            stop.clone(),
        ));
        Self { stop, task }
    }

    /// Stops publishing and waits (at most [`ACK_GRACE`]) until the broker
    /// acknowledged every reading sent.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.stop.cancel();
        self.task.await.context("the publisher's task failed")?
    }
}

async fn publish(
    client: AsyncClient,
    acks: JoinHandle<()>,
    period: Duration,
    clock: Clock,
    counts: Arc<Published>,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        // Counted before it can possibly arrive anywhere.
        let seq = counts.queued.fetch_add(1, Ordering::SeqCst);
        let reading = Reading {
            seq,
            sensor: "line-1/temperature".to_owned(),
            // A gentle saw tooth, to look like something.
            celsius: 20.0 + (seq % 40) as f64 / 10.0,
            published_us: clock.micros(),
        };
        let payload = serde_json::to_vec(&reading)?;
        client
            .publish(TOPIC, QoS::AtLeastOnce, false, payload)
            .await
            .context("publishing a reading on the plant broker")?;
    }
    let deadline = tokio::time::Instant::now() + ACK_GRACE;
    while counts.acknowledged() < counts.queued() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if let Err(error) = client.disconnect().await {
        tracing::warn!(%error, "publisher: disconnecting");
    }
    acks.abort();
    Ok(())
}

/// Polls the publisher's event loop, counting PUBACKs.
async fn count_acks(mut eventloop: EventLoop, counts: Arc<Published>) {
    loop {
        match eventloop.poll().await {
            Ok(Event::Incoming(Packet::PubAck(_))) => {
                counts.acknowledged.fetch_add(1, Ordering::SeqCst);
            }
            Ok(Event::Outgoing(rumqttc::Outgoing::Disconnect)) => return,
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(%error, "publisher: plant broker connection");
                tokio::time::sleep(RECONNECT_DELAY).await;
            }
        }
    }
}

/// One destination: its binding id and the topic it publishes to.
#[derive(Debug, Clone)]
pub struct Destination {
    /// The binding id in the bridge.
    pub binding: String,
    /// The topic on the upstream broker.
    pub topic: String,
}

/// Counts what arrives on each destination's topic.
pub struct Subscriber {
    tallies: Vec<Arc<Mutex<Tally>>>,
    client: AsyncClient,
    task: JoinHandle<()>,
}

impl Subscriber {
    /// Connects to the upstream broker at `port`, subscribes to every
    /// destination's topic (QoS 1) and returns once the broker confirmed
    /// the subscriptions.
    pub async fn start(
        port: u16,
        destinations: &[Destination],
        clock: Clock,
        published: Arc<Published>,
    ) -> anyhow::Result<Self> {
        let mut options = MqttOptions::new("quickstart-subscriber", "127.0.0.1", port);
        options
            .set_clean_start(true)
            .set_request_channel_capacity(CLIENT_QUEUE);
        let (client, eventloop) = AsyncClient::new(options, CLIENT_QUEUE);
        let tallies: Vec<_> = destinations
            .iter()
            .map(|_| Arc::new(Mutex::new(Tally::default())))
            .collect();
        let (subscribed_tx, mut subscribed) = watch::channel(false);
        let arrivals = Arrivals {
            topics: destinations.iter().map(|d| d.topic.clone()).collect(),
            tallies: tallies.clone(),
            clock,
            published,
        };
        let task = tokio::spawn(receive(eventloop, client.clone(), arrivals, subscribed_tx));
        subscribed
            .wait_for(|done| *done)
            .await
            .context("the subscriber stopped before it subscribed")?;
        Ok(Self {
            tallies,
            client,
            task,
        })
    }

    /// The tally of destination `index` (in the order given to `start`).
    pub fn tally(&self, index: usize) -> std::sync::MutexGuard<'_, Tally> {
        self.tallies[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Disconnects.
    pub async fn stop(self) {
        if let Err(error) = self.client.disconnect().await {
            tracing::warn!(%error, "subscriber: disconnecting");
        }
        if tokio::time::timeout(Duration::from_secs(1), self.task)
            .await
            .is_err()
        {
            tracing::warn!("subscriber: the event loop did not end");
        }
    }
}

/// Where the subscriber's event loop counts.
struct Arrivals {
    topics: Vec<String>,
    tallies: Vec<Arc<Mutex<Tally>>>,
    clock: Clock,
    published: Arc<Published>,
}

impl Arrivals {
    fn record(&self, topic: &[u8], payload: &[u8]) {
        let Some(index) = self.topics.iter().position(|t| t.as_bytes() == topic) else {
            tracing::warn!(topic = %String::from_utf8_lossy(topic), "subscriber: a message on an unexpected topic");
            return;
        };
        let mut tally = self.tallies[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match serde_json::from_slice::<Reading>(payload) {
            Ok(reading) => {
                let latency =
                    Duration::from_micros(self.clock.micros().saturating_sub(reading.published_us));
                if tally.record(reading.seq, latency, self.published.queued()) {
                    tracing::info!(seq = reading.seq, topic = %self.topics[index], "duplicate arrival");
                }
            }
            Err(_) => tally.record_foreign(),
        }
    }
}

/// Polls the subscriber's event loop: subscribes to every topic in one
/// SUBSCRIBE on every CONNACK (a clean session keeps nothing), reports the
/// first SUBACK that grants them all, counts arrivals.
async fn receive(
    mut eventloop: EventLoop,
    client: AsyncClient,
    arrivals: Arrivals,
    subscribed: watch::Sender<bool>,
) {
    loop {
        match eventloop.poll().await {
            Ok(Event::Incoming(Packet::ConnAck(_))) => {
                let filters = arrivals
                    .topics
                    .iter()
                    .map(|topic| Filter::new(topic.as_str(), QoS::AtLeastOnce));
                if let Err(error) = client.try_subscribe_many(filters) {
                    tracing::warn!(%error, "subscriber: subscribing");
                }
            }
            Ok(Event::Incoming(Packet::SubAck(suback))) => {
                let refused = suback
                    .return_codes
                    .iter()
                    .filter(|code| !matches!(code, SubscribeReasonCode::Success(_)))
                    .count();
                if refused > 0 {
                    tracing::error!(
                        ?suback,
                        "subscriber: the upstream broker refused a subscription"
                    );
                } else {
                    subscribed.send_replace(true);
                }
            }
            Ok(Event::Incoming(Packet::Publish(publish))) => {
                arrivals.record(&publish.topic, &publish.payload);
            }
            Ok(Event::Outgoing(rumqttc::Outgoing::Disconnect)) => return,
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(%error, "subscriber: upstream broker connection");
                tokio::time::sleep(RECONNECT_DELAY).await;
            }
        }
    }
}
