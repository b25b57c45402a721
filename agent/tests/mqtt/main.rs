//! The MQTT transport against a real Mosquitto started by each test.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, SystemTime};

use ferry_agent::transports::mqtt::{
    MqttReceiver, MqttReceiverSettings, MqttSenderSettings, MqttSession, MqttSessionSettings,
    Protocol, Qos, SettingsError,
};
use ferry_agent::transports::{Address, Defect, Delivery, Outcome, SendError};
use ferry_shared::envelope::{Envelope, Source, TraceContext};
use ferry_tests::Mosquitto;
use prost::bytes::Bytes;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Packet, Publish, PublishProperties};
use rumqttc::v5::{AsyncClient, Event, MqttOptions};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

mod conformance;

const DEADLINE: Duration = Duration::from_secs(15);

async fn wait_connected(watch: &mut watch::Receiver<bool>, want: bool) {
    tokio::time::timeout(DEADLINE, watch.wait_for(|c| *c == want))
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for connected == {want}"))
        .unwrap();
}

/// A plain rumqttc v5 client for the other side of the tests.
struct TestClient {
    client: AsyncClient,
    publishes: mpsc::UnboundedReceiver<Publish>,
    shutdown: CancellationToken,
}

impl TestClient {
    async fn connect(broker: &Mosquitto, id: &str, subscribe: Option<&str>) -> Self {
        let options = MqttOptions::new(id, "127.0.0.1", broker.port());
        let (client, mut eventloop) = AsyncClient::new(options, 100);
        let (tx, publishes) = mpsc::unbounded_channel();
        let (subscribed_tx, subscribed_rx) = tokio::sync::oneshot::channel();
        let mut subscribed_tx = Some(subscribed_tx);
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        tokio::spawn(async move {
            loop {
                let event = tokio::select! {
                    () = token.cancelled() => break,
                    e = eventloop.poll() => e,
                };
                match event {
                    Ok(Event::Incoming(Packet::Publish(p))) => {
                        tx.send(p).ok();
                    }
                    Ok(Event::Incoming(Packet::SubAck(_))) => {
                        if let Some(subscribed) = subscribed_tx.take() {
                            subscribed.send(()).ok();
                        }
                    }
                    Ok(_) => {}
                    Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
        });
        if let Some(filter) = subscribe {
            client.subscribe(filter, QoS::AtLeastOnce).await.unwrap();
            tokio::time::timeout(DEADLINE, subscribed_rx)
                .await
                .unwrap()
                .unwrap();
        }
        Self {
            client,
            publishes,
            shutdown,
        }
    }

    async fn publish(&self, topic: &str, payload: &str, properties: PublishProperties) {
        self.client
            .publish_with_properties(
                topic,
                QoS::AtLeastOnce,
                false,
                payload.to_owned(),
                properties,
            )
            .await
            .unwrap();
    }

    async fn next(&mut self) -> Publish {
        tokio::time::timeout(DEADLINE, self.publishes.recv())
            .await
            .expect("timed out waiting for a publish")
            .unwrap()
    }
}

impl Drop for TestClient {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

fn session_settings(broker: &Mosquitto, client_id: &str) -> MqttSessionSettings {
    let mut s = MqttSessionSettings::new("test-session", broker.url(), client_id);
    s.keep_alive = Duration::from_secs(5);
    s
}

struct Agent {
    session: MqttSession,
    receiver: MqttReceiver,
    shutdown: CancellationToken,
}

impl Agent {
    async fn start(settings: MqttSessionSettings, receiver: MqttReceiverSettings) -> Self {
        let shutdown = CancellationToken::new();
        let (session, receiver) =
            MqttSession::start_with_receiver(settings, receiver, shutdown.clone()).unwrap();
        wait_connected(&mut session.connected(), true).await;
        Self {
            session,
            receiver,
            shutdown,
        }
    }

    async fn recv(&mut self) -> Delivery {
        tokio::time::timeout(DEADLINE, self.receiver.recv())
            .await
            .expect("timed out waiting for a delivery")
            .expect("the session stopped")
    }

    /// Stops the agent's session (a clean DISCONNECT; the broker keeps it).
    async fn stop(self) {
        self.shutdown.cancel();
        self.session.stopped().await;
    }
}

fn payload(d: &Delivery) -> String {
    String::from_utf8_lossy(&d.envelope.payload).into_owned()
}

fn receiver_settings(filter: &str) -> MqttReceiverSettings {
    MqttReceiverSettings::new(vec![(filter.to_owned(), Qos::AtLeastOnce)])
}

#[tokio::test]
async fn a_received_message_maps_v5_properties_and_is_acked_after_settle() {
    let broker = Mosquitto::start().await.unwrap();
    // A trusted receiver (a hop from another Ferry agent) keeps the incoming id
    // and the ferry-* headers; an untrusted one is covered in properties.rs.
    let mut receiver = receiver_settings("in/#");
    receiver.trust_message_id = true;
    let mut agent = Agent::start(session_settings(&broker, "rx-1"), receiver).await;
    let publisher = TestClient::connect(&broker, "pub-1", None).await;
    let props = PublishProperties {
        user_properties: vec![
            ("b".into(), "2".into()),
            ("ferry-message-id".into(), "msg-1".into()),
            ("a".into(), "1".into()),
            (
                "traceparent".into(),
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
            ),
        ],
        content_type: Some("text/plain".into()),
        message_expiry_interval: Some(600),
        ..PublishProperties::default()
    };
    publisher.publish("in/sensor", "first", props).await;
    let before = SystemTime::now();
    let delivery = agent.recv().await;
    let e = &delivery.envelope;
    assert_eq!(delivery.defect, None);
    assert_eq!(e.id, "msg-1");
    assert_eq!(payload(&delivery), "first");
    assert_eq!(e.source.address, "in/sensor");
    assert_eq!(e.source.transport, "mqtt");
    assert_eq!(e.source.session_id, "test-session");
    assert_eq!(e.content_type.as_deref(), Some("text/plain"));
    let keys: Vec<&str> = e.headers.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["b", "ferry-message-id", "a", "traceparent"]);
    assert_eq!(
        e.trace.traceparent.as_deref(),
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    );
    let expires = e.expires_at.unwrap();
    assert!(
        expires > before + Duration::from_secs(590) && expires <= before + Duration::from_secs(601)
    );
    delivery.settle.settle(Outcome::Persisted);

    // Acked: after a restart of the agent the broker has only the next message.
    publisher
        .publish("in/sensor", "second", PublishProperties::default())
        .await;
    let second = agent.recv().await;
    assert_eq!(payload(&second), "second");
    assert!(uuid::Uuid::parse_str(&second.envelope.id).is_ok_and(|u| u.get_version_num() == 7));
    drop(second); // abandoned: not acked
    agent.stop().await;
    let mut agent =
        Agent::start(session_settings(&broker, "rx-1"), receiver_settings("in/#")).await;
    let again = agent.recv().await;
    assert_eq!(
        payload(&again),
        "second",
        "the settled message was acknowledged"
    );
    again.settle.settle(Outcome::Sent);
    agent.stop().await;
}

#[tokio::test]
async fn a_message_is_redelivered_when_the_agent_stops_before_settle() {
    let mut broker = Mosquitto::start().await.unwrap();
    let mut agent =
        Agent::start(session_settings(&broker, "rx-2"), receiver_settings("in/#")).await;
    let publisher = TestClient::connect(&broker, "pub-2", None).await;
    publisher
        .publish("in/x", "held", PublishProperties::default())
        .await;
    let held = agent.recv().await;
    assert_eq!(payload(&held), "held");
    let id = held.envelope.id.clone();
    agent.stop().await;
    // A settle after the session stopped acknowledges nothing.
    held.settle.settle(Outcome::Persisted);
    // The broker keeps the unacknowledged message across its own restart too.
    broker.restart().await.unwrap();
    let mut agent =
        Agent::start(session_settings(&broker, "rx-2"), receiver_settings("in/#")).await;
    let again = agent.recv().await;
    assert_eq!(payload(&again), "held");
    assert_ne!(
        again.envelope.id, id,
        "no message id header: a new id per receive"
    );
    again.settle.settle(Outcome::Persisted);
    agent.stop().await;
}

#[tokio::test]
async fn acks_go_out_in_receive_order_when_settled_out_of_order() {
    let broker = Mosquitto::start().await.unwrap();
    let mut agent =
        Agent::start(session_settings(&broker, "rx-3"), receiver_settings("in/#")).await;
    let publisher = TestClient::connect(&broker, "pub-3", None).await;
    for p in ["a", "b", "c"] {
        publisher
            .publish("in/o", p, PublishProperties::default())
            .await;
    }
    let a = agent.recv().await;
    let b = agent.recv().await;
    let c = agent.recv().await;
    assert_eq!([payload(&a), payload(&b), payload(&c)], ["a", "b", "c"]);
    // b and c settled, a not: nothing may be acknowledged yet.
    c.settle.settle(Outcome::Persisted);
    b.settle.settle(Outcome::Persisted);
    agent.stop().await;
    drop(a);

    let mut agent =
        Agent::start(session_settings(&broker, "rx-3"), receiver_settings("in/#")).await;
    let a = agent.recv().await;
    let b = agent.recv().await;
    let c = agent.recv().await;
    assert_eq!(
        [payload(&a), payload(&b), payload(&c)],
        ["a", "b", "c"],
        "all three redelivered: none was acked out of order"
    );
    // Settled in reverse order: all three are acknowledged once a is.
    c.settle.settle(Outcome::Sent);
    b.settle.settle(Outcome::Sent);
    a.settle.settle(Outcome::Sent);
    publisher
        .publish("in/o", "marker", PublishProperties::default())
        .await;
    let marker = agent.recv().await;
    assert_eq!(payload(&marker), "marker");
    drop(marker);
    agent.stop().await;

    let mut agent =
        Agent::start(session_settings(&broker, "rx-3"), receiver_settings("in/#")).await;
    assert_eq!(payload(&agent.recv().await), "marker");
    agent.stop().await;
}

#[tokio::test]
async fn an_unacknowledged_settle_blocks_later_acks_and_the_broker_redelivers() {
    let broker = Mosquitto::start().await.unwrap();
    let mut agent =
        Agent::start(session_settings(&broker, "rx-4"), receiver_settings("in/#")).await;
    let publisher = TestClient::connect(&broker, "pub-4", None).await;
    for p in ["a", "b"] {
        publisher
            .publish("in/s", p, PublishProperties::default())
            .await;
    }
    let a = agent.recv().await;
    let b = agent.recv().await;
    a.settle.settle(Outcome::StoreFailure);
    b.settle.settle(Outcome::Persisted);
    // Every delivery of the connection settled: the receiver reconnects and
    // the broker redelivers both, in order.
    let a = agent.recv().await;
    let b = agent.recv().await;
    assert_eq!([payload(&a), payload(&b)], ["a", "b"]);
    assert_eq!(agent.session.reconnects(), 1);
    a.settle.settle(Outcome::Persisted);
    b.settle.settle(Outcome::Persisted);
    agent.stop().await;
}

#[tokio::test]
async fn an_oversized_payload_is_delivered_as_a_defect() {
    let broker = Mosquitto::start().await.unwrap();
    let mut settings = receiver_settings("in/#");
    settings.max_payload_bytes = 8;
    let mut agent = Agent::start(session_settings(&broker, "rx-5"), settings).await;
    let publisher = TestClient::connect(&broker, "pub-5", None).await;
    publisher
        .publish("in/big", "0123456789abcdef", PublishProperties::default())
        .await;
    publisher
        .publish("in/small", "ok", PublishProperties::default())
        .await;
    let big = agent.recv().await;
    assert_eq!(big.defect, Some(Defect::Oversized { size: 16, limit: 8 }));
    big.settle.settle(Outcome::DeadLettered);
    let small = agent.recv().await;
    assert_eq!(small.defect, None);
    small.settle.settle(Outcome::Sent);
    agent.stop().await;
}

fn envelope(id: &str, payload: &str) -> Envelope {
    Envelope {
        id: id.into(),
        headers: vec![("h".into(), "1".into()), ("h".into(), "2".into())],
        payload: Bytes::from(payload.to_owned()),
        content_type: Some("application/json".into()),
        source: Source {
            transport: "mqtt".into(),
            session_id: "in".into(),
            address: "in/x".into(),
            received_at: SystemTime::now(),
        },
        expires_at: Some(SystemTime::now() + Duration::from_secs(120)),
        trace: TraceContext {
            traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
            tracestate: None,
        },
    }
}

#[tokio::test]
async fn a_send_resolves_on_puback_and_fails_transient_while_the_broker_is_down() {
    let mut broker = Mosquitto::start().await.unwrap();
    let shutdown = CancellationToken::new();
    let mut settings = session_settings(&broker, "tx-1");
    settings.clean_start = true;
    let session = MqttSession::start(settings, shutdown.clone()).unwrap();
    let mut connected = session.connected();
    wait_connected(&mut connected, true).await;
    let sender = session.sender(MqttSenderSettings {
        send_timeout: Duration::from_secs(5),
        ..MqttSenderSettings::default()
    });
    let mut consumer = TestClient::connect(&broker, "sub-1", Some("out/#")).await;
    let to = Address::new("out/a");

    sender.send(&envelope("id-1", "one"), &to).await.unwrap();
    let got = consumer.next().await;
    assert_eq!(&got.payload[..], b"one");
    let props = got.properties.unwrap();
    let user: Vec<(&str, &str)> = props
        .user_properties
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    assert_eq!(
        user,
        [
            ("h", "1"),
            ("h", "2"),
            ("ferry-message-id", "id-1"),
            (
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
            )
        ]
    );
    assert_eq!(props.content_type.as_deref(), Some("application/json"));
    assert!(
        props
            .message_expiry_interval
            .is_some_and(|s| (100..=120).contains(&s))
    );

    // Pipelined sends keep their order on the wire.
    let envelopes: Vec<Envelope> = (0..50)
        .map(|i| envelope(&format!("p-{i}"), &i.to_string()))
        .collect();
    let results = futures::future::join_all(envelopes.iter().map(|e| sender.send(e, &to))).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    for i in 0..50 {
        assert_eq!(consumer.next().await.payload, Bytes::from(i.to_string()));
    }

    // Refused before they reach the connection.
    let wildcard = sender
        .send(&envelope("id-x", "x"), &Address::new("out/+"))
        .await;
    assert!(wildcard.is_err_and(|e| e.is_permanent()));
    let mut huge = envelope("id-h", "");
    huge.payload = Bytes::from(vec![0u8; 2 * 1024 * 1024]);
    assert!(
        sender
            .send(&huge, &to)
            .await
            .is_err_and(|e| e.is_permanent())
    );

    broker.stop().await.unwrap();
    wait_connected(&mut connected, false).await;
    let down = sender.send(&envelope("id-2", "two"), &to).await;
    assert!(matches!(down, Err(SendError::Transient(_))), "{down:?}");

    broker.restart().await.unwrap();
    wait_connected(&mut connected, true).await;
    assert!(session.reconnects() >= 1);
    let consumer = TestClient::connect(&broker, "sub-1b", Some("out/#")).await;
    let mut consumer = consumer;
    sender.send(&envelope("id-3", "three"), &to).await.unwrap();
    assert_eq!(&consumer.next().await.payload[..], b"three");

    shutdown.cancel();
    session.stopped().await;
    let after = sender.send(&envelope("id-4", "four"), &to).await;
    assert!(matches!(after, Err(SendError::Transient(_))), "{after:?}");
}

/// More sends at once than the session's request queue holds (1 024): those that find it full
/// wait for the event loop to take some, woken when the session has handled a batch of events,
/// and every one resolves, in order on the wire, on one connection.
#[tokio::test]
async fn more_sends_at_once_than_the_request_queue_holds_all_resolve_in_order() {
    const N: usize = 3_000;
    let broker = Mosquitto::start().await.unwrap();
    let shutdown = CancellationToken::new();
    let mut settings = session_settings(&broker, "tx-many");
    settings.clean_start = true;
    let session = MqttSession::start(settings, shutdown.clone()).unwrap();
    wait_connected(&mut session.connected(), true).await;
    let sender = session.sender(MqttSenderSettings {
        send_timeout: Duration::from_secs(30),
        ..MqttSenderSettings::default()
    });
    let mut consumer = TestClient::connect(&broker, "sub-many", Some("many/#")).await;
    let to = Address::new("many/a");
    let envelopes: Vec<Envelope> = (0..N)
        .map(|i| envelope(&format!("m-{i}"), &i.to_string()))
        .collect();
    let sends = futures::future::join_all(envelopes.iter().map(|e| sender.send(e, &to)));
    let results = tokio::time::timeout(Duration::from_secs(60), sends)
        .await
        .expect("every send resolves");
    assert!(
        results.iter().all(Result::is_ok),
        "{:?}",
        results.iter().find(|r| r.is_err())
    );
    for i in 0..N {
        assert_eq!(consumer.next().await.payload, Bytes::from(i.to_string()));
    }
    assert_eq!(session.reconnects(), 0);
    shutdown.cancel();
    session.stopped().await;
}

#[tokio::test]
async fn mqtt_3_1_1_receives_and_sends() {
    let broker = Mosquitto::start().await.unwrap();
    let mut settings = session_settings(&broker, "v3-1");
    settings.protocol = Protocol::V311;
    let mut agent = Agent::start(settings, receiver_settings("loop/in/#")).await;
    let sender = agent.session.sender(MqttSenderSettings::default());
    sender
        .send(&envelope("v3", "hello"), &Address::new("loop/in/a"))
        .await
        .unwrap();
    let d = agent.recv().await;
    assert_eq!(payload(&d), "hello");
    assert_eq!(d.envelope.source.address, "loop/in/a");
    assert!(
        d.envelope.headers.is_empty(),
        "v3.1.1 carries no properties"
    );
    d.settle.settle(Outcome::Sent);
    agent.stop().await;
}

#[tokio::test]
async fn credentials_over_plaintext_are_refused_without_the_flag() {
    let broker = Mosquitto::start().await.unwrap();
    let mut settings = session_settings(&broker, "creds");
    settings.username = Some("user".into());
    settings.password = Some("secret".into());
    let refused = MqttSession::start(settings.clone(), CancellationToken::new());
    assert!(matches!(
        refused,
        Err(SettingsError::PlaintextCredentials(_))
    ));

    settings.allow_plaintext_credentials = true;
    let shutdown = CancellationToken::new();
    let session = MqttSession::start(settings, shutdown.clone()).unwrap();
    wait_connected(&mut session.connected(), true).await;
    shutdown.cancel();
    session.stopped().await;
}

/// A CA and a server certificate for 127.0.0.1, made with the openssl CLI.
fn make_certificates(dir: &std::path::Path) -> Option<()> {
    let openssl = |args: &[&str]| {
        std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .ok()
            .filter(|s| s.success())
            .map(|_| ())
    };
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").ok()?;
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=ferry-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    ])?;
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    ])?;
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.ext",
        "-out",
        "server.pem",
    ])
}

