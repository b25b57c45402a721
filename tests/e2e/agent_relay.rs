//! The agent relaying MQTT to RabbitMQ and to NATS JetStream through `shared_outbox`, against
//! the local brokers: message ids and headers arrive as AMQP properties and NATS headers, an
//! unroutable RabbitMQ message and a message whose templated address has no value are
//! dead-lettered, JetStream drops a replayed `Nats-Msg-Id`, and cutting the connection to
//! either broker mid-run loses nothing. And the agent as the relay of an application's outbox
//! table on PostgreSQL and MariaDB: per-aggregate order, two agents on one table, a refused
//! row retried through the table's columns then dead-lettered, `LISTEN/NOTIFY`, the purge.
//!
//! Each test uses its own exclusive queue or its own stream with unique subjects (see
//! `ferry_tests::rabbitmq`, `ferry_tests::nats`).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::HeaderMap;
use ferry_shared::api::v1 as pb;
use ferry_tests::agent::Agent;
use ferry_tests::mqtt::{Collector, QoS, parse_seq};
use ferry_tests::mysql::TestMysql;
use ferry_tests::nats::TestStream;
use ferry_tests::proxy::TcpProxy;
use ferry_tests::rabbitmq::TestQueue;
use ferry_tests::{
    Mosquitto, PublishOptions, TestDatabase, ids, publish_seq, publish_seq_with, wait,
};
use mysql_async::prelude::Queryable;

use crate::agent_support::{dlq_client, quiesced};
use ferry_tests::agent::BindingCounts;

const DELIVERY: Duration = Duration::from_secs(60);
const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// An outbox table as a relay's source.
struct TableSource {
    /// `postgres_table` or `mysql_table`.
    transport: &'static str,
    url: String,
    table: String,
    /// More `options.session` lines (8 spaces of indent).
    session_extra: String,
    /// More receiver lines (4 spaces of indent).
    receiver_extra: String,
    poll_interval: &'static str,
    /// The route's `policy:` lines (6 spaces of indent), e.g. a short `send_retry_budget` so
    /// the table's own retries take over.
    policy: String,
}

impl TableSource {
    /// The table `outbox` of `db`.
    fn postgres(db: &TestDatabase) -> Self {
        Self {
            url: format!("postgres://127.0.0.1:5432/{}", db.name()),
            ..Self::postgres_named("outbox")
        }
    }

    /// The table `outbox` of `db`, with its `headers` column mapped (see
    /// [`outbox_with_headers`]).
    fn postgres_with_headers(db: &TestDatabase) -> Self {
        Self {
            receiver_extra: "    columns:\n      headers: headers\n".into(),
            ..Self::postgres(db)
        }
    }

    /// The table `outbox` of `db` on MariaDB / MySQL.
    fn mysql(db: &TestMysql) -> Self {
        Self {
            transport: "mysql_table",
            url: db.url_without_user(),
            ..Self::postgres_named("outbox")
        }
    }

    fn postgres_named(table: &str) -> Self {
        Self {
            transport: "postgres_table",
            url: String::new(),
            table: table.into(),
            session_extra: String::new(),
            receiver_extra: String::new(),
            poll_interval: "100ms",
            policy: String::new(),
        }
    }
}

/// A bridge from a private Mosquitto (`{run}/in`), or from an outbox table, to one RabbitMQ,
/// NATS or MQTT session.
struct Relay {
    run: String,
    mqtt: String,
    /// The source is this outbox table instead of `mqtt`.
    table: Option<TableSource>,
    /// A `direct_hold` route (one binding) instead of `shared_outbox`.
    direct_hold: bool,
    /// `rabbitmq`, `nats` or `mqtt`.
    transport: &'static str,
    url: String,
    /// `(binding id, address)`.
    bindings: Vec<(String, String)>,
    dir: std::path::PathBuf,
}

impl Relay {
    /// From the private Mosquitto at `mqtt` (`{run}/in`) through `shared_outbox` to the
    /// `transport` session at `url`.
    fn from_mqtt(
        mqtt: String,
        transport: &'static str,
        url: String,
        bindings: Vec<(String, String)>,
        dir: &std::path::Path,
    ) -> Self {
        Relay {
            run: ids::unique("e2e"),
            mqtt,
            table: None,
            direct_hold: false,
            transport,
            url,
            bindings,
            dir: dir.to_owned(),
        }
    }

    /// From `table` through `direct_hold` (a row is marked once the destination accepted it)
    /// to the `transport` session at `url`.
    fn from_table(
        table: TableSource,
        transport: &'static str,
        url: String,
        bindings: Vec<(String, String)>,
        dir: &std::path::Path,
    ) -> Self {
        Relay {
            run: ids::unique("e2e"),
            mqtt: String::new(),
            table: Some(table),
            direct_hold: true,
            transport,
            url,
            bindings,
            dir: dir.to_owned(),
        }
    }

    fn input(&self) -> String {
        format!("{}/in", self.run)
    }

    fn binding_ids(&self) -> Vec<String> {
        self.bindings.iter().map(|(id, _)| id.clone()).collect()
    }

    fn yaml(&self) -> String {
        let dir = self.dir.display();
        let (source, receiver) = match &self.table {
            None => (
                format!(
                    "  - id: src\n    transport: mqtt\n    options:\n      session:\n        broker_url: {}\n        client_id: {}-in\n        keep_alive: 5\n",
                    self.mqtt, self.run
                ),
                format!(
                    "    topics:\n      - topic: {}\n        qos: 1\n",
                    self.input()
                ),
            ),
            Some(t) => (
                format!(
                    "  - id: src\n    transport: {}\n    options:\n      session:\n        url: {}\n{}",
                    t.transport, t.url, t.session_extra
                ),
                format!(
                    "    table: {}\n    poll_interval: {}\n{}",
                    t.table, t.poll_interval, t.receiver_extra
                ),
            ),
        };
        let destination = if self.transport == "mqtt" {
            format!(
                "broker_url: {}\n        client_id: {}-out\n",
                self.url, self.run
            )
        } else {
            format!("url: {}\n", self.url)
        };
        let mut y = format!(
            "bridge:\n  id: e2e\n\
             sessions:\n\
             {source}\
             \x20 - id: dst\n    transport: {transport}\n    options:\n      session:\n        {destination}\
             stores:\n\
             \x20 outbox:\n    type: sqlite\n    options:\n      path: {dir}/outbox.db\n\
             \x20 lease:\n    type: sqlite\n    options:\n      path: {dir}/lease.db\n\
             \x20 dlq:\n    type: sqlite\n    options:\n      path: {dir}/dlq.db\n\
             receivers:\n  - id: in\n    session_id: src\n{receiver}\
             senders:\n  - id: out\n    session_id: dst\n\
             bindings:\n",
            transport = self.transport,
        );
        for (id, address) in &self.bindings {
            let _ = writeln!(
                y,
                "  - id: {id}\n    sender_id: out\n    address: \"{address}\""
            );
        }
        let bindings = self.binding_ids().join(", ");
        if self.direct_hold {
            let _ = write!(
                y,
                "routes:\n  - id: r\n    receiver_id: in\n    delivery_mode: direct_hold\n    bindings: [{bindings}]\n"
            );
            if let Some(t) = self.table.as_ref().filter(|t| !t.policy.is_empty()) {
                let _ = write!(y, "    policy:\n{}", t.policy);
            }
        } else {
            let _ = write!(
                y,
                "routes:\n  - id: r\n    receiver_id: in\n    delivery_mode: shared_outbox\n    dispatch_mode: fan_out\n    bindings: [{bindings}]\n\
                 \x20   session:\n      session_id: dst\n      sender_id: out\n      drain_interval: 200ms\n      drain_batch_size: 100\n      lease_ttl: 3s\n      step_down_grace: 2s\n",
            );
        }
        y
    }

