//! The harness tests itself: each helper does what later tests rely on.

use std::net::TcpStream;
use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
};
use ferry_tests::mqtt::QoS;
use ferry_tests::{ChildProcess, Collector, Mosquitto, Moto, TestDatabase, ids, publish_seq};

const TIMEOUT: Duration = Duration::from_secs(10);

#[tokio::test]
async fn mosquitto_round_trip_outage_and_persistent_session() -> anyhow::Result<()> {
    let mut broker = Mosquitto::start().await?;
    let topic = ids::unique("selftest");
    let subscriber = ids::unique("collector");

    // Round trip.
    let collector = Collector::start(
        &broker.url(),
        &subscriber,
        &format!("{topic}/#"),
        QoS::AtLeastOnce,
    )
    .await?;
    let first = format!("{topic}/a");
    publish_seq(&broker.url(), &first, 0..10, QoS::AtLeastOnce).await?;
    let counts = collector.wait_for(&first, 0..10, TIMEOUT).await?;
    assert!(counts.duplicates().is_empty(), "{counts:?}");

    // The subscriber goes away; the broker queues for its persistent session.
    let counts = collector.disconnect().await?;
    assert_eq!(counts.total(), 10);
    let second = format!("{topic}/b");
    publish_seq(&broker.url(), &second, 0..20, QoS::AtLeastOnce).await?;

    // Outage: the port refuses connections, then the broker comes back on the same port.
    let port = broker.port();
    broker.stop().await?;
    let refused = TcpStream::connect(broker.addr()).expect_err("the broker is stopped");
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
    broker.restart().await?;
    assert_eq!(broker.port(), port);
    assert_eq!(broker.url(), format!("tcp://127.0.0.1:{port}"));

    // The queued QoS 1 messages survived the restart and reach the returning subscriber.
    let collector = Collector::start(
        &broker.url(),
        &subscriber,
        &format!("{topic}/#"),
        QoS::AtLeastOnce,
    )
    .await?;
    let counts = collector.wait_for(&second, 0..20, TIMEOUT).await?;
    assert_eq!(counts.distinct(&second), 20);
    assert_eq!(counts.count(&first, 0), 0, "nothing old is redelivered");
    Ok(())
}

#[tokio::test]
async fn mosquitto_kill_and_restart_without_persistence() -> anyhow::Result<()> {
    let mut broker = Mosquitto::builder().persistence(false).start().await?;
    assert!(broker.is_running());
    broker.kill()?;
    assert!(!broker.is_running());
    assert!(TcpStream::connect(broker.addr()).is_err());
    broker.restart().await?;
    let topic = ids::unique("selftest");
    let collector = Collector::start(
        &broker.url(),
        &ids::unique("collector"),
        &topic,
        QoS::ExactlyOnce,
    )
    .await?;
    publish_seq(&broker.url(), &topic, 0..5, QoS::ExactlyOnce).await?;
    collector.wait_for(&topic, 0..5, TIMEOUT).await?;
    assert!(broker.log().contains("running"), "{}", broker.log());
    Ok(())
}

#[tokio::test]
async fn two_brokers_get_different_ports() -> anyhow::Result<()> {
    let a = Mosquitto::start().await?;
    let b = Mosquitto::builder()
        .config_line("# an extra line")
        .start()
        .await?;
    assert_ne!(a.port(), b.port());
    let config = std::fs::read_to_string(b.dir().join("mosquitto.conf"))?;
    assert!(config.ends_with("# an extra line\n"), "{config}");
    Ok(())
}

#[tokio::test]
async fn moto_serves_sqs() -> anyhow::Result<()> {
    let moto = Moto::shared().await?;
    let sqs = moto.sqs();
    let queue = sqs
        .create_queue()
        .queue_name(ids::unique("selftest"))
        .send()
        .await?;
    let url = queue.queue_url().expect("moto returns the queue URL");
    sqs.send_message()
        .queue_url(url)
        .message_body("hello")
        .send()
        .await?;
    let received = sqs
        .receive_message()
        .queue_url(url)
        .wait_time_seconds(1)
        .send()
        .await?;
    let bodies: Vec<_> = received
        .messages()
        .iter()
        .filter_map(|m| m.body())
        .collect();
    assert_eq!(bodies, ["hello"]);
    // The same server for every caller in the process.
    assert_eq!(Moto::shared().await?.endpoint(), moto.endpoint());
    Ok(())
}

