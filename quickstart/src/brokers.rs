//! The embedded MQTT brokers: two rumqttd instances in this process, one
//! standing in for the plant broker (where sensor readings are published)
//! and one for the upstream broker (where the three destinations are).
//!
//! Two instances, not one broker with two listeners: two brokers share no
//! topics, so a reading can reach the upstream side only through Ferry, as
//! between two real sites (ADR 0006).
//!
//! rumqttd binds its listener itself from a configured address and cannot
//! be stopped: each broker gets a port found free just before, runs on
//! threads of its own until the process ends, and is known to be up once an
//! MQTT client connects (CONNACK). A port taken in between (another program
//! was quicker) shows as a broker thread that ended; the next free port is
//! tried.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, bail};
use rumqttc::v5::mqttbytes::v5::Packet;
use rumqttc::v5::{AsyncClient, Event, MqttOptions};
use rumqttd::{Broker, Config, ConnectionSettings, RouterConfig, ServerSettings};
use tokio::time::Instant;

/// How long a broker may take to answer.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one connection attempt to a starting broker may take.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);
/// How many free ports are tried.
const ATTEMPTS: usize = 3;
/// Largest message either broker takes (the readings are about 100 bytes).
const MAX_PAYLOAD: usize = 64 * 1024;
/// Unacknowledged QoS 1 messages per connection (the agent's default
/// `max_in_flight` is 100).
const MAX_INFLIGHT: usize = 100;

/// A running embedded broker.
#[derive(Debug, Clone, Copy)]
pub struct EmbeddedBroker {
    addr: SocketAddr,
}

impl EmbeddedBroker {
    /// Starts a broker named `name` (MQTT v5) on a free loopback port.
    pub async fn start(name: &str) -> anyhow::Result<Self> {
        let mut last = None;
        for _ in 0..ATTEMPTS {
            match Self::start_on(name, free_port()?).await {
                Ok(broker) => return Ok(broker),
                Err(error) => last = Some(error),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("no attempt made")))
            .with_context(|| format!("starting the embedded {name} broker"))
    }

    async fn start_on(name: &str, addr: SocketAddr) -> anyhow::Result<Self> {
        let mut broker = Broker::new(config(name, addr));
        let thread = std::thread::Builder::new()
            .name(format!("{name}-broker"))
            .spawn(move || {
                if let Err(error) = broker.start() {
                    tracing::error!(%error, "embedded broker stopped");
                }
            })
            .context("starting the broker's thread")?;
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if answers_mqtt(addr).await {
                return Ok(Self { addr });
            }
            if thread.is_finished() {
                bail!("the broker did not listen on {addr} (port taken?)");
            }
            if Instant::now() > deadline {
                bail!("the broker did not listen on {addr} within {START_TIMEOUT:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `tcp://127.0.0.1:PORT`, as a Ferry session's `broker_url`.
    pub fn url(&self) -> String {
        url(self.addr)
    }
}

/// `tcp://HOST:PORT`.
pub fn url(addr: SocketAddr) -> String {
    format!("tcp://{addr}")
}

/// One MQTT v5 listener on `addr`, nothing else (no console, metrics or
/// bridge), and a router sized for a handful of clients.
fn config(name: &str, addr: SocketAddr) -> Config {
    let listener = ServerSettings {
        name: format!("{name}-v5"),
        listen: addr,
        tls: None,
        next_connection_delay_ms: 1,
        connections: ConnectionSettings {
            connection_timeout_ms: 60_000,
            max_payload_size: MAX_PAYLOAD,
            max_inflight_count: MAX_INFLIGHT,
            auth: None,
            external_auth: None,
            dynamic_filters: true,
        },
    };
    Config {
        router: RouterConfig {
            max_connections: 100,
            max_outgoing_packet_count: 200,
            max_segment_size: 10 * 1024 * 1024,
            max_segment_count: 10,
            custom_segment: None,
            initialized_filters: None,
            shared_subscriptions_strategy: Default::default(),
        },
        v5: Some(HashMap::from([("1".to_owned(), listener)])),
        ..Config::default()
    }
}

/// Whether an MQTT v5 client connects to `addr` now (CONNACK); it then
/// disconnects.
async fn answers_mqtt(addr: SocketAddr) -> bool {
    let mut options = MqttOptions::new("quickstart-probe", addr.ip().to_string(), addr.port());
    options.set_clean_start(true);
    let (client, mut eventloop) = AsyncClient::new(options, 1);
    let connack = async {
        loop {
            match eventloop.poll().await {
                Ok(Event::Incoming(Packet::ConnAck(_))) => return true,
                Ok(_) => {}
                Err(_) => return false,
            }
        }
    };
    let connected = tokio::time::timeout(PROBE_TIMEOUT, connack)
        .await
        .unwrap_or(false);
    if connected && client.try_disconnect().is_ok() {
        // Writes the DISCONNECT; the broker is known to be up either way.
        if tokio::time::timeout(PROBE_TIMEOUT, eventloop.poll())
            .await
            .is_err()
        {
            tracing::debug!(%addr, "the probe's DISCONNECT was not written in time");
        }
    }
    connected
}

/// A loopback port nobody listens on right now.
fn free_port() -> anyhow::Result<SocketAddr> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).context("finding a free port")?;
    Ok(listener.local_addr()?)
}