    async fn start_agent(&self) -> anyhow::Result<Agent> {
        let mut agent = Agent::start(&self.dir, &self.yaml())?;
        agent.wait_ready(Duration::from_secs(20)).await?;
        Ok(agent)
    }
}

/// Waits until every binding has finished `expected` messages (sent or dead-lettered) with
/// nothing in flight and its counters conserved; returns the counts. (Quiescence alone can
/// hold before the last messages were even received.)
async fn finished(
    agent: &Agent,
    relay: &Relay,
    expected: u64,
) -> anyhow::Result<Vec<BindingCounts>> {
    let bindings = relay.binding_ids();
    wait::until(
        DELIVERY,
        format!("{expected} messages finished per binding"),
        || {
            std::future::ready(agent.metrics().is_ok_and(|m| {
                bindings.iter().all(|b| {
                    let c = m.binding("r", b);
                    c.sent + c.dead_lettered >= expected
                })
            }))
        },
    )
    .await?;
    quiesced(agent, &bindings, DELIVERY).await
}

fn seqs<'a>(payloads: impl Iterator<Item = &'a [u8]>) -> BTreeSet<u64> {
    payloads.filter_map(parse_seq).collect()
}

/// MQTT → a RabbitMQ queue: every message arrives persistent, with the Ferry message id as
/// `message_id` and as the `ferry-message-id` header, and with the incoming headers
/// (`traceparent`, `site`). A second binding to a queue that does not exist (mandatory
/// publish, returned unroutable) dead-letters every message without holding up the first.
#[tokio::test]
async fn mqtt_to_rabbitmq_keeps_ids_and_headers_and_dead_letters_unroutable() -> anyhow::Result<()>
{
    const N: u64 = 1000;
    let mosquitto = Mosquitto::start().await?;
    let queue = TestQueue::declare("ferry-e2e").await?;
    let dir = tempfile::tempdir()?;
    let relay = Relay::from_mqtt(
        mosquitto.url(),
        "rabbitmq",
        ferry_tests::rabbitmq::url(),
        vec![
            ("q".into(), format!("/{}", queue.name)),
            (
                "nowhere".into(),
                format!("/{}", ids::unique("no-such-queue")),
            ),
        ],
        dir.path(),
    );
    let agent = relay.start_agent().await?;
    publish_seq_with(
        &mosquitto.url(),
        &relay.input(),
        0..N,
        QoS::AtLeastOnce,
        PublishOptions {
            user_properties: vec![
                ("traceparent".into(), TRACEPARENT.into()),
                ("site".into(), "eu".into()),
            ],
            ..PublishOptions::default()
        },
    )
    .await?;
    let got = queue
        .wait_until(DELIVERY, "every message in the queue", |r| {
            seqs(r.iter().map(|m| m.payload.as_slice())).len() == N as usize
        })
        .await?;
    for m in &got {
        let id = m.message_id.as_deref().unwrap_or_default();
        assert!(!id.is_empty(), "{m:?}");
        assert_eq!(
            m.headers.get("ferry-message-id").map(String::as_str),
            Some(id)
        );
        assert_eq!(m.headers.get("site").map(String::as_str), Some("eu"));
        assert!(m.headers.contains_key("traceparent"), "{m:?}");
        assert_eq!(m.delivery_mode, Some(2));
    }
    let ids: BTreeSet<_> = got.iter().filter_map(|m| m.message_id.clone()).collect();
    assert_eq!(ids.len(), N as usize, "one id per message");
    let counts = finished(&agent, &relay, N).await?;
    assert_eq!((counts[0].sent, counts[0].dead_lettered), (N, 0));
    assert_eq!((counts[1].sent, counts[1].dead_lettered), (0, N));
    queue.delete().await;
    Ok(())
}

/// MQTT → JetStream with a templated subject `{prefix}.sites.{header:site}`: messages land on
/// their site's subject, those without a `site` header are dead-lettered; each stored message
/// carries `Nats-Msg-Id` = its Ferry message id, so publishing one again is acknowledged as a
/// duplicate and not stored.
#[tokio::test]
async fn mqtt_to_jetstream_routes_by_header_and_dedups_a_replay() -> anyhow::Result<()> {
    let mosquitto = Mosquitto::start().await?;
    let stream = TestStream::create("ferry_e2e").await?;
    let dir = tempfile::tempdir()?;
    let relay = Relay::from_mqtt(
        mosquitto.url(),
        "nats",
        ferry_tests::nats::url(),
        vec![(
            "js".into(),
            format!("{}.sites.{{header:site}}", stream.subject),
        )],
        dir.path(),
    );
    let agent = relay.start_agent().await?;
    for (site, range) in [("eu", 0..10), ("us", 10..20)] {
        publish_seq_with(
            &mosquitto.url(),
            &relay.input(),
            range,
            QoS::AtLeastOnce,
            PublishOptions {
                user_properties: vec![("site".into(), site.into())],
                ..PublishOptions::default()
            },
        )
        .await?;
    }
    publish_seq(&mosquitto.url(), &relay.input(), 20..25, QoS::AtLeastOnce).await?;
    let counts = finished(&agent, &relay, 25).await?;
    assert_eq!((counts[0].sent, counts[0].dead_lettered), (20, 5));
    let stored = stream.wait_for(20, DELIVERY).await?;
    assert_eq!(stored.len(), 20);
    for m in &stored {
        let seq = parse_seq(&m.payload).unwrap_or(u64::MAX);
        let site = if seq < 10 { "eu" } else { "us" };
        assert_eq!(m.subject, format!("{}.sites.{site}", stream.subject));
        assert!(
            m.header("Nats-Msg-Id")
                .is_some_and(|id| Some(id) == m.header("ferry-message-id")),
            "{m:?}"
        );
    }
    // A replay of the first message (what a resend after a lost ack is) is dropped.
    let first = &stored[0];
    let mut headers = HeaderMap::new();
    headers.insert(
        "Nats-Msg-Id",
        first.header("Nats-Msg-Id").unwrap_or_default(),
    );
    let ack = stream
        .context
        .publish_with_headers(first.subject.clone(), headers, first.payload.clone().into())
        .await?
        .await?;
    assert!(ack.duplicate, "{ack:?}");
    assert_eq!(stream.messages().await?.len(), 20);
    stream.delete().await?;
    Ok(())
}

