//! SQS in and out: fan-out from a queue to MQTT, MQTT into a queue with its headers, a bad
//! entry among good ones, a crash while messages are held, and a message held past its
//! visibility timeout.

use std::time::Duration;

use anyhow::Context;
use aws_sdk_sqs::types::QueueAttributeName;
use ferry_shared::api::v1 as pb;
use ferry_tests::moto::Moto;
use ferry_tests::{PublishOptions, wait};

use super::support::{Aws, Case, DELIVERY, DIRECT, TRACE_ID, attribute, the_one_dlq_entry};

const FAN_OUT: &str = "    delivery_mode: shared_outbox\n    dispatch_mode: fan_out\n    session:\n      session_id: dst\n      sender_id: out\n      drain_interval: 200ms\n      drain_batch_size: 100\n      lease_ttl: 3s\n      step_down_grace: 2s\n";

/// Messages sent to an SQS queue reach three MQTT topics, each once, with their trace
/// context; every message is deleted from the queue once persisted.
#[tokio::test]
async fn sqs_to_mqtt_fans_out_to_three_topics() -> anyhow::Result<()> {
    const N: u64 = 30;
    let case = Case::new().await?;
    let (queue, url) = case.aws.queue("fanout", &[]).await?;
    let collector = case.collector().await?;
    let yaml = case.sqs_to_mqtt(
        &queue,
        &["visibility_timeout: 10s"],
        FAN_OUT,
        &["x", "y", "z"],
    );
    let _agent = case.agent(&yaml).await?;
    case.aws.send_seq(&url, 0..N).await?;
    for b in ["x", "y", "z"] {
        collector.wait_for(&case.output(b), 0..N, DELIVERY).await?;
    }
    case.aws.wait_empty(&url).await?;
    let counts = collector.counts();
    assert!(counts.duplicates().is_empty(), "{:?}", counts.duplicates());
    for b in ["x", "y", "z"] {
        let tps = counts.traceparents(&case.output(b));
        assert_eq!(
            tps.len() as u64,
            N,
            "{b}: every message carries its traceparent"
        );
        assert!(tps.iter().all(|tp| tp.contains(TRACE_ID)), "{tps:?}");
    }
    Ok(())
}

/// MQTT messages reach an SQS queue with their user properties as message attributes, the
/// trace context and the Ferry message id.
#[tokio::test]
async fn mqtt_to_sqs_keeps_headers() -> anyhow::Result<()> {
    const N: u64 = 25;
    let case = Case::new().await?;
    let (queue, url) = case.aws.queue("in", &[]).await?;
    let yaml = case.mqtt_to_aws("sqs", &format!("queue_name: {queue}"), &url, DIRECT);
    let _agent = case.agent(&yaml).await?;
    let got = case.publish_traced_and_drain(&url, N).await?;
    for (seq, m) in &got {
        assert!(
            attribute(m, "ferry-message-id").is_some_and(|id| !id.is_empty()),
            "{seq}: {m:?}"
        );
    }
    Ok(())
}

/// Among messages sent together, one is larger than SQS accepts: it is dead-lettered as
/// oversized, every other one is sent once.
#[tokio::test]
async fn a_bad_entry_is_dead_lettered_and_the_rest_sent() -> anyhow::Result<()> {
    const N: u64 = 20;
    const ROUTE: &str = "    delivery_mode: shared_outbox\n    policy:\n      max_payload_bytes: 1048576\n      on_permanent_failure: dlq\n    session:\n      session_id: aws\n      sender_id: out\n      drain_interval: 500ms\n      drain_batch_size: 100\n      lease_ttl: 3s\n      step_down_grace: 2s\n";
    let case = Case::new().await?;
    let (queue, url) = case.aws.queue("bad", &[]).await?;
    let yaml = case.mqtt_to_aws("sqs", &format!("queue_name: {queue}"), &queue, ROUTE);
    let agent = case.agent(&yaml).await?;
    case.publish(0..N / 2, PublishOptions::default()).await?;
    let oversized = PublishOptions {
        payload_size: 300 * 1024,
        ..Default::default()
    };
    case.publish(1000..1001, oversized).await?;
    case.publish(N / 2..N, PublishOptions::default()).await?;
    let (got, copies) = case.aws.drain(&url, 0..N).await?;
    assert_eq!(
        copies.len() as u64,
        N,
        "each good message once: {:?}",
        got.keys()
    );
    let entry = the_one_dlq_entry(&agent).await?;
    assert_eq!(entry.reason, pb::DlqReason::Oversized as i32, "{entry:?}");
    assert!(entry.last_error.contains("262144"), "{}", entry.last_error);
    case.aws.wait_empty(&url).await?;
    Ok(())
}

