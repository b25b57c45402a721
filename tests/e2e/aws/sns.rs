//! MQTT into an SNS topic, read back from an SQS queue subscribed to it.

use ferry_tests::PublishOptions;
use ferry_tests::moto::{ACCOUNT_ID, REGION};

use super::support::{Case, DIRECT, TRACE_ID, TRACEPARENT, attribute};

/// MQTT → SNS (topic by name) → an SQS queue subscribed with raw delivery: every message once,
/// with its headers as message attributes.
#[tokio::test]
async fn mqtt_to_sns_reaches_a_subscribed_queue() -> anyhow::Result<()> {
    const N: u64 = 20;
    let case = Case::new().await?;
    let (queue, url) = case.aws.queue("sub", &[]).await?;
    let sns = &case.aws.sns;
    let topic = format!("{queue}-topic");
    let arn = sns
        .create_topic()
        .name(&topic)
        .send()
        .await?
        .topic_arn()
        .unwrap_or_default()
        .to_owned();
    sns.subscribe()
        .topic_arn(&arn)
        .protocol("sqs")
        .endpoint(format!("arn:aws:sqs:{REGION}:{ACCOUNT_ID}:{queue}"))
        .attributes("RawMessageDelivery", "true")
        .send()
        .await?;
    let yaml = case.mqtt_to_aws("sns", &format!("topic_name: {topic}"), &arn, DIRECT);
    let _agent = case.agent(&yaml).await?;
    let headers = PublishOptions {
        user_properties: vec![
            ("site".into(), "north".into()),
            ("traceparent".into(), TRACEPARENT.into()),
        ],
        ..Default::default()
    };
    case.publish(0..N, headers).await?;
    let (got, copies) = case.aws.drain(&url, 0..N).await?;
    assert_eq!(copies.len() as u64, N, "each message once");
    for (seq, m) in &got {
        assert_eq!(attribute(m, "site"), Some("north"), "{seq}: {m:?}");
        assert!(
            attribute(m, "traceparent").is_some_and(|tp| tp.contains(TRACE_ID)),
            "{seq}: {m:?}"
        );
    }
    Ok(())
}