/// Publishes `0..n` while the broker's connection is cut (through a TCP proxy) as soon as the
/// first messages arrive; restores it once the session is down and everything is published.
async fn cut_mid_run(
    relay: &Relay,
    proxy: &TcpProxy,
    n: u64,
    delivered: impl AsyncFn() -> usize,
) -> anyhow::Result<Agent> {
    let agent = relay.start_agent().await?;
    let (url, topic) = (relay.mqtt.clone(), relay.input());
    let publisher =
        tokio::spawn(async move { publish_seq(&url, &topic, 0..n, QoS::AtLeastOnce).await });
    let delivered = &delivered;
    wait::until(
        DELIVERY,
        "the first messages delivered",
        move || async move { delivered().await > 0 },
    )
    .await?;
    proxy.cut().await;
    let cut_at = delivered().await;
    wait::until(DELIVERY, "the session disconnected", || {
        std::future::ready(
            agent
                .metrics()
                .is_ok_and(|m| m.session("ferry_session_connected", "dst") == 0.0),
        )
    })
    .await?;
    publisher.await??;
    proxy.restore().await?;
    eprintln!("cut after {cut_at} of {n} messages had arrived");
    Ok(agent)
}

/// The connection to RabbitMQ is cut mid-run and restored: every message arrives (a resend
/// of an unconfirmed one may arrive twice), none is dead-lettered.
#[tokio::test]
async fn rabbitmq_connection_cut_mid_run_loses_nothing() -> anyhow::Result<()> {
    const N: u64 = 2000;
    let mosquitto = Mosquitto::start().await?;
    let queue = TestQueue::declare("ferry-e2e-cut").await?;
    let proxy = TcpProxy::start("127.0.0.1:5672".parse()?).await?;
    let dir = tempfile::tempdir()?;
    let relay = Relay::from_mqtt(
        mosquitto.url(),
        "rabbitmq",
        format!("amqp://127.0.0.1:{}/%2f", proxy.addr().port()),
        vec![("q".into(), queue.name.clone())],
        dir.path(),
    );
    let agent = cut_mid_run(&relay, &proxy, N, async || queue.received().len()).await?;
    queue
        .wait_until(DELIVERY, "every message after the cut", |r| {
            seqs(r.iter().map(|m| m.payload.as_slice())) == (0..N).collect()
        })
        .await?;
    let counts = finished(&agent, &relay, N).await?;
    assert_eq!((counts[0].sent, counts[0].dead_lettered), (N, 0));
    queue.delete().await;
    Ok(())
}

/// The connection to NATS is cut mid-run and restored: every message is in the stream exactly
/// once (a resend of an unacknowledged one is dropped by its `Nats-Msg-Id`).
#[tokio::test]
async fn jetstream_connection_cut_mid_run_stores_each_message_once() -> anyhow::Result<()> {
    const N: u64 = 2000;
    let mosquitto = Mosquitto::start().await?;
    let stream = TestStream::create("ferry_e2e_cut").await?;
    let proxy = TcpProxy::start("127.0.0.1:4222".parse()?).await?;
    let dir = tempfile::tempdir()?;
    let relay = Relay::from_mqtt(
        mosquitto.url(),
        "nats",
        format!("nats://127.0.0.1:{}", proxy.addr().port()),
        vec![("js".into(), format!("{}.events", stream.subject))],
        dir.path(),
    );
    let agent = cut_mid_run(&relay, &proxy, N, async || {
        stream.messages().await.map_or(0, |m| m.len())
    })
    .await?;
    let counts = finished(&agent, &relay, N).await?;
    assert_eq!((counts[0].sent, counts[0].dead_lettered), (N, 0));
    let stored = stream.wait_for(N as usize, DELIVERY).await?;
    assert_eq!(stored.len(), N as usize, "each message stored once");
    assert_eq!(
        seqs(stored.iter().map(|m| m.payload.as_slice())),
        (0..N).collect()
    );
    stream.delete().await?;
    Ok(())
}

/// An application writes business rows, each with its outbox row in the same transaction
/// (seed 004's table); the agent relays the table to JetStream on per-aggregate subjects
/// (`{prefix}.{header:aggregate_id}`) through `shared_outbox`: every row arrives once, with
/// `Nats-Msg-Id` = `outbox:ID`, and every row ends up with `sent_at` set.
#[tokio::test]
async fn postgres_outbox_table_to_jetstream_marks_every_row_sent() -> anyhow::Result<()> {
    const N: i64 = 300;
    let db = TestDatabase::create().await?;
    let app = db.connect().await?;
    app.batch_execute(OUTBOX_DDL).await?;
    let stream = TestStream::create("ferry_e2e_table").await?;
    let dir = tempfile::tempdir()?;
    let relay = Relay {
        direct_hold: false,
        ..Relay::from_table(
            TableSource::postgres(&db),
            "nats",
            ferry_tests::nats::url(),
            vec![(
                "js".into(),
                format!("{}.{{header:aggregate_id}}", stream.subject),
            )],
            dir.path(),
        )
    };
    let agent = relay.start_agent().await?;
    write_orders(&app, 0..N, 7).await?;
    let n = u64::try_from(N)?;
    let counts = finished(&agent, &relay, n).await?;
    assert_eq!((counts[0].sent, counts[0].dead_lettered), (n, 0));
    let stored = stream.wait_for(N as usize, DELIVERY).await?;
    assert_eq!(stored.len(), N as usize, "each row stored once");
    for m in &stored {
        let seq = parse_seq(&m.payload).unwrap_or(u64::MAX);
        assert_eq!(
            m.subject,
            format!("{}.a{}", stream.subject, seq % 7),
            "{m:?}"
        );
        assert_eq!(m.header("event"), Some("created"));
        assert_eq!(
            m.header("Nats-Msg-Id"),
            Some(format!("outbox:{}", seq + 1).as_str())
        );
    }
    wait::until(DELIVERY, "every row marked sent", || async {
        app.query_one("SELECT count(*) FROM outbox WHERE sent_at IS NULL", &[])
            .await
            .is_ok_and(|row| row.get::<_, i64>(0) == 0)
    })
    .await?;
    stream.delete().await?;
    Ok(())
}

