//! What the AWS end-to-end tests share: queues and topics on moto, configuration pieces, and
//! reading a queue to the end.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use aws_sdk_sqs::types::{Message, MessageSystemAttributeName, QueueAttributeName};
use ferry_shared::api::v1 as pb;
use ferry_tests::agent::Agent;
use ferry_tests::moto::Moto;
use ferry_tests::mqtt::{QoS, parse_seq};
use ferry_tests::{Collector, Mosquitto, PublishOptions, ids, publish_seq_with, wait};
use tempfile::TempDir;

use crate::agent_support::dlq_client;

/// How long a test waits for deliveries.
pub const DELIVERY: Duration = Duration::from_secs(60);

/// A traceparent the tests send, and its trace id.
pub const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
pub const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

/// A moto server's endpoint, the environment of an agent that talks to it, and clients.
pub struct Aws {
    pub endpoint: String,
    pub env: Vec<(String, String)>,
    pub sqs: aws_sdk_sqs::Client,
    pub sns: aws_sdk_sns::Client,
}

impl Aws {
    /// The shared server.
    pub async fn new() -> anyhow::Result<Self> {
        Ok(Self::on(Moto::shared().await?))
    }

    /// Clients of `moto`.
    pub fn on(moto: &Moto) -> Self {
        Self {
            endpoint: moto.endpoint().to_owned(),
            env: moto
                .env()
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect(),
            sqs: moto.sqs(),
            sns: moto.sns(),
        }
    }

    /// Creates a queue named `{prefix}-{unique}` with `attributes`; returns its name and URL.
    pub async fn queue(
        &self,
        prefix: &str,
        attributes: &[(QueueAttributeName, &str)],
    ) -> anyhow::Result<(String, String)> {
        let fifo = prefix.ends_with(".fifo");
        let stem = prefix.trim_end_matches(".fifo");
        let name = format!(
            "{}{}",
            ids::unique(stem).replace(['.', ':', '/'], "-"),
            if fifo { ".fifo" } else { "" }
        );
        let mut create = self.sqs.create_queue().queue_name(&name);
        for (k, v) in attributes {
            create = create.attributes(k.clone(), *v);
        }
        let out = create.send().await.context("creating a queue")?;
        let url = out.queue_url().context("moto returns the URL")?.to_owned();
        Ok((name, url))
    }

    /// Sends messages `seqs` to `url`, each with the attributes `site=north` and
    /// `traceparent` [`TRACEPARENT`].
    pub async fn send_seq(&self, url: &str, seqs: std::ops::Range<u64>) -> anyhow::Result<()> {
        use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};
        let all: Vec<u64> = seqs.collect();
        for chunk in all.chunks(10) {
            let mut entries = Vec::new();
            for seq in chunk {
                let attr = |v: &str| {
                    MessageAttributeValue::builder()
                        .data_type("String")
                        .string_value(v)
                        .build()
                };
                entries.push(
                    SendMessageBatchRequestEntry::builder()
                        .id(seq.to_string())
                        .message_body(seq.to_string())
                        .message_attributes("site", attr("north")?)
                        .message_attributes("traceparent", attr(TRACEPARENT)?)
                        .build()?,
                );
            }
            let out = self
                .sqs
                .send_message_batch()
                .queue_url(url)
                .set_entries(Some(entries))
                .send()
                .await?;
            anyhow::ensure!(out.failed().is_empty(), "{:?}", out.failed());
        }
        Ok(())
    }

    /// `ApproximateNumberOfMessages` and `…NotVisible` of `url`.
    pub async fn depth(&self, url: &str) -> anyhow::Result<(u64, u64)> {
        let out = self
            .sqs
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(QueueAttributeName::All)
            .send()
            .await?;
        let get = |k: QueueAttributeName| {
            out.attributes()
                .and_then(|a| a.get(&k))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        Ok((
            get(QueueAttributeName::ApproximateNumberOfMessages),
            get(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
        ))
    }

    /// Waits until [`Self::depth`] of `url` is `want`.
    pub async fn wait_depth(&self, url: &str, want: (u64, u64), what: &str) -> anyhow::Result<()> {
        wait::until_ok(DELIVERY, what, || async {
            let depth = self.depth(url).await?;
            anyhow::ensure!(depth == want, "{depth:?}");
            Ok(())
        })
        .await
    }

    /// Waits until `url` holds nothing, visible or not (every message deleted).
    pub async fn wait_empty(&self, url: &str) -> anyhow::Result<()> {
        self.wait_depth(url, (0, 0), "the queue is empty").await
    }

    /// Receives (and deletes) from `url` until every number of `seqs` arrived; returns the
    /// messages by number (the first copy of each) and the number of every copy in arrival
    /// order.
    pub async fn drain(
        &self,
        url: &str,
        seqs: std::ops::Range<u64>,
    ) -> anyhow::Result<(BTreeMap<u64, Message>, Vec<u64>)> {
        let mut got = BTreeMap::new();
        let mut arrivals = Vec::new();
        let deadline = tokio::time::Instant::now() + DELIVERY;
        while !seqs.clone().all(|s| got.contains_key(&s)) {
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "missing {:?}",
                seqs.clone()
                    .filter(|s| !got.contains_key(s))
                    .collect::<Vec<_>>()
            );
            let out = self
                .sqs
                .receive_message()
                .queue_url(url)
                .max_number_of_messages(10)
                .wait_time_seconds(1)
                .message_attribute_names("All")
                .message_system_attribute_names(MessageSystemAttributeName::All)
                .send()
                .await?;
            for m in out.messages() {
                if let Some(h) = m.receipt_handle() {
                    self.sqs
                        .delete_message()
                        .queue_url(url)
                        .receipt_handle(h)
                        .send()
                        .await?;
                }
                let seq = parse_seq(m.body().unwrap_or_default().as_bytes())
                    .with_context(|| format!("unexpected body {:?}", m.body()))?;
                arrivals.push(seq);
                got.entry(seq).or_insert_with(|| m.clone());
            }
        }
        Ok((got, arrivals))
    }
}