/// Messages held while the destination is down stay invisible past their 2 s visibility
/// timeout (the heartbeat extends it); the agent is killed while holding them, and each
/// reappears after the timeout and reaches the destination: nothing lost. Then a message held
/// past its timeout while the destination is down is delivered once.
#[tokio::test]
async fn held_messages_survive_a_crash_and_the_heartbeat_keeps_them() -> anyhow::Result<()> {
    const N: u64 = 10;
    let mut case = Case::new().await?;
    let (queue, url) = case
        .aws
        .queue("held", &[(QueueAttributeName::VisibilityTimeout, "2")])
        .await?;
    let collector = case.collector().await?;
    let output = case.output("x");
    // The queue's own 2 s timeout: no visibility_timeout in the session.
    let yaml = case.sqs_to_mqtt(&queue, &["max_messages: 10"], DIRECT, &["x"]);
    let mut agent = case.agent(&yaml).await?;
    let aws = &case.aws;

    // Slow destination: the broker is down while the messages arrive.
    case.broker.stop().await?;
    aws.send_seq(&url, 0..N).await?;
    aws.wait_depth(&url, (0, N), "every message held by the agent")
        .await?;
    // Three visibility timeouts: without the heartbeat they would be visible again.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(aws.depth(&url).await?, (0, N), "still held");

    agent.kill()?;
    aws.wait_depth(&url, (N, 0), "the messages reappear")
        .await?;
    case.broker.restart().await?;
    agent.restart()?;
    agent.wait_ready(Duration::from_secs(30)).await?;
    collector.wait_for(&output, 0..N, DELIVERY).await?;
    aws.wait_empty(&url).await?;
    let counts = collector.counts();
    assert!(counts.duplicates().is_empty(), "{:?}", counts.duplicates());
    // The second run counts what SQS handed out again after the crash.
    let redelivered = agent
        .metrics()?
        .route("ferry_messages_redelivered_total", "r");
    assert_eq!(
        redelivered, N as f64,
        "each message once more, after the crash"
    );

    // Held past its timeout by a slow destination, then delivered once.
    case.broker.stop().await?;
    aws.send_seq(&url, 100..101).await?;
    aws.wait_depth(&url, (0, 1), "the message held").await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    case.broker.restart().await?;
    collector.wait_for(&output, 100..101, DELIVERY).await?;
    aws.wait_empty(&url).await?;
    assert_eq!(collector.counts().count(&output, 100), 1);
    assert_eq!(
        agent
            .metrics()?
            .route("ferry_messages_redelivered_total", "r"),
        redelivered,
        "SQS never handed the held message out again"
    );
    Ok(())
}

/// MQTT into a FIFO queue grouped by the `device` header: the queue holds each message once,
/// in publish order; a message published again with the same trusted `ferry-message-id` (a
/// redelivery from an upstream Ferry agent) is dropped by SQS as a duplicate.
#[tokio::test]
async fn a_fifo_queue_keeps_order_and_drops_duplicates_by_id() -> anyhow::Result<()> {
    const N: u64 = 20;
    let case = Case::new().await?;
    let (queue, url) = case
        .aws
        .queue("order.fifo", &[(QueueAttributeName::FifoQueue, "true")])
        .await?;
    let sender = format!("queue_name: {queue}\n        message_group_id: \"{{header:device}}\"");
    let route = "    delivery_mode: direct_hold\n    policy:\n      max_in_flight: 1\n";
    let yaml = case.mqtt_to_aws("sqs", &sender, &queue, route).replace(
        "        qos: 1\nsenders:",
        "        qos: 1\n    trust_message_id: true\nsenders:",
    );
    let agent = case.agent(&yaml).await?;
    let device = |extra: &[(&str, &str)]| PublishOptions {
        user_properties: [("device", "d-1")]
            .iter()
            .chain(extra)
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        ..Default::default()
    };
    case.publish(0..N, device(&[])).await?;
    // Three publishes of one message id: SQS keeps the first.
    case.publish(N..N + 3, device(&[("ferry-message-id", "upstream-7")]))
        .await?;
    // Real SQS drops a duplicate id for five minutes; moto only while the first copy is still
    // in the queue. So every send, the duplicates' included, is done before the drain deletes.
    wait::until_ok(DELIVERY, "every message sent to SQS", || async {
        let sent = agent.metrics()?.binding("r", "x").sent;
        // At least: a QoS 1 redelivery from the broker is sent once more.
        anyhow::ensure!(sent >= N + 3, "{sent} sent");
        Ok(())
    })
    .await?;
    let (got, order) = case.aws.drain(&url, 0..N + 1).await?;
    assert!(
        got.values()
            .all(|m| attribute(m, "ferry-message-id").is_some()),
        "{got:?}"
    );
    assert_eq!(order, (0..=N).collect::<Vec<_>>(), "in order, each once");
    // The two duplicates were sent (accepted by SQS) and dropped there.
    case.aws.wait_empty(&url).await?;
    Ok(())
}

