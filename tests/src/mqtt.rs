//! An MQTT test client (MQTT v5, rumqttc): publish numbered messages, collect them, count.
//!
//! A message's payload is its sequence number in ASCII decimal ([`seq_payload`]); anything
//! after the digits is ignored by [`parse_seq`], so tests may pad payloads to a size.
//! [`publish_seq`] publishes a range of numbers and returns once the broker has acknowledged
//! every one. A [`Collector`] subscribes with a persistent session and counts, per topic, how
//! often each number arrived, so a test can assert "nothing lost" ([`Counts::missing`]) and
//! "no duplicates" ([`Counts::duplicates`]) — or measure them.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{Context, bail};
use rumqttc::Outgoing;
use rumqttc::v5::mqttbytes::v5::{Packet, PubAckReason, SubscribeReasonCode};
use rumqttc::v5::{AsyncClient, Event, EventLoop, MqttOptions};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use rumqttc::v5::mqttbytes::QoS;

use crate::{ids, wait};

/// How long [`publish_seq`] may take per message, on top of [`CONNECT_TIMEOUT`].
const PER_MESSAGE_TIMEOUT: Duration = Duration::from_millis(50);
/// How long connecting and subscribing may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the broker keeps a [`Collector`]'s session after it disconnects.
const SESSION_EXPIRY_SECS: u32 = 3600;
/// Pause between reconnection attempts of a [`Collector`].
const RECONNECT_DELAY: Duration = Duration::from_millis(100);

/// The payload of message number `seq`.
pub fn seq_payload(seq: u64) -> Vec<u8> {
    seq.to_string().into_bytes()
}

/// The sequence number at the start of `payload`, if it starts with ASCII digits.
pub fn parse_seq(payload: &[u8]) -> Option<u64> {
    let digits = payload
        .iter()
        .take_while(|byte| byte.is_ascii_digit())
        .count();
    std::str::from_utf8(&payload[..digits]).ok()?.parse().ok()
}

/// Splits `tcp://host:port` (or `mqtt://`, or a bare `host:port`) into host and port.
pub fn host_port(url: &str) -> anyhow::Result<(String, u16)> {
    let address = url
        .strip_prefix("tcp://")
        .or_else(|| url.strip_prefix("mqtt://"))
        .unwrap_or(url);
    let (host, port) = address
        .rsplit_once(':')
        .with_context(|| format!("no port in the MQTT URL {url:?}"))?;
    let port = port
        .trim_end_matches('/')
        .parse()
        .with_context(|| format!("bad port in the MQTT URL {url:?}"))?;
    Ok((host.to_owned(), port))
}

/// Publishes messages `seqs` (payload [`seq_payload`]) to `topic` on the broker at `url` with a
/// fresh clean session, and returns once each is acknowledged (PUBACK for QoS 1, PUBCOMP for
/// QoS 2, written to the socket for QoS 0) and the client has disconnected.
pub async fn publish_seq(url: &str, topic: &str, seqs: Range<u64>, qos: QoS) -> anyhow::Result<()> {
    publish_seq_with(url, topic, seqs, qos, PublishOptions::default()).await
}

/// Extras for [`publish_seq_with`].
#[derive(Debug, Clone, Default)]
pub struct PublishOptions {
    /// MQTT v5 message expiry interval, in seconds.
    pub expiry_secs: Option<u32>,
    /// Pads each payload (after its number) to this many bytes.
    pub payload_size: usize,
    /// MQTT v5 user properties of every message (e.g. a `traceparent`).
    pub user_properties: Vec<(String, String)>,
}

