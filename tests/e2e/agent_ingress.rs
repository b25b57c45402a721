//! What enters the agent: message identity (a forged `ferry-message-id` must not merge two
//! messages, nor their DLQ entries), oversized messages (dead-lettered as `oversized`, never
//! discarded by the broker on Ferry's behalf), and a malformed packet from a broker (reported
//! as such, not as a topic problem).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context;
use ferry_shared::api::v1 as pb;
use ferry_shared::api::v1::dlq_service_client::DlqServiceClient;
use ferry_tests::agent::{Agent, BindingCounts};
use ferry_tests::mqtt::{QoS, host_port};
use ferry_tests::{Mosquitto, PublishOptions, ids, publish_seq_with, wait};
use rumqttc::v5::mqttbytes::v5::{Packet, PublishProperties};
use rumqttc::v5::{AsyncClient, Event, MqttOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::agent_support::{Bridge, quiesced};

const DELIVERY: Duration = Duration::from_secs(60);
const MESSAGE_ID: &str = "ferry-message-id";

async fn dlq_client(agent: &Agent) -> anyhow::Result<DlqServiceClient<tonic::transport::Channel>> {
    let channel = tonic::transport::Channel::from_shared(agent.admin_url())?
        .connect()
        .await?;
    Ok(DlqServiceClient::new(channel))
}

/// DLQ entries per reason (`GetDlqStats`, so that no 20 MB entry is transferred).
async fn dlq_by_reason(agent: &Agent) -> anyhow::Result<Vec<(i32, u64)>> {
    let stats = dlq_client(agent)
        .await?
        .get_dlq_stats(pb::GetDlqStatsRequest { filter: None })
        .await?
        .into_inner();
    let mut rows: Vec<(i32, u64)> = stats.stats.iter().map(|s| (s.reason, s.count)).collect();
    rows.sort_unstable();
    Ok(rows)
}

/// Waits until binding `x` of route `r` shows `want` as (received, sent, dead_lettered)
/// with nothing in flight and the conservation law exact.
async fn figures(agent: &Agent, want: (u64, u64, u64)) -> anyhow::Result<BindingCounts> {
    wait::until_ok(DELIVERY, format!("binding x at {want:?}"), || {
        let r = agent.metrics().and_then(|m| {
            let c = m.binding("r", "x");
            anyhow::ensure!(
                (c.received, c.sent, c.dead_lettered) == want
                    && c.in_flight == 0
                    && c.is_conserved(),
                "{c:?}"
            );
            Ok(c)
        });
        std::future::ready(r)
    })
    .await
}

/// A payload and its MQTT v5 user properties.
type WithHeaders = (Vec<u8>, Vec<(String, String)>);

/// Publishes `(payload, user properties)` pairs at QoS 1 and waits for every PUBACK.
async fn publish_with_headers(
    url: &str,
    topic: &str,
    messages: Vec<WithHeaders>,
) -> anyhow::Result<()> {
    let (host, port) = host_port(url)?;
    let mut options = MqttOptions::new(ids::unique("ferry-test-pub"), host, port);
    options.set_clean_start(true);
    let (client, mut eventloop) = AsyncClient::new(options, 100);
    let n = messages.len();
    for (payload, user_properties) in messages {
        let properties = PublishProperties {
            user_properties,
            ..Default::default()
        };
        client
            .publish_with_properties(topic, QoS::AtLeastOnce, false, payload, properties)
            .await?;
    }
    let acked = async {
        let mut acked = 0;
        while acked < n {
            if let Event::Incoming(Packet::PubAck(_)) = eventloop.poll().await? {
                acked += 1;
            }
        }
        anyhow::Ok(())
    };
    tokio::time::timeout(Duration::from_secs(20), acked)
        .await
        .context("publishing with headers")??;
    Ok(())
}

/// Subscribes to `filter` on `url` and records every message's payload and
/// `ferry-message-id`.
async fn id_collector(
    url: &str,
    filter: &str,
) -> anyhow::Result<(
    Arc<Mutex<Vec<(String, String)>>>,
    tokio::task::JoinHandle<()>,
)> {
    let (host, port) = host_port(url)?;
    let mut options = MqttOptions::new(ids::unique("ferry-test-ids"), host, port);
    options.set_clean_start(true);
    let (client, mut eventloop) = AsyncClient::new(options, 100);
    client.subscribe(filter, QoS::AtLeastOnce).await?;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (subscribed_tx, subscribed) = tokio::sync::oneshot::channel();
    let record = Arc::clone(&seen);
    let task = tokio::spawn(async move {
        let _client = client;
        let mut subscribed_tx = Some(subscribed_tx);
        while let Ok(event) = eventloop.poll().await {
            match event {
                Event::Incoming(Packet::SubAck(_)) => {
                    if let Some(tx) = subscribed_tx.take() {
                        tx.send(()).ok();
                    }
                }
                Event::Incoming(Packet::Publish(p)) => {
                    let id = p
                        .properties
                        .iter()
                        .flat_map(|props| &props.user_properties)
                        .find(|(k, _)| k == MESSAGE_ID)
                        .map(|(_, v)| v.clone())
                        .unwrap_or_default();
                    let payload = String::from_utf8_lossy(&p.payload).into_owned();
                    record
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push((payload, id));
                }
                _ => {}
            }
        }
    });
    tokio::time::timeout(Duration::from_secs(10), subscribed)
        .await
        .context("no SUBACK")??;
    Ok((seen, task))
}

/// Two small and two oversized messages, each pair sharing one `ferry-message-id`.
fn same_id_pairs() -> Vec<WithHeaders> {
    let header = |id: &str| vec![(MESSAGE_ID.to_owned(), id.to_owned())];
    vec![
        (b"small-1".to_vec(), header("dup")),
        (b"small-2".to_vec(), header("dup")),
        (vec![b'a'; 2000], header("dup-big")),
        (vec![b'b'; 2000], header("dup-big")),
    ]
}

/// What the destination and the DLQ saw of [`same_id_pairs`].
struct Outcome {
    /// `(payload, ferry-message-id)` of what the destination received, sorted.
    seen: Vec<(String, String)>,
    /// DLQ entries per reason.
    dlq: Vec<(i32, u64)>,
}

/// Runs [`same_id_pairs`] through a direct_hold route with `max_payload_bytes: 1000` (the
/// two big ones are dead-lettered on binding `x`).
async fn two_messages_one_id(trust: bool) -> anyhow::Result<Outcome> {
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let mut bridge = Bridge::new(&a.url(), &b.url(), dir.path(), &["x"]);
    bridge.shared_outbox = false;
    bridge.policy.push("max_payload_bytes: 1000".into());
    let mut yaml = bridge.yaml();
    if trust {
        let receiver = "receivers:\n  - id: in\n    session_id: src\n";
        anyhow::ensure!(yaml.contains(receiver), "{yaml}");
        yaml = yaml.replace(receiver, &format!("{receiver}    trust_message_id: true\n"));
    }
    let (seen, task) = id_collector(&b.url(), &format!("{}/out/#", bridge.run)).await?;
    let mut agent = Agent::start(dir.path(), &yaml)?;
    agent.wait_ready(Duration::from_secs(20)).await?;

    publish_with_headers(&a.url(), &bridge.input(), same_id_pairs()).await?;
    // The conservation law, exact: 4 received, 2 sent, 2 dead-lettered.
    let counts = figures(&agent, (4, 2, 2)).await;
    let counts = counts.with_context(|| agent.tail())?;
    assert_eq!((counts.dropped, counts.expired), (0, 0), "{counts:?}");
    let dlq = dlq_by_reason(&agent).await?;
    wait::until(DELIVERY, "both small messages at the destination", || {
        std::future::ready(seen.lock().unwrap_or_else(PoisonError::into_inner).len() >= 2)
    })
    .await?;
    let status = agent.terminate(Duration::from_secs(15)).await?;
    assert!(status.success(), "{status}");
    task.abort();
    let mut seen = seen.lock().unwrap_or_else(PoisonError::into_inner).clone();
    seen.sort();
    Ok(Outcome { seen, dlq })
}

/// Two different messages carrying the same `ferry-message-id` (forged, or republished by
/// a consumer) through a default receiver: the destination sees two different fresh ids,
/// and when both are dead-lettered on one binding the DLQ holds both.
#[tokio::test]
async fn a_forged_message_id_does_not_merge_two_messages() -> anyhow::Result<()> {
    let Outcome { seen, dlq } = two_messages_one_id(false).await?;
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(
        (seen[0].0.as_str(), seen[1].0.as_str()),
        ("small-1", "small-2")
    );
    assert_ne!(seen[0].1, seen[1].1, "two messages, two ids: {seen:?}");
    assert!(
        seen.iter().all(|(_, id)| id != "dup" && !id.is_empty()),
        "{seen:?}"
    );
    assert_eq!(
        dlq,
        [(pb::DlqReason::Oversized as i32, 2)],
        "two DLQ entries"
    );
    Ok(())
}

/// A receiver with `trust_message_id: true` (a hop from another Ferry agent) keeps the
/// incoming id, and two different messages sharing it still get two DLQ entries.
#[tokio::test]
async fn a_trusted_message_id_is_kept_and_still_gets_two_dlq_entries() -> anyhow::Result<()> {
    let Outcome { seen, dlq } = two_messages_one_id(true).await?;
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(seen.iter().all(|(_, id)| id == "dup"), "{seen:?}");
    assert_eq!(
        dlq,
        [(pb::DlqReason::Oversized as i32, 2)],
        "two DLQ entries"
    );
    Ok(())
}

/// 5 MB and 20 MB payloads among small ones, into a shared_outbox and a direct_hold route
/// with default limits (256 KiB per message): the small ones are delivered, the big ones are
/// DLQ entries with reason `oversized`, counted as dead-lettered. A 200 KB message fits the
/// route but not the destination broker (`max_packet_size 100000`): `oversized` too.
#[tokio::test]
async fn oversized_messages_are_dead_lettered_not_lost() -> anyhow::Result<()> {
    for shared_outbox in [true, false] {
        oversized_through(shared_outbox)
            .await
            .with_context(|| format!("shared_outbox: {shared_outbox}"))?;
    }
    Ok(())
}

async fn oversized_through(shared_outbox: bool) -> anyhow::Result<()> {
    let a = Mosquitto::start().await?;
    let b = Mosquitto::builder()
        .config_line("max_packet_size 100000")
        .start()
        .await?;
    let dir = tempfile::tempdir()?;
    let mut bridge = Bridge::new(&a.url(), &b.url(), dir.path(), &["x"]);
    bridge.shared_outbox = shared_outbox;
    let collector = bridge.collector().await?;
    let agent = bridge.start_agent().await?;
    let input = bridge.input();
    let source = a.url();
    let publish = |seqs: std::ops::Range<u64>, payload_size: usize| {
        let options = PublishOptions {
            payload_size,
            ..Default::default()
        };
        publish_seq_with(&source, &input, seqs, QoS::AtLeastOnce, options)
    };
    publish(0..3, 0).await?;
    publish(100..101, 5_000_000).await?;
    publish(3..6, 0).await?;
    publish(101..102, 20_000_000).await?;
    publish(6..9, 0).await?;
    publish(102..103, 200_000).await?;
    publish(9..12, 0).await?;

    collector
        .wait_for(&bridge.output("x"), 0..12, DELIVERY)
        .await?;
    let counts = figures(&agent, (15, 12, 3)).await;
    let counts = counts.with_context(|| agent.tail())?;
    assert_eq!((counts.dropped, counts.expired), (0, 0), "{counts:?}");
    let dlq = dlq_by_reason(&agent).await?;
    assert_eq!(dlq, [(pb::DlqReason::Oversized as i32, 3)], "{dlq:?}");
    let got = collector.counts();
    for big in 100..103 {
        assert_eq!(got.count(&bridge.output("x"), big), 0, "{big} was sent");
    }
    // Every big message is in the DLQ, whole. A 20 MB entry exceeds tonic's default 4 MiB
    // decoding limit, so a client listing it must raise its limit.
    let mut sizes: Vec<(u64, usize)> = Vec::new();
    let mut client = dlq_client(&agent)
        .await?
        .max_decoding_message_size(64 * 1024 * 1024);
    let mut page_token = String::new();
    loop {
        let page = client
            .list_dlq_entries(pb::ListDlqEntriesRequest {
                page_size: 1,
                page_token: page_token.clone(),
                ..Default::default()
            })
            .await?
            .into_inner();
        for e in &page.entries {
            let payload = e
                .envelope
                .as_ref()
                .map(|env| &env.payload[..])
                .unwrap_or_default();
            let seq = ferry_tests::mqtt::parse_seq(payload).unwrap_or(u64::MAX);
            sizes.push((seq, payload.len()));
        }
        if page.next_page_token.is_empty() {
            break;
        }
        page_token = page.next_page_token;
    }
    sizes.sort_unstable();
    assert_eq!(
        sizes,
        [(100, 5_000_000), (101, 20_000_000), (102, 200_000)],
        "(seq, payload bytes) in the DLQ"
    );
    // Settled: quiesced agrees.
    quiesced(&agent, &bridge.bindings, DELIVERY).await?;
    Ok(())
}

/// Reads one MQTT packet: its first byte and its body.
async fn read_packet(socket: &mut tokio::net::TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let first = socket.read_u8().await?;
    let mut len = 0usize;
    for shift in (0..28).step_by(7) {
        let byte = socket.read_u8().await?;
        len |= usize::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            break;
        }
    }
    let mut body = vec![0; len];
    socket.read_exact(&mut body).await?;
    Ok((first, body))
}