/// MQTT into a FIFO queue through a SQLite outbox, two groups, the agent SIGKILLed while the
/// outbox drains and started again: the queue holds every message exactly once, each group in
/// publish order. The records the agent sent before the kill and sends again after it carry the
/// same Ferry message id (the upstream `ferry-message-id`, trusted), which SQS uses as the
/// deduplication id and drops.
#[tokio::test]
async fn a_fifo_queue_keeps_group_order_and_drops_replays_across_a_crash() -> anyhow::Result<()> {
    const N: u64 = 40;
    let case = Case::new().await?;
    let (queue, url) = case
        .aws
        .queue("crash.fifo", &[(QueueAttributeName::FifoQueue, "true")])
        .await?;
    let sender = format!("queue_name: {queue}\n        message_group_id: \"{{header:device}}\"");
    // Small batches and a short interval: the drain is still going when the agent dies.
    let route = "    delivery_mode: shared_outbox\n    policy:\n      ack_after: outbox_persist\n    \
                 session:\n      session_id: aws\n      sender_id: out\n      drain_interval: 100ms\n      \
                 drain_batch_size: 2\n      lease_ttl: 3s\n";
    let yaml = case.mqtt_to_aws("sqs", &sender, &queue, route).replace(
        "        qos: 1\nsenders:",
        "        qos: 1\n    trust_message_id: true\nsenders:",
    );
    let mut agent = case.agent(&yaml).await?;
    let device = |seq: u64| format!("d-{}", seq % 2);
    for seq in 0..N {
        let options = PublishOptions {
            user_properties: vec![
                ("device".to_owned(), device(seq)),
                ("ferry-message-id".to_owned(), format!("m-{seq}")),
            ],
            ..Default::default()
        };
        case.publish(seq..seq + 1, options).await?;
    }
    wait::until(DELIVERY, "the first messages in the queue", || {
        let (aws, url) = (&case.aws, &url);
        async move { aws.depth(url).await.is_ok_and(|(visible, _)| visible >= 4) }
    })
    .await?;
    agent.kill()?;
    let before_restart = case.aws.depth(&url).await?.0;
    agent.restart()?;
    agent.wait_ready(Duration::from_secs(30)).await?;
    // Every record left in the outbox sent again before the drain deletes anything: moto, unlike
    // SQS, drops a duplicate id only while its first copy is still in the queue.
    wait::until_ok(DELIVERY, "the outbox sent out", || async {
        let counts = agent.metrics()?.binding("r", "x");
        anyhow::ensure!(counts.in_flight == 0 && counts.is_conserved(), "{counts:?}");
        Ok(())
    })
    .await?;

    let (_, arrivals) = case.aws.drain(&url, 0..N).await?;
    // Anything sent twice would show up now (the replays are within SQS's 5-minute window).
    tokio::time::sleep(Duration::from_secs(2)).await;
    case.aws.wait_empty(&url).await?;
    for group in ["d-0", "d-1"] {
        let seqs: Vec<u64> = arrivals
            .iter()
            .copied()
            .filter(|s| device(*s) == group)
            .collect();
        let want: Vec<u64> = (0..N).filter(|s| device(*s) == group).collect();
        assert_eq!(seqs, want, "group {group}: every message once, in order");
    }
    eprintln!("{before_restart} of {N} messages were in the queue when the agent was killed");
    Ok(())
}