/// A table relayed through a broker outage: the connection to NATS is cut (through a TCP
/// proxy) while the agent relays a PostgreSQL outbox table with `direct_hold` (a row is marked
/// sent only on the stream's ack), and restored. The rows in flight fail and are retried
/// through their `retry_at`: every row is in the stream exactly once (a resend of an
/// unacknowledged one is dropped by its `Nats-Msg-Id`), every row is marked sent, none is
/// dead-lettered.
#[tokio::test]
async fn a_table_relayed_through_a_jetstream_outage_loses_nothing() -> anyhow::Result<()> {
    const N: i64 = 2000;
    let db = TestDatabase::create().await?;
    let app = db.connect().await?;
    app.batch_execute(OUTBOX_DDL).await?;
    let stream = TestStream::create("ferry_e2e_table_cut").await?;
    let proxy = TcpProxy::start("127.0.0.1:4222".parse()?).await?;
    let dir = tempfile::tempdir()?;
    let relay = Relay::from_table(
        TableSource::postgres(&db),
        "nats",
        format!("nats://127.0.0.1:{}", proxy.addr().port()),
        vec![("js".into(), format!("{}.events", stream.subject))],
        dir.path(),
    );
    let agent = relay.start_agent().await?;
    insert_rows(&app, 0, N).await?;
    wait::until(DELIVERY, "the first rows in the stream", || async {
        stream.messages().await.is_ok_and(|m| !m.is_empty())
    })
    .await?;
    proxy.cut().await;
    let cut_at = stream.messages().await.map_or(0, |m| m.len());
    wait::until(DELIVERY, "the session disconnected", || {
        std::future::ready(
            agent
                .metrics()
                .is_ok_and(|m| m.session("ferry_session_connected", "dst") == 0.0),
        )
    })
    .await?;
    proxy.restore().await?;
    eprintln!("cut after {cut_at} of {N} rows were in the stream");
    let n = u64::try_from(N)?;
    let counts = finished(&agent, &relay, n).await?;
    assert_eq!((counts[0].sent, counts[0].dead_lettered), (n, 0));
    let stored = stream.wait_for(N as usize, DELIVERY).await?;
    assert_eq!(stored.len(), N as usize, "each row stored once");
    assert_eq!(
        seqs(stored.iter().map(|m| m.payload.as_slice())),
        (0..n).collect()
    );
    all_rows_sent(&app).await?;
    stream.delete().await?;
    Ok(())
}

/// Seed 004's outbox table, beside a business table.
const OUTBOX_DDL: &str = "CREATE TABLE orders (id bigint PRIMARY KEY);
     CREATE TABLE outbox (
         id bigserial PRIMARY KEY,
         aggregate_type varchar(255) NOT NULL,
         aggregate_id varchar(255) NOT NULL,
         event varchar(255) NOT NULL,
         payload json NOT NULL,
         retry_at timestamptz,
         retry_count int,
         sent_at timestamptz)";

/// The application's writes: order `i` of `orders`, each its business row and its outbox row
/// (aggregate `a{i % aggregates}`, payload `i`) in one transaction.
async fn write_orders(
    app: &tokio_postgres::Client,
    orders: std::ops::Range<i64>,
    aggregates: i64,
) -> anyhow::Result<()> {
    for i in orders {
        app.batch_execute(&format!(
            "BEGIN;
             INSERT INTO orders VALUES ({i});
             INSERT INTO outbox (aggregate_type, aggregate_id, event, payload)
                 VALUES ('orders', 'a{}', 'created', '{i}');
             COMMIT",
            i % aggregates
        ))
        .await?;
    }
    Ok(())
}

/// Inserts outbox rows `from..to` (payload = the number) in one statement.
async fn insert_rows(app: &tokio_postgres::Client, from: i64, to: i64) -> anyhow::Result<()> {
    app.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event, payload)
         SELECT 'orders', 'a' || (i % 7), 'created', to_json(i)
         FROM generate_series($1::bigint, $2::bigint - 1) AS i",
        &[&from, &to],
    )
    .await?;
    Ok(())
}

/// Waits until no row of the outbox is left unsent.
/// `OUTBOX_DDL` in `db` with a `headers` column (jsonb), and rows `0..n` whose headers are the
/// SQL expression `headers` of the row number `i`; the application's connection.
async fn outbox_with_headers(
    db: &TestDatabase,
    n: i64,
    headers: &str,
) -> anyhow::Result<tokio_postgres::Client> {
    let app = db.connect().await?;
    app.batch_execute(OUTBOX_DDL).await?;
    app.batch_execute("ALTER TABLE outbox ADD COLUMN headers jsonb")
        .await?;
    let insert = format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event, payload, headers)
         SELECT 'orders', 'a' || (i % 4), 'created', to_json(i), {headers}
         FROM generate_series(0, $1::bigint - 1) AS i"
    );
    app.execute(&insert, &[&n]).await?;
    Ok(app)
}

async fn all_rows_sent(app: &tokio_postgres::Client) -> anyhow::Result<()> {
    wait::until(DELIVERY, "every row marked sent", || async {
        app.query_one("SELECT count(*) FROM outbox WHERE sent_at IS NULL", &[])
            .await
            .is_ok_and(|row| row.get::<_, i64>(0) == 0)
    })
    .await
}

/// Two agents relay one outbox table (direct_hold to JetStream): in normal operation each row is
/// sent by exactly one of them (their `sent` counters add up to the rows); then one that is
/// sending is SIGKILLed mid-run: the other finishes the table (the dead agent's claims run out
/// after `claim_ttl`) and the stream holds every row exactly once (a row the dead agent sent but
/// could not mark is sent again, and dropped by its `Nats-Msg-Id`), in order per aggregate.
/// Either agent may relay a whole batch while the other's poll waits (on a loaded machine one
/// relayed none of the first 1 000 rows), so the one killed is whichever is sending.
#[tokio::test]
async fn two_agents_relay_one_table_and_one_survives_a_sigkill() -> anyhow::Result<()> {
    const N: i64 = 1000;
    let db = TestDatabase::create().await?;
    let app = db.connect().await?;
    app.batch_execute(OUTBOX_DDL).await?;
    let stream = TestStream::create("ferry_e2e_two").await?;
    let (dir_a, dir_b) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let relay = |dir: &std::path::Path| Relay {
        run: ids::unique("e2e"),
        mqtt: String::new(),
        table: Some(TableSource {
            receiver_extra: "    claim_ttl: 3s\n".into(),
            ..TableSource::postgres(&db)
        }),
        direct_hold: true,
        transport: "nats",
        url: ferry_tests::nats::url(),
        bindings: vec![(
            "js".into(),
            format!("{}.{{header:aggregate_id}}", stream.subject),
        )],
        dir: dir.to_owned(),
    };
    let (relay_a, relay_b) = (relay(dir_a.path()), relay(dir_b.path()));
    let a = relay_a.start_agent().await?;
    let b = relay_b.start_agent().await?;
    insert_rows(&app, 0, N).await?;
    all_rows_sent(&app).await?;
    let sent = |agent: &Agent| agent.metrics().map(|m| m.binding("r", "js").sent);
    let (sent_a, sent_b) = (sent(&a)?, sent(&b)?);
    assert_eq!(
        sent_a + sent_b,
        u64::try_from(N)?,
        "a: {sent_a}, b: {sent_b}"
    );
    let mut agents = [("a", a, sent_a), ("b", b, sent_b)];
    insert_rows(&app, N, 3 * N).await?;
    let sending = |agents: &[(&str, Agent, u64)]| {
        agents
            .iter()
            .position(|(_, agent, before)| sent(agent).is_ok_and(|s| s > *before))
    };
    wait::until(DELIVERY, "an agent sending the second batch", || {
        std::future::ready(sending(&agents).is_some())
    })
    .await?;
    let (name, victim, _) = &mut agents[sending(&agents).context("an agent was sending")?];
    let killed_at = sent(victim)?;
    victim.kill()?;
    all_rows_sent(&app).await?;
    eprintln!(
        "rows 0..{N}: a sent {sent_a}, b sent {sent_b}; {name} killed after {killed_at} sends"
    );
    let stored = stream.wait_for(3 * N as usize, DELIVERY).await?;
    assert_eq!(stored.len(), 3 * N as usize, "each row stored once");
    let rows: BTreeSet<u64> = seqs(stored.iter().map(|m| m.payload.as_slice()));
    assert_eq!(rows, (0..3 * u64::try_from(N)?).collect());
    assert_ordered(&per_subject(&stored));
    stream.delete().await?;
    Ok(())
}

