//! A measurement, not a check: messages per second MQTT → SQS and SQS → MQTT through the agent,
//! beside a plain SDK loop against the same moto server in the same run (`SendMessageBatch` of
//! ten, one call at a time; `ReceiveMessage` of ten plus `DeleteMessageBatch`). The ratio is the
//! figure; moto's own speed bounds both. Ignored by default; run it with the agent binary of the
//! profile to measure, e.g.
//!
//! ```text
//! cargo build --release -p ferry-agent --bin ferry-agent
//! FERRY_BIN_DIR=target/release FERRY_AWS_MESSAGES=2000 cargo nextest run -p ferry-tests \
//!     --test e2e --run-ignored only -E 'test(aws_throughput)' --no-capture
//! ```

use std::time::{Duration, Instant};

use aws_sdk_sqs::types::{DeleteMessageBatchRequestEntry, SendMessageBatchRequestEntry};
use ferry_tests::PublishOptions;
use ferry_tests::mqtt::QoS;
use ferry_tests::{Collector, ids};

use super::support::{Aws, Case, DELIVERY, DIRECT};

fn messages() -> u64 {
    std::env::var("FERRY_AWS_MESSAGES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(300)
}

fn rate(n: u64, elapsed: Duration) -> f64 {
    n as f64 / elapsed.as_secs_f64()
}

/// Sends `n` numbered messages to `url` in batches of ten, one call at a time.
async fn send_plain(aws: &Aws, url: &str, n: u64) -> anyhow::Result<()> {
    let all: Vec<u64> = (0..n).collect();
    for chunk in all.chunks(10) {
        let entries = chunk
            .iter()
            .map(|seq| {
                SendMessageBatchRequestEntry::builder()
                    .id(seq.to_string())
                    .message_body(seq.to_string())
                    .build()
            })
            .collect::<Result<Vec<_>, _>>()?;
        aws.sqs
            .send_message_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await?;
    }
    Ok(())
}

/// Receives and deletes until `n` messages came.
async fn receive_plain(aws: &Aws, url: &str, n: u64) -> anyhow::Result<()> {
    let mut got = 0;
    let deadline = Instant::now() + DELIVERY;
    while got < n {
        anyhow::ensure!(Instant::now() < deadline, "{got} of {n} received");
        let out = aws
            .sqs
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .send()
            .await?;
        let entries = out
            .messages()
            .iter()
            .enumerate()
            .filter_map(|(i, m)| {
                DeleteMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .set_receipt_handle(m.receipt_handle().map(str::to_owned))
                    .build()
                    .ok()
            })
            .collect::<Vec<_>>();
        got += entries.len() as u64;
        if !entries.is_empty() {
            aws.sqs
                .delete_message_batch()
                .queue_url(url)
                .set_entries(Some(entries))
                .send()
                .await?;
        }
    }
    Ok(())
}

#[tokio::test]
#[ignore = "a measurement; run with --run-ignored only"]
async fn aws_throughput() -> anyhow::Result<()> {
    let n = messages();
    let case = Case::new().await?;
    let aws = &case.aws;

    let (_, plain) = aws.queue("plain", &[]).await?;
    let start = Instant::now();
    send_plain(aws, &plain, n).await?;
    let plain_send = rate(n, start.elapsed());
    let start = Instant::now();
    receive_plain(aws, &plain, n).await?;
    let plain_receive = rate(n, start.elapsed());
    eprintln!("plain: send {plain_send:.0} msg/s, receive {plain_receive:.0} msg/s");

    // MQTT → SQS: from the first publish until the queue holds every message.
    let (queue, url) = aws.queue("to-sqs", &[]).await?;
    let yaml = case.mqtt_to_aws("sqs", &format!("queue_name: {queue}"), &queue, DIRECT);
    let mut agent = case.agent(&yaml).await?;
    let start = Instant::now();
    case.publish(0..n, PublishOptions::default()).await?;
    aws.wait_depth(&url, (n, 0), "every message in the queue")
        .await?;
    let mqtt_to_sqs = rate(n, start.elapsed());
    eprintln!("MQTT → SQS: {mqtt_to_sqs:.0} msg/s");
    agent.terminate(Duration::from_secs(20)).await?;

    // SQS → MQTT: the queue is filled first; from the agent's start until the last arrives.
    let (queue, url) = aws.queue("from-sqs", &[]).await?;
    send_plain(aws, &url, n).await?;
    let collector = Collector::start(
        &case.broker.url(),
        &ids::unique("collector"),
        &format!("{}/out/#", case.run),
        QoS::AtLeastOnce,
    )
    .await?;
    let yaml = case.sqs_to_mqtt(&queue, &["visibility_timeout: 60s"], DIRECT, &["x"]);
    let start = Instant::now();
    let _agent = case.agent(&yaml).await?;
    collector
        .wait_for(&case.output("x"), 0..n, DELIVERY)
        .await?;
    let sqs_to_mqtt = rate(n, start.elapsed());

    eprintln!(
        "aws_throughput ({n} messages, moto at {}):\n\
         \x20 plain SendMessageBatch loop  {plain_send:>8.0} msg/s\n\
         \x20 MQTT → SQS through the agent {mqtt_to_sqs:>8.0} msg/s ({:.2} of plain)\n\
         \x20 plain ReceiveMessage loop    {plain_receive:>8.0} msg/s\n\
         \x20 SQS → MQTT through the agent {sqs_to_mqtt:>8.0} msg/s ({:.2} of plain)",
        aws.endpoint,
        mqtt_to_sqs / plain_send,
        sqs_to_mqtt / plain_receive,
    );
    Ok(())
}
