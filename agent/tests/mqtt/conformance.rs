//! Protocol conformance of the MQTT client (ADR 0008) against a real Mosquitto, seen on the wire:
//! a [`Tap`] between the session and the broker decodes every packet both ways and keeps the
//! figures the MQTT rules are about (publishes in flight, packet ids, pings, chunks written).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use prost::bytes::BytesMut;
use rumqttc::v5::mqttbytes::v5::Packet;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

use super::*;

/// What the tap saw, over every connection it carried.
#[derive(Debug, Default)]
struct Seen {
    connections: usize,
    /// Reads on the client's side: an upper bound of the client's writes that carried publishes.
    publish_chunks: usize,
    publishes: usize,
    /// Packet ids of our publishes the broker has not acknowledged yet (as forwarded).
    in_flight: HashSet<u16>,
    max_in_flight: usize,
    /// A publish reused an id still in flight.
    reused_in_flight: Vec<u16>,
    max_pkid: u16,
    pingreqs: usize,
    dup_publishes_to_client: usize,
}

/// A TCP proxy to the broker that decodes MQTT v5 both ways. `blackhole` drops everything the
/// broker sends from then on (a half-open connection, as a dead broker behind NAT looks).
struct Tap {
    port: u16,
    seen: Arc<Mutex<Seen>>,
    blackhole: Arc<AtomicBool>,
}

impl Tap {
    async fn start(broker: &Mosquitto) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Seen::default()));
        let blackhole = Arc::new(AtomicBool::new(false));
        let upstream = broker.addr();
        let (s, b) = (Arc::clone(&seen), Arc::clone(&blackhole));
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                s.lock().unwrap().connections += 1;
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::spawn(pump(client_read, server_write, Arc::clone(&s), None));
                tokio::spawn(pump(
                    server_read,
                    client_write,
                    Arc::clone(&s),
                    Some(Arc::clone(&b)),
                ));
            }
        });
        Self {
            port,
            seen,
            blackhole,
        }
    }

    fn url(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.port)
    }

    fn seen<T>(&self, f: impl FnOnce(&Seen) -> T) -> T {
        f(&self.seen.lock().unwrap())
    }
}

