//! MQTT into an SNS topic, read back from an SQS queue subscribed to it.

use ferry_tests::moto::{ACCOUNT_ID, REGION};

use super::support::{Case, DIRECT};

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
    case.publish_traced_and_drain(&url, N).await?;
    Ok(())
}