/// The SQS endpoint is gone for ten seconds (moto killed, then started again empty on its
/// port, the queue created anew) while MQTT messages keep coming: the route holds them, the
/// session shows disconnected, nothing is dead-lettered, and once the endpoint is back every
/// message is sent.
#[tokio::test]
async fn an_sqs_outage_loses_nothing() -> anyhow::Result<()> {
    const N: u64 = 20;
    let mut moto = Moto::start_private().await?;
    let case = Case::with(Aws::on(&moto)).await?;
    let queue_attrs = [(QueueAttributeName::VisibilityTimeout, "5")];
    let (queue, url) = case.aws.queue("outage", &queue_attrs).await?;
    let yaml = case.mqtt_to_aws("sqs", &format!("queue_name: {queue}"), &queue, DIRECT);
    let agent = case.agent(&yaml).await?;
    case.publish(0..N / 2, PublishOptions::default()).await?;
    case.aws.drain(&url, 0..N / 2).await?;

    moto.kill()?;
    case.publish(N / 2..N, PublishOptions::default()).await?;
    wait::until(DELIVERY, "the sqs session disconnected", || {
        std::future::ready(
            agent
                .metrics()
                .is_ok_and(|m| m.session("ferry_session_connected", "aws") == 0.0),
        )
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(10)).await;
    moto.restart().await?;
    case.aws
        .sqs
        .create_queue()
        .queue_name(&queue)
        .send()
        .await?;
    let (_, copies) = case.aws.drain(&url, N / 2..N).await?;
    assert!(copies.len() as u64 >= N / 2);
    let m = agent.metrics()?;
    let c = m.binding("r", "x");
    assert_eq!((c.dead_lettered, c.dropped), (0, 0), "{c:?}");
    Ok(())
}

/// A message SQS has handed out twice already (to another consumer here) arrives with
/// `ApproximateReceiveCount` 3, the last receive its queue's redrive policy (`maxReceiveCount`
/// 3) allows: Ferry dead-letters it as `replay_exhausted` and deletes it, before SQS would move
/// it to the queue's own dead-letter queue. A fresh message goes through.
#[tokio::test]
async fn a_poison_message_reaches_ferrys_dlq_before_the_redrive_policy() -> anyhow::Result<()> {
    let case = Case::new().await?;
    let (_, dlq_url) = case.aws.queue("redrive-dlq", &[]).await?;
    let dlq_arn = dlq_url.rsplit('/').next().map(|name| {
        format!(
            "arn:aws:sqs:{}:{}:{name}",
            ferry_tests::moto::REGION,
            ferry_tests::moto::ACCOUNT_ID
        )
    });
    let redrive = format!(
        r#"{{"deadLetterTargetArn":"{}","maxReceiveCount":"3"}}"#,
        dlq_arn.unwrap_or_default()
    );
    let (queue, url) = case
        .aws
        .queue("poison", &[(QueueAttributeName::RedrivePolicy, &redrive)])
        .await?;
    case.aws.send_seq(&url, 0..1).await?;
    for _ in 0..2 {
        let out = case
            .aws
            .sqs
            .receive_message()
            .queue_url(&url)
            .wait_time_seconds(5)
            .send()
            .await?;
        let handle = out
            .messages()
            .first()
            .and_then(|m| m.receipt_handle())
            .context("the message is received")?;
        case.aws
            .sqs
            .change_message_visibility()
            .queue_url(&url)
            .receipt_handle(handle)
            .visibility_timeout(0)
            .send()
            .await?;
    }
    let collector = case.collector().await?;
    let yaml = case.sqs_to_mqtt(&queue, &[], DIRECT, &["x"]);
    let agent = case.agent(&yaml).await?;
    let entry = the_one_dlq_entry(&agent).await?;
    assert_eq!(
        entry.reason,
        pb::DlqReason::ReplayExhausted as i32,
        "{entry:?}"
    );
    assert!(
        entry.last_error.contains("received 3 times"),
        "{}",
        entry.last_error
    );
    case.aws.send_seq(&url, 1..2).await?;
    collector
        .wait_for(&case.output("x"), 1..2, DELIVERY)
        .await?;
    case.aws.wait_empty(&url).await?;
    assert_eq!(case.aws.depth(&dlq_url).await?, (0, 0));
    assert_eq!(collector.counts().count(&case.output("x"), 0), 0);
    Ok(())
}