/// The `String` attribute `name` of `m`.
pub fn attribute<'a>(m: &'a Message, name: &str) -> Option<&'a str> {
    m.message_attributes()?.get(name)?.string_value()
}

/// SQLite outbox, lease and DLQ in `dir`.
pub fn stores(dir: &Path) -> String {
    let dir = dir.display();
    format!(
        "stores:\n\
         \x20 outbox:\n    type: sqlite\n    options:\n      path: {dir}/outbox.db\n\
         \x20 lease:\n    type: sqlite\n    options:\n      path: {dir}/lease.db\n\
         \x20 dlq:\n    type: sqlite\n    options:\n      path: {dir}/dlq.db\n"
    )
}

/// A session entry for `sessions:`.
pub fn mqtt_session(id: &str, url: &str, client_id: &str) -> String {
    format!(
        "  - id: {id}\n    transport: mqtt\n    options:\n      session:\n        broker_url: {url}\n        client_id: {client_id}\n        keep_alive: 5\n"
    )
}

/// An `sqs` or `sns` session entry with `extra` option lines.
pub fn aws_session(id: &str, transport: &str, endpoint: &str, extra: &[&str]) -> String {
    let mut s = format!(
        "  - id: {id}\n    transport: {transport}\n    options:\n      session:\n        region: us-east-1\n        endpoint_url: {endpoint}\n"
    );
    for line in extra {
        let _ = writeln!(s, "        {line}");
    }
    s
}

/// The body of a `direct_hold` route.
pub const DIRECT: &str = "    delivery_mode: direct_hold\n";

/// One test's moto, broker, store directory and unique prefix (`{run}/in`, `{run}/out/B`).
pub struct Case {
    pub aws: Aws,
    pub broker: Mosquitto,
    pub dir: TempDir,
    pub run: String,
}

impl Case {
    pub async fn new() -> anyhow::Result<Self> {
        Self::with(Aws::new().await?).await
    }

    /// A case on the moto server of `aws`.
    pub async fn with(aws: Aws) -> anyhow::Result<Self> {
        Ok(Self {
            aws,
            broker: Mosquitto::start().await?,
            dir: tempfile::tempdir()?,
            run: ids::unique("e2e"),
        })
    }

    /// The MQTT topic of binding `b`.
    pub fn output(&self, b: &str) -> String {
        format!("{}/out/{b}", self.run)
    }

    /// The MQTT topic MQTT-sourced routes receive from.
    pub fn input(&self) -> String {
        format!("{}/in", self.run)
    }

