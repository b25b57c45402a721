//! The subscribers on broker B: one per destination, counting by sequence number.
//!
//! A [`Collector`] subscribes to one destination's topic filter (QoS 1, MQTT v5, clean start) and
//! records into a [`Tally`]: how often each sequence number arrived (so a run checks that every
//! message arrived, and counts duplicates — never trusting anybody's exit code), the first and
//! last arrival times, and one latency sample per message (first arrival minus the send stamp in
//! the payload). Warm-up probes are only counted. [`Collector::arm`] starts a measured phase
//! with a fresh tally sized to its message count, so memory is bounded by the run.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use anyhow::{Context, bail};
use rumqttc::v5::mqttbytes::v5::{Packet, SubscribeReasonCode};
use rumqttc::v5::{AsyncClient, Event, EventLoop, MqttOptions};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::latency::LatencySummary;
use super::payload::{self, Clock, Decoded};
use crate::mqtt::{CONNECT_TIMEOUT, QoS, host_port};

/// What one destination received during a measured phase.
#[derive(Debug, Clone, Default)]
pub struct Tally {
    /// Arrivals per sequence number (saturating), for `0..expected`.
    seen: Vec<u8>,
    /// Numbers that arrived at least once.
    pub distinct: u64,
    /// Arrivals beyond the first of a number.
    pub duplicates: u64,
    /// Numbers outside `0..expected`.
    pub out_of_range: u64,
    /// Warm-up probes.
    pub probes: u64,
    /// Payloads that were neither messages nor probes.
    pub unparsed: u64,
    /// Clock time of the first and the last arrival of a message.
    pub first_ns: Option<u64>,
    pub last_ns: Option<u64>,
    /// One latency per distinct message, in nanoseconds.
    latencies_ns: Vec<u64>,
}

impl Tally {
    /// A fresh tally for a phase of `expected` messages numbered `0..expected`.
    pub fn new(expected: u64) -> Self {
        let size = usize::try_from(expected).unwrap_or(usize::MAX);
        Self {
            seen: vec![0; size],
            latencies_ns: Vec::with_capacity(size),
            ..Self::default()
        }
    }

    /// The messages expected in this phase.
    pub fn expected(&self) -> u64 {
        self.seen.len() as u64
    }

    /// Numbers of `0..expected` that never arrived.
    pub fn missing(&self) -> u64 {
        self.expected() - self.distinct
    }

    /// The latency distribution of the phase so far.
    pub fn latency(&self) -> Option<LatencySummary> {
        LatencySummary::from_samples(&mut self.latencies_ns.clone())
    }

    /// Counts one arrival of `payload` at clock time `arrived_ns`.
    pub fn record(&mut self, payload: &[u8], arrived_ns: u64) {
        match payload::decode(payload) {
            Decoded::Probe => self.probes += 1,
            Decoded::Unparsed => self.unparsed += 1,
            Decoded::Message { seq, sent_ns } => {
                let Some(count) = usize::try_from(seq)
                    .ok()
                    .and_then(|index| self.seen.get_mut(index))
                else {
                    self.out_of_range += 1;
                    return;
                };
                if *count == 0 {
                    self.distinct += 1;
                    self.latencies_ns.push(arrived_ns.saturating_sub(sent_ns));
                } else {
                    self.duplicates += 1;
                }
                *count = count.saturating_add(1);
                self.first_ns.get_or_insert(arrived_ns);
                self.last_ns = Some(arrived_ns);
            }
        }
    }
}

/// A [`Tally`] shared between the task that receives and the run that reads it: every
/// benchmark consumer (MQTT here, JetStream and RabbitMQ in [`relay`](super::relay)) records
/// through one.
#[derive(Debug, Clone, Default)]
pub struct SharedTally(Arc<Mutex<Tally>>);

impl SharedTally {
    /// Starts a measured phase of `expected` messages numbered `0..expected`.
    pub fn arm(&self, expected: u64) {
        *self.lock() = Tally::new(expected);
    }

    /// Counts one arrival of `payload`, now on `clock`.
    pub fn record(&self, payload: &[u8], clock: Clock) {
        let arrived_ns = clock.now_ns();
        self.lock().record(payload, arrived_ns);
    }

