//! The reference bridge's main configuration, each of its variations merged into it, and the
//! example configurations in `deploy/examples/` load unchanged and validate.

use ferry_shared::config::{
    AckAfter, DeliveryMode, DispatchMode, DrainPoll, Duration, OutboxStoreConfig, ValidConfig,
    check_file, load_str, parse, validate,
};

fn testdata(name: &str) -> String {
    let path = format!("{}/src/config/testdata/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn load_valid(name: &str) -> ValidConfig {
    let text = testdata(name);
    let config = parse(&text).unwrap_or_else(|e| panic!("{name} does not load: {e}"));
    validate(&config).unwrap_or_else(|errors| {
        panic!(
            "{name} is invalid:\n{}",
            errors
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("\n")
        )
    })
}

/// `snippet` (as the reference document prints it), indented by `indent` spaces, appears
/// verbatim in the fixture: the variation was merged in unchanged.
#[track_caller]
fn contains_verbatim(name: &str, snippet: &str, indent: usize) {
    let pad = " ".repeat(indent);
    let indented: String = snippet.lines().map(|l| format!("{pad}{l}\n")).collect();
    assert!(
        testdata(name).contains(&indented),
        "{name} does not contain the variation verbatim:\n{indented}"
    );
}

const SQLITE_OUTBOX: &str = r#"stores:
  outbox:
    type: sqlite
    options:
      path: /var/lib/gobridge/outbox.db
  lease:
    type: dynamodb
    options:
      table_name: gobridge-leases
"#;

const DYNAMODB_OUTBOX: &str = r#"stores:
  outbox:
    type: dynamodb
    options:
      table_name: gobridge-outbox
      region: us-west-1
  lease:
    type: dynamodb
    options:
      table_name: gobridge-leases
"#;

const ADAPTIVE_BACKOFF: &str = r#"session:
  drain_batch_size: 100
  drain_strategy:
    type: adaptive_backoff
    min_interval: 100ms
    max_interval: 30s
    multiplier: 2.0
"#;

const DLQ_STORES: &str = r#"stores:
  outbox:
    type: sqlite
    options:
      path: /var/lib/gobridge/outbox.db
  dlq:
    type: sqlite
    options:
      path: /var/lib/gobridge/dlq.db
"#;

const DLQ_ROUTES: &str = r#"routes:
  - id: sensor-ingest
    receiver_id: mqtt-in
    delivery_mode: shared_outbox
    dispatch_mode: fan_out
    bindings: [to-events, to-audit, to-analytics]
    policy:
      max_replay_attempts: 3
      on_permanent_failure: dlq
      on_expired: dlq
"#;

const DIRECT_HOLD: &str = r#"routes:
  - id: sensor-ingest
    receiver_id: mqtt-in
    delivery_mode: direct_hold
    dispatch_mode: single
    bindings: [to-events]
    policy:
      ack_after: target_accept   # direct_hold default; the source is held open until the target accepts
      max_in_flight: 50
"#;

const COMBINED: &str = r#"routes:
  - id: durable-fanout
    receiver_id: mqtt-in
    delivery_mode: shared_outbox
    dispatch_mode: fan_out
    bindings: [to-events, to-audit, to-analytics]
    policy:
      ack_after: outbox_persist
      max_outbox_depth: 5000
"#;

#[test]
fn seed_main_configuration_loads_and_validates() {
    let valid = load_valid("seed_main.yaml");
    let route = valid.route("sensor-ingest").expect("route");
    assert_eq!(route.delivery_mode, DeliveryMode::SharedOutbox);
    assert_eq!(route.dispatch_mode, DispatchMode::FanOut);
    assert_eq!(route.ack_after(), AckAfter::OutboxPersist);
    let session = route.session.as_ref().expect("session block");
    assert_eq!(
        session.drain_poll(),
        DrainPoll::Fixed(Duration::from_secs(1))
    );
    assert_eq!(session.drain_batch_size, 50);
    assert_eq!(session.lease_ttl, Duration::from_secs(15));
    assert_eq!(session.renew_interval(), Duration::from_secs(5));
    assert_eq!(session.step_down_grace, Duration::from_secs(5));
    assert_eq!(route.policy.replay_budget, Duration::from_secs(900));
    assert_eq!(route.policy.send_timeout, Duration::from_secs(30));
}

#[test]
fn seed_main_configuration_is_the_deploy_example() {
    let example = std::fs::read_to_string(format!(
        "{}/../deploy/examples/durable-sensor-ingest.yaml",
        env!("CARGO_MANIFEST_DIR")
    ))
    .expect("example");
    assert_eq!(example, testdata("seed_main.yaml"));
}

#[test]
fn sqlite_outbox_variation() {
    contains_verbatim("variation_sqlite_outbox.yaml", SQLITE_OUTBOX, 0);
    let valid = load_valid("variation_sqlite_outbox.yaml");
    assert!(
        matches!(&valid.stores.outbox, Some(OutboxStoreConfig::Sqlite(o)) if o.path == "/var/lib/gobridge/outbox.db")
    );
}

#[test]
fn dynamodb_outbox_variation() {
    contains_verbatim("variation_dynamodb_outbox.yaml", DYNAMODB_OUTBOX, 0);
    let valid = load_valid("variation_dynamodb_outbox.yaml");
    let Some(OutboxStoreConfig::Dynamodb(o)) = &valid.stores.outbox else {
        panic!("expected a dynamodb outbox");
    };
    assert_eq!(
        (o.table_name.as_str(), o.region.as_deref()),
        ("gobridge-outbox", Some("us-west-1"))
    );
}

#[test]
fn adaptive_backoff_variation() {
    contains_verbatim("variation_adaptive_backoff.yaml", ADAPTIVE_BACKOFF, 4);
    let valid = load_valid("variation_adaptive_backoff.yaml");
    let session = valid.routes[0].session.as_ref().expect("session block");
    assert_eq!(session.drain_batch_size, 100);
    assert_eq!(
        session.drain_poll(),
        DrainPoll::AdaptiveBackoff {
            min_interval: Duration::from_millis(100),
            max_interval: Duration::from_secs(30),
            multiplier: 2.0,
        }
    );
}

#[test]
fn dlq_variation() {
    contains_verbatim("variation_dlq.yaml", DLQ_STORES, 0);
    contains_verbatim("variation_dlq.yaml", DLQ_ROUTES, 0);
    let valid = load_valid("variation_dlq.yaml");
    assert_eq!(valid.routes[0].policy.max_replay_attempts, 3);
    assert!(valid.stores.dlq.is_some());
}

#[test]
fn direct_hold_variation() {
    contains_verbatim("variation_direct_hold.yaml", DIRECT_HOLD, 0);
    let valid = load_valid("variation_direct_hold.yaml");
    let route = &valid.routes[0];
    assert_eq!(route.delivery_mode, DeliveryMode::DirectHold);
    assert_eq!(route.ack_after(), AckAfter::TargetAccept);
    assert_eq!(route.policy.max_in_flight, 50);
}

#[test]
fn combined_durable_fan_out_variation() {
    contains_verbatim("variation_combined_fanout.yaml", COMBINED, 0);
    let valid = load_valid("variation_combined_fanout.yaml");
    let route = valid.route("durable-fanout").expect("route");
    assert_eq!(route.policy.max_outbox_depth, 5000);
    assert_eq!(
        valid.partition(route),
        "durable-sensor-ingest/durable-fanout"
    );
}

#[test]
fn each_variation_snippet_loads_unchanged_on_its_own() {
    // The stores and routes snippets parse as they are printed, as part of a document.
    for snippet in [
        SQLITE_OUTBOX,
        DYNAMODB_OUTBOX,
        DLQ_STORES,
        DLQ_ROUTES,
        DIRECT_HOLD,
        COMBINED,
    ] {
        let text = format!("bridge:\n  id: b\n{snippet}");
        load_str(&text, &|_: &str| None).unwrap_or_else(|e| panic!("{e}\n{text}"));
    }
}

#[test]
fn deploy_examples_validate() {
    let dir = format!("{}/../deploy/examples", env!("CARGO_MANIFEST_DIR"));
    let env = |name: &str| match name {
        "MQTT_PASSWORD" | "RABBITMQ_PASSWORD" | "NATS_TOKEN" | "PG_PASSWORD" | "MYSQL_PASSWORD" => {
            Some("s3cret".to_owned())
        }
        "ORDERS_QUEUE_URL" => {
            Some("https://sqs.eu-central-1.amazonaws.com/123456789012/orders".to_owned())
        }
        "EVENTS_QUEUE_URL" => {
            Some("https://sqs.eu-central-1.amazonaws.com/123456789012/events".to_owned())
        }
        _ => None,
    };
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("deploy/examples") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "yaml") {
            if let Err(e) = check_file(&path, &env) {
                panic!("{} is invalid:\n{e}", path.display());
            }
            seen += 1;
        }
    }
    assert!(seen >= 6, "expected the example configurations in {dir}");
}