/// [`publish_seq`] with a message expiry and/or padded payloads.
pub async fn publish_seq_with(
    url: &str,
    topic: &str,
    seqs: Range<u64>,
    qos: QoS,
    extra: PublishOptions,
) -> anyhow::Result<()> {
    let (host, port) = host_port(url)?;
    let mut options = MqttOptions::new(ids::unique("ferry-test-pub"), host, port);
    options.set_clean_start(true);
    let (client, mut eventloop) = AsyncClient::new(options, 100);
    let expected = seqs.end.saturating_sub(seqs.start);
    let timeout =
        CONNECT_TIMEOUT + PER_MESSAGE_TIMEOUT * u32::try_from(expected).unwrap_or(u32::MAX);

    let run = async {
        let publisher = async {
            for seq in seqs {
                let mut payload = seq_payload(seq);
                if payload.len() < extra.payload_size {
                    payload.push(b' ');
                    payload.resize(extra.payload_size, b'x');
                }
                let properties = rumqttc::v5::mqttbytes::v5::PublishProperties {
                    message_expiry_interval: extra.expiry_secs,
                    user_properties: extra.user_properties.clone(),
                    ..Default::default()
                };
                client
                    .publish_with_properties(topic, qos, false, payload, properties)
                    .await
                    .context("queueing a publish")?;
            }
            anyhow::Ok(())
        };
        let acknowledgements = count_acknowledgements(&mut eventloop, qos, expected);
        tokio::try_join!(publisher, acknowledgements)?;
        client
            .disconnect()
            .await
            .context("queueing the disconnect")?;
        loop {
            match eventloop.poll().await {
                Ok(Event::Outgoing(Outgoing::Disconnect)) => break,
                Ok(_) => {}
                Err(error) => return Err(error).context("disconnecting"),
            }
        }
        anyhow::Ok(())
    };
    tokio::time::timeout(timeout, run)
        .await
        .with_context(|| {
            format!("publishing {expected} messages to {topic} on {url} took over {timeout:?}")
        })?
        .with_context(|| format!("publishing to {topic} on {url}"))
}

async fn count_acknowledgements(
    eventloop: &mut EventLoop,
    qos: QoS,
    expected: u64,
) -> anyhow::Result<()> {
    let mut acknowledged = 0;
    while acknowledged < expected {
        let event = eventloop.poll().await.with_context(|| {
            format!("connection lost after {acknowledged} of {expected} acknowledgements")
        })?;
        match (qos, event) {
            (QoS::AtMostOnce, Event::Outgoing(Outgoing::Publish(_))) => acknowledged += 1,
            (QoS::AtLeastOnce, Event::Incoming(Packet::PubAck(ack))) => {
                if !matches!(
                    ack.reason,
                    PubAckReason::Success | PubAckReason::NoMatchingSubscribers
                ) {
                    bail!("the broker refused a message: {:?}", ack.reason);
                }
                acknowledged += 1;
            }
            (QoS::ExactlyOnce, Event::Incoming(Packet::PubComp(_))) => acknowledged += 1,
            (_, Event::Incoming(Packet::ConnAck(ack)))
                if ack.code != rumqttc::v5::mqttbytes::v5::ConnectReturnCode::Success =>
            {
                bail!("the broker refused the connection: {:?}", ack.code);
            }
            _ => {}
        }
    }
    Ok(())
}

/// How often each sequence number arrived, per topic.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    per_topic: BTreeMap<String, BTreeMap<u64, u32>>,
    unparsed: u64,
    /// The `traceparent` user property of each delivery that carried one, per topic.
    traceparents: BTreeMap<String, Vec<String>>,
}

impl Counts {
    /// The `traceparent` of each delivery on `topic` that carried one, in arrival order.
    pub fn traceparents(&self, topic: &str) -> &[String] {
        self.traceparents.get(topic).map_or(&[], Vec::as_slice)
    }

    /// Every delivery, duplicates included.
    pub fn total(&self) -> u64 {
        self.per_topic
            .values()
            .flat_map(BTreeMap::values)
            .map(|&count| u64::from(count))
            .sum::<u64>()
            + self.unparsed
    }

    /// How often `seq` arrived on `topic`.
    pub fn count(&self, topic: &str, seq: u64) -> u32 {
        self.per_topic
            .get(topic)
            .and_then(|seqs| seqs.get(&seq))
            .copied()
            .unwrap_or(0)
    }

    /// How many different numbers arrived on `topic`.
    pub fn distinct(&self, topic: &str) -> usize {
        self.per_topic.get(topic).map_or(0, BTreeMap::len)
    }