/// The events of `stored` per subject, in stream order (the payloads as numbers).
fn per_subject(
    stored: &[ferry_tests::nats::Stored],
) -> std::collections::BTreeMap<String, Vec<u64>> {
    let mut by_subject: std::collections::BTreeMap<String, Vec<u64>> = Default::default();
    for m in stored {
        by_subject
            .entry(m.subject.clone())
            .or_default()
            .extend(parse_seq(&m.payload));
    }
    by_subject
}

/// Each subject's events are in ascending order (the rows' id order, since payloads ascend
/// with ids).
fn assert_ordered(by_subject: &std::collections::BTreeMap<String, Vec<u64>>) {
    for (subject, seqs) in by_subject {
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "{subject} out of order: {seqs:?}"
        );
    }
}

/// A row whose payload JetStream refuses (larger than the stream's `max_msg_size`, a transient
/// error to the sender) is retried through the table's `retry_count` / `retry_at` columns and
/// dead-lettered once `max_retries` is reached, which lets the rows behind it in its aggregate
/// go, in order. Meanwhile the other aggregates are not held up: every one of their rows is
/// sent while the refused row still waits for a retry.
#[tokio::test]
async fn a_refused_row_is_retried_then_dead_lettered_without_holding_up_other_aggregates()
-> anyhow::Result<()> {
    const N: i64 = 700;
    let db = TestDatabase::create().await?;
    let app = db.connect().await?;
    app.batch_execute(OUTBOX_DDL).await?;
    let stream = TestStream::create("ferry_e2e_refused").await?;
    let mut config = stream
        .context
        .get_stream(&stream.name)
        .await?
        .info()
        .await?
        .config
        .clone();
    config.max_message_size = 1024;
    stream.context.update_stream(config).await?;
    let dir = tempfile::tempdir()?;
    let relay = Relay::from_table(
        TableSource {
        // Failures 1, 2 and 3 wait 2s, 4s and 8s: the rows of the other aggregates have
        // long been sent when the refused row is dead-lettered.
        receiver_extra: "    max_retries: 3\n    retry_backoff: 2s\n    retry_backoff_max: 8s\n"
            .into(),
        policy: "      send_retry_budget: 200ms\n      retry_backoff:\n        initial_interval: 20ms\n        max_interval: 50ms\n".into(),
        ..TableSource::postgres(&db)
    },
        "nats",
        ferry_tests::nats::url(),
        vec![(
        "js".into(),
        format!("{}.{{header:aggregate_id}}", stream.subject),
    )],
        dir.path(),
    );
    // The refused row heads aggregate `bad`; three rows follow it there.
    app.batch_execute(&format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event, payload)
             VALUES ('orders', 'bad', 'created', to_json(repeat('x', 4000)));
         INSERT INTO outbox (aggregate_type, aggregate_id, event, payload)
             SELECT 'orders', 'bad', 'created', to_json(i)
             FROM generate_series({N}::bigint, {N}::bigint + 2) AS i"
    ))
    .await?;
    insert_rows(&app, 0, N).await?;
    let agent = relay.start_agent().await?;
    wait::until(
        DELIVERY,
        "every row of the other aggregates sent",
        || async {
            app.query_one(
                "SELECT count(*) FROM outbox WHERE sent_at IS NULL AND aggregate_id <> 'bad'",
                &[],
            )
            .await
            .is_ok_and(|row| row.get::<_, i64>(0) == 0)
        },
    )
    .await?;
    let head = app
        .query_one(
            "SELECT sent_at IS NULL, coalesce(retry_count, 0) FROM outbox ORDER BY id LIMIT 1",
            &[],
        )
        .await?;
    assert!(
        head.get::<_, bool>(0),
        "the refused row was settled before the other aggregates were done"
    );
    assert!(head.get::<_, i32>(1) < 3, "{}", head.get::<_, i32>(1));
    all_rows_sent(&app).await?;
    let total = u64::try_from(N)? + 4;
    let counts = finished(&agent, &relay, total).await?;
    assert_eq!(
        (counts[0].sent, counts[0].dead_lettered),
        (total - 1, 1),
        "every row sent or dead-lettered, once"
    );
    let retries: i32 = app
        .query_one("SELECT retry_count FROM outbox ORDER BY id LIMIT 1", &[])
        .await?
        .get(0);
    assert_eq!(retries, 3);
    let stored = stream
        .wait_for(usize::try_from(total - 1)?, DELIVERY)
        .await?;
    let by_subject = per_subject(&stored);
    assert_ordered(&by_subject);
    let n = u64::try_from(N)?;
    assert_eq!(
        by_subject.get(&format!("{}.bad", stream.subject)),
        Some(&vec![n, n + 1, n + 2])
    );
    assert_eq!(
        seqs(stored.iter().map(|m| m.payload.as_slice())),
        (0..n + 3).collect()
    );
    stream.delete().await?;
    Ok(())
}