/// A QoS 1 PUBLISH (MQTT v5) on topic `t` whose one user property value is not UTF-8.
fn publish_with_a_non_utf8_property() -> Vec<u8> {
    let mut properties = vec![0x26, 0x00, 0x01, b'k', 0x00, 0x02, 0xff, 0xfe];
    properties.insert(0, u8::try_from(properties.len()).unwrap_or(0));
    let mut body = vec![0x00, 0x01, b't', 0x00, 0x01];
    body.extend_from_slice(&properties);
    body.push(b'x');
    let mut packet = vec![0x32, u8::try_from(body.len()).unwrap_or(0)];
    packet.extend_from_slice(&body);
    packet
}

/// One connection of the fake broker: CONNACK, SUBACK, then the malformed PUBLISH; answers
/// pings until the client goes away.
async fn fake_broker_connection(mut socket: tokio::net::TcpStream) -> std::io::Result<()> {
    loop {
        let (first, body) = read_packet(&mut socket).await?;
        match first >> 4 {
            1 => socket.write_all(&[0x20, 0x03, 0x00, 0x00, 0x00]).await?,
            8 => {
                let (hi, lo) = (body[0], body[1]);
                socket.write_all(&[0x90, 0x04, hi, lo, 0x00, 0x01]).await?;
                socket
                    .write_all(&publish_with_a_non_utf8_property())
                    .await?;
            }
            12 => socket.write_all(&[0xd0, 0x00]).await?,
            14 => return Ok(()),
            _ => {}
        }
    }
}

/// A broker (fake, on loopback) sends a PUBLISH with a user property that is not UTF-8: the
/// agent says the broker sent a malformed packet, not that a topic is invalid.
#[tokio::test]
async fn a_malformed_property_is_reported_as_a_malformed_packet() -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let fake = format!("tcp://{}", listener.local_addr()?);
    let broker = tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(fake_broker_connection(socket));
        }
    });
    let b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let mut bridge = Bridge::new(&fake, &b.url(), dir.path(), &["x"]);
    bridge.shared_outbox = false;
    let mut agent = Agent::start(dir.path(), &bridge.yaml())?;
    let process = agent.process().context("no agent process")?;
    process
        .wait_for_output(
            "the broker sent a malformed packet",
            Duration::from_secs(20),
        )
        .await?;
    let output = format!("{}{}", process.stdout(), process.stderr());
    assert!(
        output.contains("not valid UTF-8 (topic or property)"),
        "{}",
        process.output_tail()
    );
    assert!(
        !output.contains("Topic not utf-8"),
        "{}",
        process.output_tail()
    );
    let status = agent.terminate(Duration::from_secs(15)).await?;
    assert!(status.success(), "{status}");
    broker.abort();
    Ok(())
}
