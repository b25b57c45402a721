//! The publisher: 256-byte QoS 1 messages to broker A, pipelined, flat out or at a fixed rate.
//!
//! One MQTT v5 connection with a window of [`WINDOW`] unacknowledged publishes (the broker's
//! receive maximum permitting). Each payload is stamped with the [`Clock`] just before it is
//! handed to the client, so a latency covers the whole path: client, broker A, the bridge or
//! the agent, broker B, the subscriber. PUBACKs are counted by the event-loop task; a broker
//! that refuses a message or a lost connection ends the publisher with an error (a benchmark
//! does not reconnect and retry behind the figures' back).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{Context, bail};
use rumqttc::v5::mqttbytes::v5::{ConnectReturnCode, Packet, PubAckReason};
use rumqttc::v5::{AsyncClient, Event, EventLoop, MqttOptions};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};

use super::payload::{self, Clock};
use crate::mqtt::{CONNECT_TIMEOUT, QoS, host_port};

/// Unacknowledged publishes at most (the pipeline depth).
const WINDOW: u16 = 1024;
/// The pacing tick of the fixed-rate mode; each tick sends what is due.
const RATE_TICK: Duration = Duration::from_millis(1);

/// How fast messages go out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pace {
    /// As fast as the window allows.
    FlatOut,
    /// This many messages per second, evenly spread.
    Rate(u32),
}

/// When the publishing of a run started and ended.
#[derive(Debug, Clone, Copy)]
pub struct Published {
    /// Clock time of the first publish.
    pub first_ns: u64,
    /// Clock time of the last publish handed to the client.
    pub last_ns: u64,
    /// Clock time when every publish was acknowledged by broker A.
    pub acked_ns: u64,
}

/// A connected publisher.
pub struct Publisher {
    client: AsyncClient,
    acks: watch::Receiver<u64>,
    failure: Arc<Mutex<Option<String>>>,
    task: JoinHandle<()>,
    clock: Clock,
}

impl Publisher {
    /// Connects to the broker at `url` as `client_id` (clean start) and waits for the CONNACK.
    pub async fn connect(url: &str, client_id: &str, clock: Clock) -> anyhow::Result<Self> {
        let (host, port) = host_port(url)?;
        let mut options = MqttOptions::new(client_id, host, port);
        options
            .set_clean_start(true)
            .set_keep_alive(Duration::from_secs(30))
            .set_outgoing_inflight_upper_limit(WINDOW)
            .set_request_channel_capacity(usize::from(WINDOW));
        let (client, eventloop) = AsyncClient::new(options, usize::from(WINDOW));
        let (acks_tx, acks) = watch::channel(0);
        let (connected_tx, mut connected) = watch::channel(false);
        let failure = Arc::new(Mutex::new(None));
        let task = tokio::spawn(drive(
            eventloop,
            acks_tx,
            connected_tx,
            Arc::clone(&failure),
        ));
        let publisher = Self {
            client,
            acks,
            failure,
            task,
            clock,
        };
        let outcome = tokio::time::timeout(CONNECT_TIMEOUT, connected.wait_for(|&up| up)).await;
        if !matches!(outcome, Ok(Ok(_))) {
            bail!(
                "publisher: no CONNACK from {url} within {CONNECT_TIMEOUT:?}: {}",
                publisher.failure().unwrap_or_default()
            );
        }
        Ok(publisher)
    }

    /// Publishes one QoS 1 message (queued to the client; see [`Self::wait_acks`]).
    pub async fn send(&self, topic: &str, payload: Vec<u8>) -> anyhow::Result<()> {
        if let Some(failure) = self.failure() {
            bail!("publisher failed: {failure}");
        }
        self.client
            .publish(topic, QoS::AtLeastOnce, false, payload)
            .await
            .context("publisher: queueing a publish")
    }

    /// PUBACKs received so far (probes included).
    pub fn acks(&self) -> u64 {
        *self.acks.borrow()
    }