    /// The numbers of `seqs` that never arrived on `topic`.
    pub fn missing(&self, topic: &str, seqs: Range<u64>) -> Vec<u64> {
        seqs.filter(|&seq| self.count(topic, seq) == 0).collect()
    }

    /// Every `(topic, seq, times)` that arrived more than once.
    pub fn duplicates(&self) -> Vec<(String, u64, u32)> {
        self.per_topic
            .iter()
            .flat_map(|(topic, seqs)| {
                seqs.iter()
                    .filter(|&(_, &count)| count > 1)
                    .map(move |(&seq, &count)| (topic.clone(), seq, count))
            })
            .collect()
    }

    /// The topics something arrived on.
    pub fn topics(&self) -> impl Iterator<Item = &str> {
        self.per_topic.keys().map(String::as_str)
    }

    /// Messages whose payload did not start with a sequence number.
    pub fn unparsed(&self) -> u64 {
        self.unparsed
    }

    fn record(&mut self, topic: &[u8], payload: &[u8]) {
        match parse_seq(payload) {
            Some(seq) => {
                let topic = String::from_utf8_lossy(topic).into_owned();
                *self
                    .per_topic
                    .entry(topic)
                    .or_default()
                    .entry(seq)
                    .or_default() += 1;
            }
            None => self.unparsed += 1,
        }
    }
}

/// A subscriber that counts the numbered messages it receives.
///
/// It connects with MQTT v5, clean start off and a session expiry of an hour, so the broker
/// queues QoS 1/2 messages for it while it is away ([`Collector::disconnect`], a broker restart)
/// and delivers them when a collector with the same client id connects again. It reconnects on
/// its own after a connection loss. Messages are acknowledged as they are counted.
pub struct Collector {
    client: AsyncClient,
    counts: Arc<Mutex<Counts>>,
    connected: watch::Receiver<bool>,
    task: Option<JoinHandle<()>>,
}

impl Collector {
    /// Connects to the broker at `url` as `client_id`, subscribes to `filter` with `qos`, and
    /// returns once the broker has confirmed the subscription.
    pub async fn start(url: &str, client_id: &str, filter: &str, qos: QoS) -> anyhow::Result<Self> {
        let (host, port) = host_port(url)?;
        let mut options = MqttOptions::new(client_id, host, port);
        options
            .set_clean_start(false)
            .set_session_expiry_interval(Some(SESSION_EXPIRY_SECS))
            .set_keep_alive(Duration::from_secs(5));
        let (client, eventloop) = AsyncClient::new(options, 100);
        let counts = Arc::new(Mutex::new(Counts::default()));
        let (connected_tx, connected) = watch::channel(false);
        let (subscribed_tx, mut subscribed) = watch::channel(None);
        let task = tokio::spawn(run_collector(
            eventloop,
            Arc::clone(&counts),
            connected_tx,
            subscribed_tx,
        ));
        let collector = Self {
            client,
            counts,
            connected,
            task: Some(task),
        };
        collector
            .client
            .subscribe(filter, qos)
            .await
            .context("queueing the subscription")?;
        let outcome = tokio::time::timeout(CONNECT_TIMEOUT, subscribed.wait_for(Option::is_some))
            .await
            .with_context(|| {
                format!("no SUBACK for {filter} from {url} within {CONNECT_TIMEOUT:?}")
            })?
            .context("the collector stopped")?;
        match *outcome {
            Some(SubscribeReasonCode::Success(_)) => Ok(collector),
            other => bail!("the broker refused the subscription to {filter}: {other:?}"),
        }
    }