/// Seed 004's set-up on MariaDB: an application writes business rows, each with its outbox row
/// in the same transaction, from several tasks at once; the agent relays the table to JetStream
/// with per-aggregate subjects: every event arrives once and in order per aggregate, and the
/// sent rows are purged after the (short) retention.
#[tokio::test]
async fn mariadb_outbox_table_to_jetstream_in_order_per_aggregate_then_purged() -> anyhow::Result<()>
{
    const WRITERS: u64 = 4;
    const PER_WRITER: u64 = 2_500;
    let db = TestMysql::create().await?;
    let mut app = db.connect().await?;
    app.query_drop("CREATE TABLE orders (id BIGINT PRIMARY KEY)")
        .await?;
    app.query_drop(
        "CREATE TABLE outbox (
             id BIGINT AUTO_INCREMENT PRIMARY KEY,
             aggregate_type VARCHAR(255) NOT NULL,
             aggregate_id VARCHAR(255) NOT NULL,
             event VARCHAR(255) NOT NULL,
             payload JSON NOT NULL,
             retry_at DATETIME(6) NULL,
             retry_count INT NULL,
             sent_at DATETIME(6) NULL,
             KEY outbox_aggregate (aggregate_id, id))",
    )
    .await?;
    let stream = TestStream::create("ferry_e2e_mysql").await?;
    let dir = tempfile::tempdir()?;
    let relay = Relay::from_table(
        TableSource {
            receiver_extra: "    retention: 1s\n".into(),
            ..TableSource::mysql(&db)
        },
        "nats",
        ferry_tests::nats::url(),
        vec![(
            "js".into(),
            format!("{}.{{header:aggregate_id}}", stream.subject),
        )],
        dir.path(),
    );
    let agent = relay.start_agent().await?;
    // Each writer owns aggregates w{k}-0..2 and writes one transaction per event, so its
    // events commit in id order per aggregate (as an application serializing each aggregate).
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let mut conn = db.connect().await?;
        writers.push(tokio::spawn(async move {
            for i in 0..PER_WRITER {
                let seq = w * PER_WRITER + i;
                let mut txn = conn
                    .start_transaction(mysql_async::TxOpts::default())
                    .await?;
                txn.query_drop(format!("INSERT INTO orders VALUES ({seq})"))
                    .await?;
                txn.query_drop(format!(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event, payload) \
                     VALUES ('orders', 'w{w}-{}', 'created', '{seq}')",
                    i % 3
                ))
                .await?;
                txn.commit().await?;
            }
            anyhow::Ok(())
        }));
    }
    for writer in writers {
        writer.await??;
    }
    let total = WRITERS * PER_WRITER;
    let counts = finished(&agent, &relay, total).await?;
    assert_eq!((counts[0].sent, counts[0].dead_lettered), (total, 0));
    let stored = stream.wait_for(usize::try_from(total)?, DELIVERY).await?;
    assert_eq!(
        stored.len(),
        usize::try_from(total)?,
        "each row stored once"
    );
    let by_subject = per_subject(&stored);
    assert_eq!(by_subject.len(), usize::try_from(WRITERS * 3)?);
    assert_ordered(&by_subject);
    assert_eq!(
        seqs(stored.iter().map(|m| m.payload.as_slice())),
        (0..total).collect()
    );
    until_none_left(&db, "the sent rows purged", "SELECT count(*) FROM outbox").await?;
    stream.delete().await?;
    Ok(())
}

/// Waits until `count_sql` (a `SELECT count(*)`) answers 0 on MariaDB `db`, on a connection of
/// its own each time.
async fn until_none_left(db: &TestMysql, what: &str, count_sql: &str) -> anyhow::Result<()> {
    wait::until(DELIVERY, what, || async {
        match db.connect().await {
            Ok(mut c) => c
                .query_first::<i64, _>(count_sql)
                .await
                .is_ok_and(|n| n == Some(0)),
            Err(_) => false,
        }
    })
    .await
}

/// With the optional trigger installed and `notify_channel` set, a row is claimed as soon as
/// it commits: the poll interval is an hour, so without the notification nothing would arrive
/// within the test's wait. With `on_sent: delete` every relayed row is gone from the table.
#[tokio::test]
async fn postgres_notify_wakes_the_relay_before_the_poll_interval() -> anyhow::Result<()> {
    const N: i64 = 50;
    let db = TestDatabase::create().await?;
    let app = db.connect().await?;
    app.batch_execute(OUTBOX_DDL).await?;
    app.batch_execute(NOTIFY_TRIGGER).await?;
    let stream = TestStream::create("ferry_e2e_notify").await?;
    let dir = tempfile::tempdir()?;
    let relay = Relay::from_table(
        TableSource {
            poll_interval: "1h",
            receiver_extra: "    notify_channel: ferry_outbox\n    on_sent: delete\n".into(),
            ..TableSource::postgres(&db)
        },
        "nats",
        ferry_tests::nats::url(),
        vec![(
            "js".into(),
            format!("{}.{{header:aggregate_id}}", stream.subject),
        )],
        dir.path(),
    );
    let agent = relay.start_agent().await?;
    // Ready means connected and past the first (empty) claim's start; rows inserted now are
    // found by a notification, one transaction each.
    for i in 0..N {
        insert_rows(&app, i, i + 1).await?;
    }
    let stored = stream.wait_for(N as usize, DELIVERY).await?;
    assert_eq!(
        seqs(stored.iter().map(|m| m.payload.as_slice())),
        (0..u64::try_from(N)?).collect()
    );
    wait::until(DELIVERY, "every relayed row deleted", || async {
        app.query_one("SELECT count(*) FROM outbox", &[])
            .await
            .is_ok_and(|row| row.get::<_, i64>(0) == 0)
    })
    .await?;
    drop(agent);
    stream.delete().await?;
    Ok(())
}

/// The optional trigger of docs/configuration.md ("Wake-up on PostgreSQL").
const NOTIFY_TRIGGER: &str = "
    CREATE FUNCTION ferry_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM pg_notify('ferry_outbox', '');
        RETURN NULL;
    END $$;
    CREATE TRIGGER ferry_outbox_notify AFTER INSERT ON outbox
        FOR EACH STATEMENT EXECUTE FUNCTION ferry_outbox_notify()";

/// Seed 002's set-up: an application writes business rows, each with its outbox row in the same
/// transaction, on PostgreSQL; the agent relays the table to a RabbitMQ queue (publisher
/// confirms, `direct_hold`): every event arrives, persistent, with `message_id` = `outbox:ID`,
/// in order per aggregate, and every row is marked sent.
#[tokio::test]
async fn postgres_outbox_table_to_rabbitmq_in_order_per_aggregate() -> anyhow::Result<()> {
    const N: i64 = 10_000;
    const AGGREGATES: i64 = 24;
    let db = TestDatabase::create().await?;
    let app = db.connect().await?;
    app.batch_execute(OUTBOX_DDL).await?;
    let queue = TestQueue::declare("ferry-e2e-table").await?;
    let dir = tempfile::tempdir()?;
    let relay = Relay::from_table(
        TableSource::postgres(&db),
        "rabbitmq",
        ferry_tests::rabbitmq::url(),
        vec![("q".into(), format!("/{}", queue.name))],
        dir.path(),
    );
    let agent = relay.start_agent().await?;
    let written = std::time::Instant::now();
    write_orders(&app, 0..N, AGGREGATES).await?;
    println!("{N} orders written in {} ms", written.elapsed().as_millis());
    let n = u64::try_from(N)?;
    let counts = finished(&agent, &relay, n).await?;
    assert_eq!((counts[0].sent, counts[0].dead_lettered), (n, 0));
    let got = queue
        .wait_until(DELIVERY, "every row in the queue", |r| {
            r.len() >= N as usize
        })
        .await?;
    assert_eq!(got.len(), N as usize, "each row once");
    let mut by_aggregate: std::collections::BTreeMap<String, Vec<u64>> = Default::default();
    for m in &got {
        let seq = parse_seq(&m.payload).unwrap_or(u64::MAX);
        assert_eq!(
            m.message_id.as_deref(),
            Some(format!("outbox:{}", seq + 1).as_str())
        );
        assert_eq!(m.delivery_mode, Some(2), "persistent");
        let aggregate = m.headers.get("aggregate_id").cloned().unwrap_or_default();
        assert_eq!(aggregate, format!("a{}", seq % AGGREGATES as u64), "{m:?}");
        by_aggregate.entry(aggregate).or_default().push(seq);
    }
    assert_ordered(&by_aggregate);
    assert_eq!(
        seqs(got.iter().map(|m| m.payload.as_slice())),
        (0..n).collect()
    );
    all_rows_sent(&app).await?;
    queue.delete().await;
    Ok(())
}