    /// Publishes messages `0..count` to `topic` at `pace`, then waits up to `ack_timeout` for
    /// broker A to acknowledge all of them.
    pub async fn run(
        &mut self,
        topic: &str,
        count: u64,
        pace: Pace,
        ack_timeout: Duration,
    ) -> anyhow::Result<Published> {
        let acks_before = self.acks();
        let first_ns = self.clock.now_ns();
        match pace {
            Pace::FlatOut => {
                for seq in 0..count {
                    self.send(topic, payload::encode(seq, self.clock.now_ns()))
                        .await?;
                }
            }
            Pace::Rate(rate) => {
                let start = Instant::now();
                let mut ticks = tokio::time::interval(RATE_TICK);
                ticks.set_missed_tick_behavior(MissedTickBehavior::Burst);
                let mut seq = 0;
                while seq < count {
                    ticks.tick().await;
                    let due = due_by(start.elapsed(), rate).min(count);
                    while seq < due {
                        self.send(topic, payload::encode(seq, self.clock.now_ns()))
                            .await?;
                        seq += 1;
                    }
                }
            }
        }
        let last_ns = self.clock.now_ns();
        self.wait_acks(acks_before + count, ack_timeout).await?;
        Ok(Published {
            first_ns,
            last_ns,
            acked_ns: self.clock.now_ns(),
        })
    }

    /// Waits until `total` PUBACKs have arrived since the connection was made.
    pub async fn wait_acks(&mut self, total: u64, timeout: Duration) -> anyhow::Result<()> {
        let reached = tokio::time::timeout(timeout, self.acks.wait_for(|&acks| acks >= total))
            .await
            .is_ok_and(|outcome| outcome.is_ok());
        match reached {
            true => Ok(()),
            false => bail!(
                "publisher: {} of {total} PUBACKs after {timeout:?}{}",
                self.acks(),
                self.failure()
                    .map(|failure| format!(" ({failure})"))
                    .unwrap_or_default()
            ),
        }
    }

    /// Disconnects (best effort: the broker is stopped right after anyway).
    pub async fn disconnect(mut self) {
        // An error means the connection is already gone, which is what we want.
        let _ = self.client.disconnect().await;
        let _ = tokio::time::timeout(Duration::from_secs(2), &mut self.task).await;
    }

    fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How many messages are due `elapsed` into a run at `rate` per second (the first at once).
pub fn due_by(elapsed: Duration, rate: u32) -> u64 {
    let due = elapsed.as_nanos() * u128::from(rate) / 1_000_000_000 + 1;
    u64::try_from(due).unwrap_or(u64::MAX)
}

async fn drive(
    mut eventloop: EventLoop,
    acks: watch::Sender<u64>,
    connected: watch::Sender<bool>,
    failure: Arc<Mutex<Option<String>>>,
) {
    let fail = |reason: String| {
        *failure.lock().unwrap_or_else(PoisonError::into_inner) = Some(reason);
    };
    loop {
        match eventloop.poll().await {
            Ok(Event::Incoming(Packet::PubAck(ack))) => {
                if !matches!(
                    ack.reason,
                    PubAckReason::Success | PubAckReason::NoMatchingSubscribers
                ) {
                    fail(format!("broker refused a message: {:?}", ack.reason));
                    return;
                }
                acks.send_modify(|count| *count += 1);
            }
            Ok(Event::Incoming(Packet::ConnAck(ack))) => {
                if ack.code != ConnectReturnCode::Success {
                    fail(format!("broker refused the connection: {:?}", ack.code));
                    return;
                }
                connected.send_replace(true);
            }
            Ok(Event::Outgoing(rumqttc::Outgoing::Disconnect)) => return,
            Ok(_) => {}
            Err(error) => {
                fail(format!("connection error: {error}"));
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fixed_rate_spreads_messages_evenly() {
        assert_eq!(due_by(Duration::ZERO, 1000), 1);
        assert_eq!(due_by(Duration::from_micros(999), 1000), 1);
        assert_eq!(due_by(Duration::from_millis(1), 1000), 2);
        assert_eq!(due_by(Duration::from_secs(1), 1000), 1001);
        assert_eq!(due_by(Duration::from_millis(10), 100), 2);
    }
}