    /// A copy of the counts so far.
    pub fn counts(&self) -> Counts {
        self.counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// True while connected to the broker.
    pub fn is_connected(&self) -> bool {
        *self.connected.borrow()
    }

    /// Waits until every number of `seqs` has arrived on `topic` at least once, and returns the
    /// counts then; on timeout the error lists how many are missing.
    pub async fn wait_for(
        &self,
        topic: &str,
        seqs: Range<u64>,
        timeout: Duration,
    ) -> anyhow::Result<Counts> {
        let what = format!("messages {seqs:?} on {topic}");
        wait::until_ok(timeout, what, || {
            let counts = self.counts();
            let missing = counts.missing(topic, seqs.clone());
            let outcome = if missing.is_empty() {
                Ok(counts)
            } else {
                let first: Vec<_> = missing.iter().take(10).collect();
                Err(anyhow::anyhow!(
                    "{} missing, first {first:?}",
                    missing.len()
                ))
            };
            std::future::ready(outcome)
        })
        .await
    }

    /// Waits until at least `n` messages (duplicates included) have arrived.
    pub async fn wait_for_total(&self, n: u64, timeout: Duration) -> anyhow::Result<Counts> {
        wait::until_ok(timeout, format!("{n} messages"), || {
            let counts = self.counts();
            let total = counts.total();
            std::future::ready(if total >= n {
                Ok(counts)
            } else {
                Err(anyhow::anyhow!("{total} so far"))
            })
        })
        .await
    }

    /// Disconnects cleanly; the broker keeps the session and queues messages for it. Returns
    /// the final counts.
    pub async fn disconnect(mut self) -> anyhow::Result<Counts> {
        self.client
            .disconnect()
            .await
            .context("queueing the disconnect")?;
        if let Some(task) = self.task.take() {
            tokio::time::timeout(CONNECT_TIMEOUT, task)
                .await
                .context("the collector did not disconnect in time")?
                .context("the collector task failed")?;
        }
        Ok(self.counts())
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

async fn run_collector(
    mut eventloop: EventLoop,
    counts: Arc<Mutex<Counts>>,
    connected: watch::Sender<bool>,
    subscribed: watch::Sender<Option<SubscribeReasonCode>>,
) {
    loop {
        match eventloop.poll().await {
            Ok(Event::Incoming(Packet::Publish(publish))) => {
                let mut counts = counts.lock().unwrap_or_else(PoisonError::into_inner);
                counts.record(&publish.topic, &publish.payload);
                let traceparent = publish.properties.iter().flat_map(|p| &p.user_properties);
                if let Some((_, tp)) = traceparent.into_iter().find(|(k, _)| k == "traceparent") {
                    counts
                        .traceparents
                        .entry(String::from_utf8_lossy(&publish.topic).into_owned())
                        .or_default()
                        .push(tp.clone());
                }
            }
            Ok(Event::Incoming(Packet::ConnAck(_))) => {
                connected.send_replace(true);
            }
            Ok(Event::Incoming(Packet::SubAck(ack))) => {
                subscribed.send_replace(ack.return_codes.first().copied());
            }
            Ok(Event::Outgoing(Outgoing::Disconnect)) => {
                connected.send_replace(false);
                return;
            }
            Ok(_) => {}
            Err(_) => {
                // rumqttc reconnects on the next poll; keep polling, not too fast.
                connected.send_replace(false);
                tokio::time::sleep(RECONNECT_DELAY).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_carry_their_number() {
        assert_eq!(parse_seq(&seq_payload(42)), Some(42));
        assert_eq!(parse_seq(b"7 padding"), Some(7));
        assert_eq!(parse_seq(b"hello"), None);
    }

    #[test]
    fn urls_split_into_host_and_port() -> anyhow::Result<()> {
        assert_eq!(
            host_port("tcp://127.0.0.1:1883")?,
            ("127.0.0.1".to_owned(), 1883)
        );
        assert_eq!(
            host_port("mqtt://localhost:8883")?,
            ("localhost".to_owned(), 8883)
        );
        assert!(host_port("tcp://nowhere").is_err());
        Ok(())
    }

    #[test]
    fn counts_find_gaps_and_duplicates() {
        let mut counts = Counts::default();
        for seq in [0, 1, 1, 3] {
            counts.record(b"t", &seq_payload(seq));
        }
        counts.record(b"t", b"noise");
        assert_eq!(counts.total(), 5);
        assert_eq!(counts.distinct("t"), 3);
        assert_eq!(counts.missing("t", 0..4), vec![2]);
        assert_eq!(counts.duplicates(), vec![("t".to_owned(), 1, 2)]);
        assert_eq!(counts.unparsed(), 1);
    }
}