/// Seed 002's table as it is written: a uuid id the application chooses, the event as jsonb,
/// a status and its partial index; no retry columns yet.
const SEED_002_DDL: &str = "CREATE TABLE users (id uuid PRIMARY KEY, name text NOT NULL);
     CREATE TABLE outbox_events (
         id uuid PRIMARY KEY,
         event jsonb NOT NULL,
         status text NOT NULL DEFAULT 'pending',
         created_at timestamptz NOT NULL DEFAULT now());
     CREATE INDEX idx_outbox_status_created ON outbox_events (status, created_at)
         WHERE status = 'pending'";

/// The one-line migration docs/configuration.md gives for seed 002's table.
const SEED_002_MIGRATION: &str = "ALTER TABLE outbox_events \
     ADD COLUMN retry_count integer NOT NULL DEFAULT 0, ADD COLUMN retry_at timestamptz";

/// Seed 002's set-up end to end: the agent starts on the table as written and says which
/// column is missing (the table and the column by name); the application writes users, each
/// with its `outbox_events` row (a random UUID) in the same transaction; after the documented
/// migration the agent relays them to RabbitMQ with `columns.status` and `order_by:
/// created_at`: every event arrives once as written, with `message_id` = `outbox_events:UUID`,
/// in `created_at` order (one row in flight, random UUIDs: id order would differ), and every
/// row ends `processed`.
#[tokio::test]
async fn seed_002_outbox_events_with_uuid_ids_and_a_status_column_to_rabbitmq() -> anyhow::Result<()>
{
    const N: i64 = 500;
    let db = TestDatabase::create().await?;
    let app = db.connect().await?;
    app.batch_execute(SEED_002_DDL).await?;
    let queue = TestQueue::declare("ferry-e2e-seed002").await?;
    let dir = tempfile::tempdir()?;
    let relay = Relay::from_table(
        TableSource {
        receiver_extra: "    batch_size: 1\n    order_by: created_at\n    columns:\n      payload: event\n      event: null\n      aggregate_type: null\n      aggregate_id: null\n      status: status\n".into(),
        url: format!("postgres://127.0.0.1:5432/{}", db.name()),
        ..TableSource::postgres_named("outbox_events")
    },
        "rabbitmq",
        ferry_tests::rabbitmq::url(),
        vec![("q".into(), format!("/{}", queue.name))],
        dir.path(),
    );
    let mut agent = Agent::start(&relay.dir, &relay.yaml())?;
    let missing = "table outbox_events has no column retry_count (columns.retry_count)";
    wait::until(DELIVERY, "the missing column named in the log", || {
        std::future::ready(agent.output().contains(missing))
    })
    .await?;
    for i in 0..N {
        app.batch_execute(&format!(
            "BEGIN;
             INSERT INTO users VALUES (gen_random_uuid(), 'user {i}');
             INSERT INTO outbox_events (id, event, status)
                 VALUES (gen_random_uuid(), '{{\"type\": \"user.created\", \"seq\": {i}}}', 'pending');
             COMMIT"
        ))
        .await?;
    }
    app.batch_execute(SEED_002_MIGRATION).await?;
    agent.wait_ready(DELIVERY).await?;
    let n = u64::try_from(N)?;
    let counts = finished(&agent, &relay, n).await?;
    assert_eq!((counts[0].sent, counts[0].dead_lettered), (n, 0));
    let got = queue
        .wait_until(DELIVERY, "every event in the queue", |r| {
            r.len() >= N as usize
        })
        .await?;
    let written: Vec<(String, String)> = app
        .query(
            "SELECT 'outbox_events:' || id::text, event::text FROM outbox_events \
             ORDER BY created_at, id",
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let arrived: Vec<(String, String)> = got
        .iter()
        .map(|m| {
            (
                m.message_id.clone().unwrap_or_default(),
                String::from_utf8_lossy(&m.payload).into_owned(),
            )
        })
        .collect();
    assert_eq!(
        arrived, written,
        "each event once, as written, in created_at order"
    );
    let by_id: Vec<&String> = written.iter().map(|(id, _)| id).collect();
    let mut sorted = by_id.clone();
    sorted.sort();
    assert_ne!(
        by_id, sorted,
        "random UUIDs: id order is not created_at order"
    );
    wait::until(DELIVERY, "every row processed", || async {
        app.query_one(
            "SELECT count(*) FROM outbox_events WHERE status <> 'processed'",
            &[],
        )
        .await
        .is_ok_and(|row| row.get::<_, i64>(0) == 0)
    })
    .await?;
    queue.delete().await;
    Ok(())
}

/// A UUID-shaped id for `seq` whose text order is unrelated to `seq` (an application's random
/// UUIDs, reproducibly).
fn scattered_uuid(seq: u64) -> String {
    let h = format!(
        "{:016x}{:016x}",
        seq.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
        seq
    );
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// MariaDB with ids the application chooses: `CHAR(36)` UUIDs (not in insert order), a status
/// column and `order_by: created_at`; the agent relays to JetStream on per-aggregate subjects:
/// every row arrives once with `Nats-Msg-Id` = `outbox:UUID`, each aggregate in `created_at`
/// order (with `order_by: id` it would not be), and every row ends `done`.
#[tokio::test]
async fn mariadb_uuid_ids_and_a_status_column_in_created_at_order_per_aggregate()
-> anyhow::Result<()> {
    const WRITERS: u64 = 3;
    const PER_WRITER: u64 = 150;
    let db = TestMysql::create().await?;
    let mut app = db.connect().await?;
    app.query_drop(
        "CREATE TABLE outbox (
             id CHAR(36) PRIMARY KEY,
             aggregate_id VARCHAR(255) NOT NULL,
             payload JSON NOT NULL,
             status VARCHAR(16) NOT NULL DEFAULT 'new',
             created_at DATETIME(6) NOT NULL DEFAULT NOW(6),
             retry_at DATETIME(6) NULL,
             retry_count INT NOT NULL DEFAULT 0,
             KEY outbox_pending (status, created_at))",
    )
    .await?;
    let stream = TestStream::create("ferry_e2e_mysql_uuid").await?;
    let dir = tempfile::tempdir()?;
    let relay = Relay::from_table(
        TableSource {
        receiver_extra: "    order_by: created_at\n    pending_status: new\n    sent_status: done\n    columns:\n      aggregate_type: null\n      event: null\n      status: status\n".into(),
        ..TableSource::mysql(&db)
    },
        "nats",
        ferry_tests::nats::url(),
        vec![(
        "js".into(),
        format!("{}.{{header:aggregate_id}}", stream.subject),
    )],
        dir.path(),
    );
    let agent = relay.start_agent().await?;
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let mut conn = db.connect().await?;
        writers.push(tokio::spawn(async move {
            for i in 0..PER_WRITER {
                let seq = w * PER_WRITER + i;
                conn.query_drop(format!(
                    "INSERT INTO outbox (id, aggregate_id, payload) VALUES ('{}', 'w{w}-{}', '{seq}')",
                    scattered_uuid(seq),
                    i % 3,
                ))
                .await?;
            }
            anyhow::Ok(())
        }));
    }
    for writer in writers {
        writer.await??;
    }
    let total = WRITERS * PER_WRITER;
    let counts = finished(&agent, &relay, total).await?;
    assert_eq!((counts[0].sent, counts[0].dead_lettered), (total, 0));
    let stored = stream.wait_for(usize::try_from(total)?, DELIVERY).await?;
    assert_eq!(
        stored.len(),
        usize::try_from(total)?,
        "each row stored once"
    );
    assert_ordered(&per_subject(&stored));
    let ids: Vec<(String, String)> = app
        .query("SELECT CONCAT('outbox:', id), CAST(payload AS CHAR) FROM outbox")
        .await?;
    let written: BTreeSet<(String, String)> = ids.into_iter().collect();
    let arrived: BTreeSet<(String, String)> = stored
        .iter()
        .map(|m| {
            (
                m.header("Nats-Msg-Id").unwrap_or_default().to_owned(),
                String::from_utf8_lossy(&m.payload).into_owned(),
            )
        })
        .collect();
    assert_eq!(arrived, written, "each row under its UUID");
    let by_created: Vec<String> = app
        .query("SELECT id FROM outbox ORDER BY created_at, id")
        .await?;
    let mut by_id = by_created.clone();
    by_id.sort();
    assert_ne!(by_created, by_id, "id order is not created_at order");
    until_none_left(
        &db,
        "every row done",
        "SELECT count(*) FROM outbox WHERE status <> 'done'",
    )
    .await?;
    stream.delete().await?;
    Ok(())
}