#[tokio::test]
async fn tls_with_a_ca_file_and_credentials() {
    let dir = tempfile::tempdir().unwrap();
    if make_certificates(dir.path()).is_none() {
        eprintln!("skipping: the openssl CLI cannot make test certificates");
        return;
    }
    let d = dir.path().display();
    let broker = Mosquitto::builder()
        .config_line(format!("certfile {d}/server.pem"))
        .config_line(format!("keyfile {d}/server.key"))
        .start()
        .await
        .unwrap();
    let mut settings = MqttSessionSettings::new(
        "tls",
        format!("mqtts://127.0.0.1:{}", broker.port()),
        "tls-1",
    );
    settings.ca_file = Some(dir.path().join("ca.pem"));
    settings.username = Some("user".into());
    settings.password = Some("secret".into());
    settings.keep_alive = Duration::from_secs(5);
    let mut receiver = receiver_settings("tls/#");
    receiver.trust_message_id = true;
    let mut agent = Agent::start(settings, receiver).await;
    let sender = agent.session.sender(MqttSenderSettings::default());
    sender
        .send(
            &envelope("tls-id", "secret payload"),
            &Address::new("tls/a"),
        )
        .await
        .unwrap();
    let d = agent.recv().await;
    assert_eq!(d.envelope.id, "tls-id");
    d.settle.settle(Outcome::Sent);
    agent.stop().await;
}