/// Forwards one direction, decoding as it goes; `blackhole` is set for the broker's side.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    seen: Arc<Mutex<Seen>>,
    blackhole: Option<Arc<AtomicBool>>,
) {
    let to_client = blackhole.is_some();
    let mut buf = vec![0u8; 256 * 1024];
    let mut pending = BytesMut::new();
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        pending.extend_from_slice(&buf[..n]);
        {
            let mut seen = seen.lock().unwrap();
            let mut publishes_in_chunk = false;
            while let Ok(packet) = Packet::read(&mut pending, None) {
                match packet {
                    Packet::Publish(p) if !to_client => {
                        publishes_in_chunk = true;
                        seen.publishes += 1;
                        seen.max_pkid = seen.max_pkid.max(p.pkid);
                        if p.pkid != 0 && !seen.in_flight.insert(p.pkid) {
                            seen.reused_in_flight.push(p.pkid);
                        }
                        seen.max_in_flight = seen.max_in_flight.max(seen.in_flight.len());
                    }
                    Packet::Publish(p) if p.dup => seen.dup_publishes_to_client += 1,
                    Packet::PubAck(ack) if to_client => {
                        seen.in_flight.remove(&ack.pkid);
                    }
                    // A new connection starts with nothing in flight.
                    Packet::Connect(..) => seen.in_flight.clear(),
                    Packet::PingReq(_) => seen.pingreqs += 1,
                    _ => {}
                }
            }
            if publishes_in_chunk {
                seen.publish_chunks += 1;
            }
        }
        if blackhole
            .as_ref()
            .is_some_and(|b| b.load(Ordering::Relaxed))
        {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
}

fn tapped_settings(tap: &Tap, client_id: &str) -> MqttSessionSettings {
    let mut s = MqttSessionSettings::new("conformance", tap.url(), client_id);
    s.keep_alive = Duration::from_secs(5);
    s.clean_start = true;
    s
}

async fn send_all(sender: &ferry_agent::transports::mqtt::MqttSender, n: usize) {
    let to = Address::new("conf/out");
    let envelopes: Vec<Envelope> = (0..n)
        .map(|i| envelope(&format!("m-{i}"), &"x".repeat(256)))
        .collect();
    let results = futures::future::join_all(envelopes.iter().map(|e| sender.send(e, &to))).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
}

/// Sends queued together leave in few writes (the loop takes every waiting request into one
/// buffer), never more than the window is in flight, and ids cycle within the window without
/// reuse while in flight.
#[tokio::test]
async fn publishes_are_batched_within_the_outgoing_window_and_ids_are_not_reused_in_flight() {
    let broker = Mosquitto::start().await.unwrap();
    let tap = Tap::start(&broker).await;
    let shutdown = CancellationToken::new();
    let mut settings = tapped_settings(&tap, "conf-window");
    settings.max_outgoing_inflight = 8;
    let session = MqttSession::start(settings, shutdown.clone()).unwrap();
    wait_connected(&mut session.connected(), true).await;
    let sender = session.sender(MqttSenderSettings::default());
    send_all(&sender, 200).await;
    tap.seen(|seen| {
        assert_eq!(seen.publishes, 200);
        assert!(seen.max_in_flight <= 8, "{seen:?}");
        assert!(seen.max_pkid <= 8, "{seen:?}");
        assert!(seen.reused_in_flight.is_empty(), "{seen:?}");
        // Fewer writes than publishes: the first window leaves in one write. How many
        // writes the rest takes depends on how the PUBACKs arrive (one at a time frees one
        // slot at a time on a loaded machine), so no tighter bound holds here; the batch
        // below is the sharp check.
        assert!(seen.publish_chunks < seen.publishes, "{seen:?}");
    });

    // A window of 64: 64 sends queued at once leave in far fewer writes than 64.
    let before = tap.seen(|s| s.publish_chunks);
    let shutdown2 = CancellationToken::new();
    let mut settings = tapped_settings(&tap, "conf-batch");
    settings.max_outgoing_inflight = 64;
    let wide = MqttSession::start(settings, shutdown2.clone()).unwrap();
    wait_connected(&mut wide.connected(), true).await;
    let before_wide = tap.seen(|s| s.publish_chunks);
    send_all(&wide.sender(MqttSenderSettings::default()), 64).await;
    let chunks = tap.seen(|s| s.publish_chunks) - before_wide;
    assert!(before <= before_wide);
    assert!(chunks <= 8, "64 queued publishes took {chunks} writes");
    shutdown.cancel();
    shutdown2.cancel();
    session.stopped().await;
    wide.stopped().await;
}

/// The broker's receive maximum caps the window below `max_outgoing_inflight`.
#[tokio::test]
async fn the_brokers_receive_maximum_caps_the_window() {
    let broker = Mosquitto::builder()
        .config_line("max_inflight_messages 3")
        .start()
        .await
        .unwrap();
    let tap = Tap::start(&broker).await;
    let shutdown = CancellationToken::new();
    let session = MqttSession::start(tapped_settings(&tap, "conf-rm"), shutdown.clone()).unwrap();
    wait_connected(&mut session.connected(), true).await;
    send_all(&session.sender(MqttSenderSettings::default()), 50).await;
    tap.seen(|seen| {
        assert_eq!(seen.publishes, 50);
        assert!(seen.max_in_flight <= 3, "{seen:?}");
        assert!(seen.reused_in_flight.is_empty(), "{seen:?}");
    });
    shutdown.cancel();
    session.stopped().await;
}

/// An idle session sends PINGREQ and stays connected; when the broker's side goes silent, the
/// missing PINGRESP ends the connection and the session connects again.
#[tokio::test]
async fn keep_alive_pings_and_a_silent_broker_is_detected() {
    let broker = Mosquitto::start().await.unwrap();
    let tap = Tap::start(&broker).await;
    let shutdown = CancellationToken::new();
    let session = MqttSession::start(tapped_settings(&tap, "conf-ka"), shutdown.clone()).unwrap();
    let mut connected = session.connected();
    wait_connected(&mut connected, true).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while tap.seen(|s| s.pingreqs) < 2 {
        assert!(tokio::time::Instant::now() < deadline, "no PINGREQ");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(session.reconnects(), 0);
    assert_eq!(tap.seen(|s| s.connections), 1);

    tap.blackhole.store(true, Ordering::Relaxed);
    tokio::time::timeout(Duration::from_secs(30), connected.wait_for(|c| !*c))
        .await
        .expect("the silent broker was not detected")
        .unwrap();
    tap.blackhole.store(false, Ordering::Relaxed);
    wait_connected(&mut connected, true).await;
    assert!(tap.seen(|s| s.connections) >= 2);
    shutdown.cancel();
    session.stopped().await;
}

/// A receiver's unacknowledged deliveries survive a broker restart (persistent session): they
/// come back with DUP on the resumed session, are acknowledged there, and do not come a third
/// time.
#[tokio::test]
async fn unacknowledged_deliveries_come_back_with_dup_after_a_broker_restart() {
    let mut broker = Mosquitto::start().await.unwrap();
    let tap = Tap::start(&broker).await;
    let mut settings = tapped_settings(&tap, "conf-resume");
    settings.clean_start = false;
    let mut agent = Agent::start(settings.clone(), receiver_settings("conf/in")).await;
    let producer = TestClient::connect(&broker, "conf-producer", None).await;
    for i in 0..5 {
        producer
            .publish("conf/in", &i.to_string(), PublishProperties::default())
            .await;
    }
    // Held, not settled: unacknowledged when the broker goes down.
    let mut held = Vec::new();
    for _ in 0..5 {
        held.push(agent.recv().await);
    }
    drop(producer);
    broker.restart().await.unwrap();
    let mut got = Vec::new();
    for _ in 0..5 {
        let d = agent.recv().await;
        assert!(d.redelivered, "a redelivery carries DUP");
        got.push(payload(&d));
        d.settle.settle(Outcome::Sent);
    }
    assert_eq!(got, ["0", "1", "2", "3", "4"]);
    assert!(tap.seen(|s| s.dup_publishes_to_client) >= 5);
    // Settles of the old connection are no-ops.
    for d in held {
        d.settle.settle(Outcome::Sent);
    }
    agent.session.reconnect();
    wait_connected(&mut agent.session.connected(), true).await;
    let nothing = tokio::time::timeout(Duration::from_secs(1), agent.receiver.recv()).await;
    assert!(nothing.is_err(), "acknowledged deliveries came back");
    agent.stop().await;
}

/// QoS 2 both ways: a QoS 2 send resolves on PUBCOMP, a QoS 2 delivery is settled with the
/// PUBREC and the broker's PUBREL is completed by the loop.
#[tokio::test]
async fn qos_2_sends_and_receives() {
    let broker = Mosquitto::start().await.unwrap();
    let mut settings = session_settings(&broker, "conf-qos2");
    settings.clean_start = true;
    let receiver = MqttReceiverSettings::new(vec![("conf/q2".to_owned(), Qos::ExactlyOnce)]);
    let mut agent = Agent::start(settings, receiver).await;
    let sender = agent.session.sender(MqttSenderSettings {
        qos: Qos::ExactlyOnce,
        ..MqttSenderSettings::default()
    });
    for i in 0..3 {
        let e = envelope(&format!("q2-{i}"), &i.to_string());
        sender.send(&e, &Address::new("conf/q2")).await.unwrap();
        let d = agent.recv().await;
        assert_eq!(payload(&d), i.to_string());
        d.settle.settle(Outcome::Sent);
    }
    agent.stop().await;
}