/// A `headers` column (jsonb) becomes message headers: each row arrives at RabbitMQ with its
/// own `tenant` header beside the table's, and the one row whose value is not an object of
/// strings is dead-lettered at once (no retries) and marked sent, while the rest go.
#[tokio::test]
async fn postgres_headers_column_becomes_amqp_headers_and_a_malformed_one_is_dead_lettered()
-> anyhow::Result<()> {
    const N: i64 = 40;
    const BAD: i64 = 17;
    let db = TestDatabase::create().await?;
    let app = outbox_with_headers(
        &db,
        N,
        &format!(
            "CASE WHEN i = {BAD} THEN '{{\"tenant\": 7}}'::jsonb
                  ELSE jsonb_build_object('tenant', 't' || i) END"
        ),
    )
    .await?;
    let queue = TestQueue::declare("ferry-e2e-headers").await?;
    let dir = tempfile::tempdir()?;
    let relay = Relay::from_table(
        TableSource::postgres_with_headers(&db),
        "rabbitmq",
        ferry_tests::rabbitmq::url(),
        vec![("q".into(), format!("/{}", queue.name))],
        dir.path(),
    );
    let agent = relay.start_agent().await?;
    let n = u64::try_from(N)?;
    let counts = finished(&agent, &relay, n).await?;
    assert_eq!((counts[0].sent, counts[0].dead_lettered), (n - 1, 1));
    let got = queue
        .wait_until(DELIVERY, "every good row in the queue", |r| {
            r.len() >= N as usize - 1
        })
        .await?;
    for m in &got {
        let seq = parse_seq(&m.payload).unwrap_or(u64::MAX);
        assert_eq!(
            m.headers.get("tenant").map(String::as_str),
            Some(format!("t{seq}").as_str()),
            "{m:?}"
        );
        assert_eq!(m.headers.get("event").map(String::as_str), Some("created"));
    }
    let bad = u64::try_from(BAD)?;
    assert_eq!(
        seqs(got.iter().map(|m| m.payload.as_slice())),
        (0..n).filter(|i| *i != bad).collect()
    );
    all_rows_sent(&app).await?;
    let retries: i32 = app
        .query_one(
            "SELECT COALESCE(retry_count, 0) FROM outbox WHERE id = $1",
            &[&(BAD + 1)],
        )
        .await?
        .get(0);
    assert_eq!(retries, 0, "dead-lettered without retries");
    queue.delete().await;
    Ok(())
}

/// Headers MQTT cannot carry — from the table's `headers` column, a value of 70 000 bytes (past
/// the 65 535 of an MQTT string) and a value with a tab (a control character, which Mosquitto
/// refuses as malformed) — make their rows' sends permanent errors that name the header: the
/// rows are dead-lettered at once and marked sent, and the rest arrive on one connection.
/// (Before, the broker closed the connection on each such packet, at every retry.)
#[tokio::test]
async fn headers_mqtt_cannot_carry_are_dead_lettered_and_the_rest_arrive() -> anyhow::Result<()> {
    const N: i64 = 10;
    const LONG: i64 = 4;
    const TAB: i64 = 7;
    let db = TestDatabase::create().await?;
    let app = outbox_with_headers(
        &db,
        N,
        &format!(
            "CASE WHEN i = {LONG} THEN jsonb_build_object('big', repeat('x', 70000))
                  WHEN i = {TAB} THEN jsonb_build_object('tab', E'a\\tb')
                  ELSE jsonb_build_object('tenant', 't' || i) END"
        ),
    )
    .await?;
    let broker = Mosquitto::start().await?;
    let topic = format!("{}/out", ids::unique("e2e"));
    let collector = Collector::start(
        &broker.url(),
        &ids::unique("collector"),
        &topic,
        QoS::AtLeastOnce,
    )
    .await?;
    let dir = tempfile::tempdir()?;
    let relay = Relay::from_table(
        TableSource::postgres_with_headers(&db),
        "mqtt",
        broker.url(),
        vec![("out".into(), topic.clone())],
        dir.path(),
    );
    let agent = relay.start_agent().await?;
    let n = u64::try_from(N)?;
    let counts = finished(&agent, &relay, n).await?;
    assert_eq!((counts[0].sent, counts[0].dead_lettered), (n - 2, 2));
    let bad = [u64::try_from(LONG)?, u64::try_from(TAB)?];
    wait::until(
        DELIVERY,
        "every good row on the topic, and no bad one",
        || std::future::ready(collector.counts().missing(&topic, 0..n) == bad),
    )
    .await?;
    let reconnects = agent
        .metrics()?
        .session("ferry_session_reconnects_total", "dst");
    assert_eq!(reconnects, 0.0, "the destination's connection stayed up");
    let listed = dlq_client(&agent)
        .await?
        .list_dlq_entries(pb::ListDlqEntriesRequest {
            page_size: 10,
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut errors: Vec<&str> = listed
        .entries
        .iter()
        .map(|e| {
            assert_eq!(e.reason, pb::DlqReason::PermanentError as i32, "{e:?}");
            e.last_error.as_str()
        })
        .collect();
    errors.sort_unstable();
    assert_eq!(
        errors,
        [
            "the value of header \"big\" is 70000 bytes, more than an MQTT string holds (65535)",
            "the value of header \"tab\" contains a control character (U+0009)",
        ]
    );
    all_rows_sent(&app).await?;
    Ok(())
}