#[tokio::test]
async fn moto_serves_dynamodb() -> anyhow::Result<()> {
    let moto = Moto::shared().await?;
    let dynamodb = moto.dynamodb();
    let table = ids::unique("selftest");
    dynamodb
        .create_table()
        .table_name(&table)
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("pk")
                .attribute_type(ScalarAttributeType::S)
                .build()?,
        )
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("pk")
                .key_type(KeyType::Hash)
                .build()?,
        )
        .billing_mode(BillingMode::PayPerRequest)
        .send()
        .await?;
    let tables = dynamodb.list_tables().send().await?;
    assert!(tables.table_names().contains(&table), "{tables:?}");
    Ok(())
}

#[tokio::test]
async fn postgres_gives_each_test_its_own_database() -> anyhow::Result<()> {
    let a = TestDatabase::create().await?;
    let b = TestDatabase::create().await?;
    assert_ne!(a.name(), b.name());
    assert!(a.url()?.ends_with(&format!("/{}", a.name())));

    let client = a.connect().await?;
    client
        .batch_execute("CREATE TABLE t (x int); INSERT INTO t VALUES (1)")
        .await?;
    let row = client
        .query_one("SELECT current_database(), count(*) FROM t", &[])
        .await?;
    assert_eq!(row.get::<_, String>(0), a.name());
    assert_eq!(row.get::<_, i64>(1), 1);
    // The other database does not have the table.
    let other = b.connect().await?;
    assert!(
        other
            .query_one("SELECT count(*) FROM t", &[])
            .await
            .is_err()
    );

    // Dropping the value drops the database, even with a connection still open.
    let name = a.name().to_owned();
    drop(a);
    let exists = other
        .query_one(
            "SELECT count(*) FROM pg_database WHERE datname = $1",
            &[&name],
        )
        .await?;
    assert_eq!(exists.get::<_, i64>(0), 0);
    drop(client);
    Ok(())
}

#[tokio::test]
async fn process_is_killed_and_observed() -> anyhow::Result<()> {
    let mut sleeper = ChildProcess::spawn("sleep", ["30"], [("FERRY_UNUSED", "1")])?;
    assert!(sleeper.is_running());
    let status = sleeper.sigkill()?;
    assert_eq!(status.signal(), Some(9), "{status:?}");
    assert!(!sleeper.is_running());
    Ok(())
}

#[tokio::test]
async fn process_output_sigterm_and_exit() -> anyhow::Result<()> {
    // The trap is set before `ready` is printed: a SIGTERM right after it must reach the trap.
    let script =
        "trap 'echo bye; exit 3' TERM; echo ready; echo oops >&2; while :; do sleep 0.05; done";
    let mut shell = ChildProcess::spawn("sh", ["-c", script], [("FERRY_GREETING", "hi")])?;
    shell.wait_for_output("ready", TIMEOUT).await?;
    shell.sigterm()?;
    let status = shell.wait_exit(TIMEOUT).await?;
    assert_eq!(status.code(), Some(3));
    assert_eq!(shell.stdout(), "ready\nbye\n");
    assert_eq!(shell.stderr(), "oops\n");

    let mut quick = ChildProcess::spawn("sh", ["-c", "exit 0"], Vec::<(String, String)>::new())?;
    let error = quick
        .wait_for_output("never printed", TIMEOUT)
        .await
        .expect_err("the process exits first");
    assert!(format!("{error:#}").contains("exited"), "{error:#}");
    Ok(())
}

#[test]
fn project_binaries_are_found_or_explained() {
    match ferry_tests::project_bin("ferry-agent") {
        Ok(path) => assert!(path.is_file()),
        Err(error) => assert!(
            error.to_string().contains("cargo build --workspace --bins"),
            "{error}"
        ),
    }
    let error = ferry_tests::project_bin("no-such-binary").expect_err("not a project binary");
    assert!(
        error.to_string().contains("cargo build --workspace --bins"),
        "{error}"
    );
}