    /// Probes received since the last [`Self::arm`] (or the start).
    pub fn probes(&self) -> u64 {
        self.lock().probes
    }

    /// Distinct messages received in this phase.
    pub fn distinct(&self) -> u64 {
        self.lock().distinct
    }

    /// A copy of the phase's tally.
    pub fn snapshot(&self) -> Tally {
        self.lock().clone()
    }

    fn lock(&self) -> MutexGuard<'_, Tally> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A subscriber on one destination.
pub struct Collector {
    name: String,
    tally: SharedTally,
    client: AsyncClient,
    task: JoinHandle<()>,
}

impl Collector {
    /// Connects to `url`, subscribes to `filter` with QoS 1 and returns once the broker has
    /// confirmed the subscription. `name` labels the destination in reports.
    pub async fn start(name: &str, url: &str, filter: &str, clock: Clock) -> anyhow::Result<Self> {
        let (host, port) = host_port(url)?;
        let client_id = crate::ids::unique(&format!("ferry-bench-sub-{name}"));
        let mut options = MqttOptions::new(client_id, host, port);
        options
            .set_clean_start(true)
            .set_keep_alive(Duration::from_secs(30));
        let (client, eventloop) = AsyncClient::new(options, 16);
        let tally = SharedTally::default();
        let (subscribed_tx, mut subscribed) = watch::channel(None);
        let task = tokio::spawn(drive(eventloop, tally.clone(), subscribed_tx, clock));
        let collector = Self {
            name: name.to_owned(),
            tally,
            client,
            task,
        };
        collector
            .client
            .subscribe(filter, QoS::AtLeastOnce)
            .await
            .context("queueing the subscription")?;
        let outcome = tokio::time::timeout(CONNECT_TIMEOUT, subscribed.wait_for(Option::is_some))
            .await
            .with_context(|| format!("no SUBACK for {filter} from {url}"))?
            .context("the subscriber stopped")?;
        match *outcome {
            Some(SubscribeReasonCode::Success(_)) => Ok(collector),
            other => bail!("the broker refused the subscription to {filter}: {other:?}"),
        }
    }

    /// The destination's label.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Starts a measured phase of `expected` messages numbered `0..expected`.
    pub fn arm(&self, expected: u64) {
        self.tally.arm(expected);
    }

    /// Probes received since the last [`Self::arm`] (or the start).
    pub fn probes(&self) -> u64 {
        self.tally.probes()
    }

    /// Distinct messages received in this phase.
    pub fn distinct(&self) -> u64 {
        self.tally.distinct()
    }

    /// A copy of the phase's tally.
    pub fn tally(&self) -> Tally {
        self.tally.snapshot()
    }

    /// True while the subscriber's connection task runs.
    pub fn is_running(&self) -> bool {
        !self.task.is_finished()
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn drive(
    mut eventloop: EventLoop,
    tally: SharedTally,
    subscribed: watch::Sender<Option<SubscribeReasonCode>>,
    clock: Clock,
) {
    loop {
        match eventloop.poll().await {
            Ok(Event::Incoming(Packet::Publish(publish))) => tally.record(&publish.payload, clock),
            Ok(Event::Incoming(Packet::SubAck(ack))) => {
                subscribed.send_replace(ack.return_codes.first().copied());
            }
            Ok(_) => {}
            // Broker B lives as long as the run; a lost connection shows as missing messages.
            Err(_) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tally_counts_by_number() {
        let mut tally = Tally::new(4);
        for seq in [0, 1, 1, 3] {
            tally.record(&payload::encode(seq, 100), 150 + seq);
        }
        tally.record(&payload::encode(9, 0), 500);
        tally.record(payload::PROBE, 600);
        tally.record(b"noise", 700);
        assert_eq!(
            (tally.distinct, tally.duplicates, tally.missing()),
            (3, 1, 1)
        );
        assert_eq!(
            (tally.out_of_range, tally.probes, tally.unparsed),
            (1, 1, 1)
        );
        assert_eq!((tally.first_ns, tally.last_ns), (Some(150), Some(153)));
        let latency = tally.latency();
        assert_eq!(latency.map(|l| l.count), Some(3));
        assert_eq!(latency.map(|l| l.max), Some(Duration::from_nanos(53)));
    }
}