    /// MQTT into an SQS queue or SNS topic: `sender` is the sender's option line, `address`
    /// the binding's, `route` the route's body after its bindings.
    pub fn mqtt_to_aws(&self, transport: &str, sender: &str, address: &str, route: &str) -> String {
        format!(
            "bridge:\n  id: e2e\nsessions:\n{}{}{}receivers:\n  - id: in\n    session_id: src\n    topics:\n      - topic: {input}\n        qos: 1\n\
             senders:\n  - id: out\n    session_id: aws\n    options:\n      sender:\n        {sender}\n\
             bindings:\n  - id: x\n    sender_id: out\n    address: {address}\n\
             routes:\n  - id: r\n    receiver_id: in\n    bindings: [x]\n{route}",
            mqtt_session("src", &self.broker.url(), &format!("{}-in", self.run)),
            aws_session("aws", transport, &self.aws.endpoint, &[]),
            stores(self.dir.path()),
            input = self.input(),
        )
    }

    /// An SQS queue into MQTT bindings `bindings` (topics [`Self::output`]): `session` are
    /// extra lines of the sqs session, `route` the route's body after its bindings.
    pub fn sqs_to_mqtt(
        &self,
        queue: &str,
        session: &[&str],
        route: &str,
        bindings: &[&str],
    ) -> String {
        let mut options = vec!["wait_time: 1s"];
        options.extend_from_slice(session);
        let mut y = format!(
            "bridge:\n  id: e2e\nsessions:\n{}{}{}receivers:\n  - id: in\n    session_id: aws\n    queue: {queue}\n\
             senders:\n  - id: out\n    session_id: dst\n    options:\n      sender:\n        qos: 1\nbindings:\n",
            aws_session("aws", "sqs", &self.aws.endpoint, &options),
            mqtt_session("dst", &self.broker.url(), &format!("{}-out", self.run)),
            stores(self.dir.path()),
        );
        for b in bindings {
            let _ = writeln!(
                y,
                "  - id: {b}\n    sender_id: out\n    address: {}",
                self.output(b)
            );
        }
        let _ = write!(
            y,
            "routes:\n  - id: r\n    receiver_id: in\n    bindings: [{}]\n{route}",
            bindings.join(", ")
        );
        y
    }

    /// Publishes `seqs` to [`Self::input`] with `extra`.
    pub async fn publish(
        &self,
        seqs: std::ops::Range<u64>,
        extra: PublishOptions,
    ) -> anyhow::Result<()> {
        publish_seq_with(
            &self.broker.url(),
            &self.input(),
            seqs,
            QoS::AtLeastOnce,
            extra,
        )
        .await
    }

    /// A collector of every output topic.
    pub async fn collector(&self) -> anyhow::Result<Collector> {
        Collector::start(
            &self.broker.url(),
            &ids::unique("collector"),
            &format!("{}/out/#", self.run),
            QoS::AtLeastOnce,
        )
        .await
    }

    /// Publishes `0..n` with a `site` header and the publisher's `traceparent`, reads `url` to
    /// the end, and checks that each message arrived once carrying both as attributes.
    pub async fn publish_traced_and_drain(
        &self,
        url: &str,
        n: u64,
    ) -> anyhow::Result<BTreeMap<u64, Message>> {
        let headers = PublishOptions {
            user_properties: vec![
                ("site".into(), "north".into()),
                ("traceparent".into(), TRACEPARENT.into()),
            ],
            ..Default::default()
        };
        self.publish(0..n, headers).await?;
        let (got, copies) = self.aws.drain(url, 0..n).await?;
        assert_eq!(copies.len() as u64, n, "each message once");
        for (seq, m) in &got {
            assert_eq!(attribute(m, "site"), Some("north"), "{seq}: {m:?}");
            assert!(
                attribute(m, "traceparent").is_some_and(|tp| tp.contains(TRACE_ID)),
                "{seq}: {m:?}"
            );
        }
        Ok(got)
    }

    /// Starts an agent on `yaml` with moto's environment and waits until it is ready.
    pub async fn agent(&self, yaml: &str) -> anyhow::Result<Agent> {
        let mut agent = Agent::start_with_env(self.dir.path(), yaml, self.aws.env.clone())?;
        agent.wait_ready(Duration::from_secs(30)).await?;
        Ok(agent)
    }
}

/// Waits until `agent`'s DLQ holds exactly one entry, and returns it.
pub async fn the_one_dlq_entry(agent: &Agent) -> anyhow::Result<pb::DlqEntry> {
    let mut entries = wait::until_ok(DELIVERY, "one DLQ entry", || async {
        let entries = dlq_client(agent)
            .await?
            .list_dlq_entries(pb::ListDlqEntriesRequest {
                omit_payload: true,
                ..Default::default()
            })
            .await?
            .into_inner()
            .entries;
        anyhow::ensure!(entries.len() == 1, "{entries:?}");
        Ok(entries)
    })
    .await?;
    Ok(entries.remove(0))
}
