//! One test per rule: the reference bridge's main configuration (valid), one mutation, and the
//! path and rule text of the error it must produce.

use super::super::duration::Duration;
use super::super::load::parse;
use super::super::model::BridgeConfig;
use super::super::route::{
    AckAfter, DeliveryMode, DispatchMode, DrainStrategy, DrainStrategyType, FailureAction,
    RouteSession,
};
use super::super::store::{
    DlqStoreConfig, LeaseStoreConfig, MemoryOptions, OutboxStoreConfig, PostgresOutboxOptions,
};
use super::super::transport::{OrderBy, ProtocolVersion, Receiver, Sender, Session, StateColumn};
use super::{ConfigError, validate};

const SEED_MAIN: &str = include_str!("../testdata/seed_main.yaml");

fn base() -> BridgeConfig {
    parse(SEED_MAIN).expect("the seed's main configuration parses")
}

fn yaml<T: serde::de::DeserializeOwned>(text: &str) -> T {
    serde_saphyr::from_str(text).expect("test snippet parses")
}

/// The errors after applying `mutate` to the base configuration.
fn errors(mutate: impl FnOnce(&mut BridgeConfig)) -> Vec<ConfigError> {
    let mut config = base();
    mutate(&mut config);
    match validate(&config) {
        Ok(_) => panic!("expected the mutated configuration to be invalid"),
        Err(errors) => errors,
    }
}

/// Asserts that one error has exactly `path` and a message containing `needle`.
#[track_caller]
fn assert_error(errors: &[ConfigError], path: &str, needle: &str) {
    assert!(
        errors
            .iter()
            .any(|e| e.path == path && e.message.contains(needle)),
        "no error at `{path}` containing `{needle}`; got:\n{}",
        errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The rule under test, alone: the mutation produces exactly the expected error.
#[track_caller]
fn assert_only(errors: &[ConfigError], path: &str, needle: &str) {
    assert_error(errors, path, needle);
    assert_eq!(errors.len(), 1, "expected one error, got {errors:#?}");
}

fn sqs_session() -> Session {
    yaml("id: aws\ntransport: sqs\noptions:\n  session:\n    region: us-east-1\n")
}

fn sqs_sender(queue: &str) -> Sender {
    yaml(&format!(
        "id: sqs-out\nsession_id: aws\noptions:\n  sender:\n    {queue}\n"
    ))
}

fn route_session(c: &mut BridgeConfig) -> &mut RouteSession {
    c.routes[0]
        .session
        .as_mut()
        .expect("the base route has a session block")
}

/// Makes route 0 a direct_hold route with one binding and no session block.
fn direct_hold(c: &mut BridgeConfig) {
    let r = &mut c.routes[0];
    r.delivery_mode = DeliveryMode::DirectHold;
    r.dispatch_mode = DispatchMode::Single;
    r.bindings.truncate(1);
    r.policy.ack_after = None;
    r.session = None;
}

#[test]
fn the_base_configuration_is_valid() {
    let valid = validate(&base()).expect("valid");
    assert_eq!(valid.bridge_id(), "durable-sensor-ingest");
}

#[test]
fn errors_display_as_path_colon_message() {
    let errs = errors(|c| c.routes[0].bindings[2] = "to-nowhere".into());
    assert_eq!(
        errs[0].to_string(),
        "routes[0].bindings[2]: unknown binding \"to-nowhere\""
    );
}

#[test]
fn every_problem_is_reported_at_once() {
    let errs = errors(|c| {
        c.routes[0].bindings[2] = "to-nowhere".into();
        c.receivers[0].topics.as_mut().expect("topics")[0].qos = 3;
        c.bindings[0].sender_id = "ghost".into();
    });
    assert_error(&errs, "routes[0].bindings[2]", "unknown binding");
    assert_error(&errs, "receivers[0].topics[0].qos", "0, 1 or 2");
    assert_error(&errs, "bindings[0].sender_id", "unknown sender \"ghost\"");
}

// ---- ids and references

#[test]
fn empty_ids_are_rejected() {
    assert_error(
        &errors(|c| c.sessions[0].id.clear()),
        "sessions[0].id",
        "must not be empty",
    );
    assert_error(
        &errors(|c| c.bridge.id.clear()),
        "bridge.id",
        "must not be empty",
    );
    assert_error(
        &errors(|c| c.routes[0].id.clear()),
        "routes[0].id",
        "must not be empty",
    );
}

#[test]
fn malformed_ids_are_rejected() {
    assert_only(
        &errors(|c| c.routes[0].id = "a/b".into()),
        "routes[0].id",
        "may contain only",
    );
    assert_error(
        &errors(|c| c.bridge.id = "x".repeat(129)),
        "bridge.id",
        "at most 128",
    );
}

#[test]
fn duplicate_ids_are_rejected() {
    assert_only(
        &errors(|c| {
            let dup = c.bindings[0].clone();
            c.bindings.push(dup);
        }),
        "bindings[3].id",
        "duplicate binding id \"to-events\" (also bindings[0])",
    );
    assert_error(
        &errors(|c| {
            let dup = c.sessions[0].clone();
            c.sessions.push(dup);
        }),
        "sessions[1].id",
        "duplicate session id",
    );
    assert_error(
        &errors(|c| {
            let dup = c.senders[0].clone();
            c.senders.push(dup);
        }),
        "senders[1].id",
        "duplicate sender id",
    );
    assert_error(
        &errors(|c| {
            let dup = c.receivers[0].clone();
            c.receivers.push(dup);
        }),
        "receivers[1].id",
        "duplicate receiver id",
    );
    assert_error(
        &errors(|c| {
            let dup = c.routes[0].clone();
            c.routes.push(dup);
        }),
        "routes[1].id",
        "duplicate route id",
    );
}

#[test]
fn receiver_must_reference_a_session() {
    assert_only(
        &errors(|c| c.receivers[0].session_id = "nope".into()),
        "receivers[0].session_id",
        "unknown session \"nope\"",
    );
}

#[test]
fn sender_must_reference_a_session() {
    let errs = errors(|c| c.senders[0].session_id = "nope".into());
    assert_error(&errs, "senders[0].session_id", "unknown session \"nope\"");
}

#[test]
fn binding_must_reference_a_sender() {
    assert_only(
        &errors(|c| c.bindings[1].sender_id = "nope".into()),
        "bindings[1].sender_id",
        "unknown sender \"nope\"",
    );
}

#[test]
fn route_must_reference_a_receiver() {
    assert_only(
        &errors(|c| c.routes[0].receiver_id = "nope".into()),
        "routes[0].receiver_id",
        "unknown receiver \"nope\"",
    );
}

#[test]
fn route_must_reference_its_bindings() {
    assert_only(
        &errors(|c| c.routes[0].bindings[2] = "to-nowhere".into()),
        "routes[0].bindings[2]",
        "unknown binding \"to-nowhere\"",
    );
}

#[test]
fn route_lists_each_binding_once() {
    assert_only(
        &errors(|c| c.routes[0].bindings[2] = "to-events".into()),
        "routes[0].bindings[2]",
        "listed twice",
    );
}

#[test]
fn route_session_block_must_reference_a_session_and_a_sender() {
    let errs = errors(|c| route_session(c).session_id = "nope".into());
    assert_only(
        &errs,
        "routes[0].session.session_id",
        "unknown session \"nope\"",
    );
    let errs = errors(|c| route_session(c).sender_id = "nope".into());
    assert_only(
        &errs,
        "routes[0].session.sender_id",
        "unknown sender \"nope\"",
    );
}

#[test]
fn a_bridge_needs_a_route() {
    assert_only(
        &errors(|c| c.routes.clear()),
        "routes",
        "at least one route",
    );
}

#[test]
fn a_route_needs_a_binding() {
    let errs = errors(|c| c.routes[0].bindings.clear());
    assert_error(&errs, "routes[0].bindings", "at least one binding");
}

#[test]
fn a_receiver_feeds_one_route() {
    let errs = errors(|c| {
        let mut second = c.routes[0].clone();
        second.id = "second".into();
        c.routes.push(second);
    });
    assert_error(&errs, "routes[1].receiver_id", "already feeds routes[0]");
}

// ---- delivery and dispatch modes

#[test]
fn shared_outbox_needs_an_outbox_store() {
    assert_error(
        &errors(|c| c.stores.outbox = None),
        "routes[0].delivery_mode",
        "needs an outbox store",
    );
}

#[test]
fn shared_outbox_needs_a_lease_store() {
    assert_only(
        &errors(|c| c.stores.lease = None),
        "routes[0].delivery_mode",
        "needs a lease store",
    );
}

#[test]
fn shared_outbox_needs_a_session_block() {
    assert_only(
        &errors(|c| c.routes[0].session = None),
        "routes[0].session",
        "shared_outbox needs a session block",
    );
}

#[test]
fn direct_hold_has_no_session_block() {
    let errs = errors(|c| {
        let session = c.routes[0].session.clone();
        direct_hold(c);
        c.routes[0].session = session;
    });
    assert_only(
        &errs,
        "routes[0].session",
        "only shared_outbox routes have a drainer",
    );
}

#[test]
fn target_accept_is_rejected_on_shared_outbox() {
    assert_only(
        &errors(|c| c.routes[0].policy.ack_after = Some(AckAfter::TargetAccept)),
        "routes[0].policy.ack_after",
        "target_accept is not possible on shared_outbox",
    );
}

#[test]
fn outbox_persist_is_rejected_on_direct_hold() {
    assert_only(
        &errors(|c| {
            direct_hold(c);
            c.routes[0].policy.ack_after = Some(AckAfter::OutboxPersist);
        }),
        "routes[0].policy.ack_after",
        "outbox_persist needs delivery_mode shared_outbox",
    );
}

#[test]
fn ack_after_defaults_by_delivery_mode() {
    let mut c = base();
    c.routes[0].policy.ack_after = None;
    assert_eq!(c.routes[0].ack_after(), AckAfter::OutboxPersist);
    direct_hold(&mut c);
    assert_eq!(c.routes[0].ack_after(), AckAfter::TargetAccept);
    assert!(validate(&c).is_ok());
}

#[test]
fn fan_out_needs_shared_outbox() {
    assert_only(
        &errors(|c| {
            direct_hold(c);
            c.routes[0].dispatch_mode = DispatchMode::FanOut;
        }),
        "routes[0].dispatch_mode",
        "fan_out needs delivery_mode shared_outbox",
    );
}

#[test]
fn single_dispatch_needs_exactly_one_binding() {
    assert_only(
        &errors(|c| c.routes[0].dispatch_mode = DispatchMode::Single),
        "routes[0].bindings",
        "single dispatch needs exactly one binding, found 3",
    );
}

#[test]
fn direct_hold_needs_exactly_one_binding() {
    assert_only(
        &errors(|c| {
            direct_hold(c);
            c.routes[0].bindings.push("to-audit".into());
        }),
        "routes[0].bindings",
        "direct_hold needs exactly one binding, found 2",
    );
}

#[test]
fn dlq_actions_need_a_dlq_store() {
    let errs = errors(|c| c.stores.dlq = None);
    assert_error(&errs, "routes[0].policy.on_expired", "needs a DLQ store");
    assert_error(
        &errs,
        "routes[0].policy.on_permanent_failure",
        "needs a DLQ store",
    );
    assert_eq!(errs.len(), 2);
    let mut c = base();
    c.stores.dlq = None;
    c.routes[0].policy.on_expired = FailureAction::Drop;
    c.routes[0].policy.on_permanent_failure = FailureAction::Drop;
    assert!(validate(&c).is_ok());
}

#[test]
fn shared_outbox_bindings_are_on_the_session_block_sender() {
    let errs = errors(|c| {
        let mut other = c.senders[0].clone();
        other.id = "mqtt-out-2".into();
        c.senders.push(other);
        c.bindings[1].sender_id = "mqtt-out-2".into();
    });
    assert_only(
        &errs,
        "routes[0].bindings[1]",
        "binding \"to-audit\" is on sender \"mqtt-out-2\", but this shared_outbox route drains through sender \"mqtt-out\"",
    );
}

#[test]
fn session_block_sender_is_on_the_session_block_session() {
    let errs = errors(|c| {
        let mut other = c.sessions[0].clone();
        other.id = "mqtt-conn-2".into();
        other.options.session.client_id = Some("other".into());
        c.sessions.push(other);
        route_session(c).session_id = "mqtt-conn-2".into();
    });
    assert_only(
        &errs,
        "routes[0].session.sender_id",
        "publishes on session \"mqtt-conn\", not on the session block's session \"mqtt-conn-2\"",
    );
}

// ---- session block

#[test]
fn drain_interval_and_strategy_are_exclusive() {
    let errs = errors(|c| {
        route_session(c).drain_strategy = Some(yaml("type: adaptive_backoff"));
    });
    assert_only(
        &errs,
        "routes[0].session.drain_strategy",
        "mutually exclusive",
    );
}

fn adaptive(min: u64, max: u64, multiplier: f64) -> DrainStrategy {
    DrainStrategy {
        kind: DrainStrategyType::AdaptiveBackoff,
        min_interval: Duration::from_millis(min),
        max_interval: Duration::from_millis(max),
        multiplier,
    }
}

#[test]
fn adaptive_backoff_min_must_not_exceed_max() {
    let errs = errors(|c| {
        let s = route_session(c);
        s.drain_interval = None;
        s.drain_strategy = Some(adaptive(5000, 100, 2.0));
    });
    assert_only(
        &errs,
        "routes[0].session.drain_strategy.min_interval",
        "min_interval (5s) must not exceed max_interval (100ms)",
    );
}

#[test]
fn adaptive_backoff_multiplier_is_at_least_one() {
    let errs = errors(|c| {
        let s = route_session(c);
        s.drain_interval = None;
        s.drain_strategy = Some(adaptive(100, 1000, 0.5));
    });
    assert_only(
        &errs,
        "routes[0].session.drain_strategy.multiplier",
        "at least 1.0",
    );
    let errs = errors(|c| {
        let s = route_session(c);
        s.drain_interval = None;
        s.drain_strategy = Some(adaptive(100, 1000, f64::NAN));
    });
    assert_only(
        &errs,
        "routes[0].session.drain_strategy.multiplier",
        "at least 1.0",
    );
}

#[test]
fn renew_interval_is_less_than_lease_ttl() {
    let errs = errors(|c| route_session(c).renew_interval = Some(Duration::from_secs(15)));
    assert_only(
        &errs,
        "routes[0].session.renew_interval",
        "renew_interval (15s) must be less than lease_ttl (15s)",
    );
    let c = base();
    let s = c.routes[0].session.as_ref().expect("session");
    assert_eq!(s.renew_interval(), Duration::from_secs(5));
}

#[test]
fn durations_must_be_positive() {
    type Mutation = fn(&mut BridgeConfig);
    let cases: [(&str, Mutation); 12] = [
        ("routes[0].session.drain_interval", |c| {
            route_session(c).drain_interval = Some(Duration::ZERO)
        }),
        ("routes[0].session.lease_ttl", |c| {
            route_session(c).lease_ttl = Duration::ZERO
        }),
        ("routes[0].session.renew_interval", |c| {
            route_session(c).renew_interval = Some(Duration::ZERO)
        }),
        ("routes[0].session.step_down_grace", |c| {
            route_session(c).step_down_grace = Duration::ZERO
        }),
        ("routes[0].session.drain_strategy.min_interval", |c| {
            let s = route_session(c);
            s.drain_interval = None;
            s.drain_strategy = Some(adaptive(0, 1000, 2.0));
        }),
        ("routes[0].policy.replay_budget", |c| {
            c.routes[0].policy.replay_budget = Duration::ZERO
        }),
        ("routes[0].policy.send_timeout", |c| {
            c.routes[0].policy.send_timeout = Duration::ZERO
        }),
        ("routes[0].policy.send_retry_budget", |c| {
            c.routes[0].policy.send_retry_budget = Duration::ZERO
        }),
        ("routes[0].policy.ttl", |c| {
            c.routes[0].policy.ttl = Some(Duration::ZERO)
        }),
        ("routes[0].policy.retry_backoff.initial_interval", |c| {
            c.routes[0].policy.retry_backoff.initial_interval = Duration::ZERO
        }),
        ("stores.outbox.options.stale_claim_duration", |c| {
            c.stores.outbox = Some(yaml(
                "type: sqlite\noptions:\n  path: /x\n  stale_claim_duration: 0s\n",
            ))
        }),
        ("stores.outbox.options.busy_timeout", |c| {
            c.stores.outbox = Some(yaml(
                "type: sqlite\noptions:\n  path: /x\n  busy_timeout: 0ms\n",
            ))
        }),
    ];
    for (path, mutate) in cases {
        assert_error(&errors(mutate), path, "must be greater than zero");
    }
}

#[test]
fn retry_backoff_is_ordered_and_grows() {
    let errs = errors(|c| {
        let b = &mut c.routes[0].policy.retry_backoff;
        b.initial_interval = Duration::from_secs(60);
        b.multiplier = 0.9;
    });
    assert_error(
        &errs,
        "routes[0].policy.retry_backoff.initial_interval",
        "must not exceed max_interval",
    );
    assert_error(
        &errs,
        "routes[0].policy.retry_backoff.multiplier",
        "at least 1.0",
    );
}

#[test]
fn numeric_limits_must_be_positive() {
    let errs = errors(|c| {
        let p = &mut c.routes[0].policy;
        p.max_in_flight = 0;
        p.max_outbox_depth = 0;
        p.max_payload_bytes = 0;
        route_session(c).drain_batch_size = 0;
    });
    for path in [
        "routes[0].policy.max_in_flight",
        "routes[0].policy.max_outbox_depth",
        "routes[0].policy.max_payload_bytes",
        "routes[0].session.drain_batch_size",
    ] {
        assert_error(&errs, path, "must be greater than zero");
    }
    assert_eq!(errs.len(), 4);
}

// ---- stores

#[test]
fn memory_lease_with_durable_outbox_is_rejected() {
    let errs =
        errors(|c| c.stores.lease = Some(LeaseStoreConfig::Memory(MemoryOptions::default())));
    assert_only(
        &errs,
        "stores.lease.type",
        "fencing versions restart at zero after a restart, so every claim falls below the outbox's durable high-water mark",
    );
    assert!(errs[0].message.contains("never drains again"));
}

/// Leases and dead letters kept by the control plane pair with a durable local outbox: its
/// versions are durable in the control plane's state, so they never fall below the outbox's
/// high-water mark. An unset endpoint means the control plane the agent is managed by.
#[test]
fn control_plane_lease_and_dlq_pair_with_a_durable_outbox() {
    for options in [
        "options: {}\n",
        "options:\n  endpoint: https://cp.example:50051\n",
    ] {
        let mut c = base();
        assert!(c.stores.outbox.as_ref().is_some_and(|o| o.is_durable()));
        c.stores.lease = Some(yaml(&format!("type: control_plane\n{options}")));
        c.stores.dlq = Some(yaml(&format!("type: control_plane\n{options}")));
        assert!(validate(&c).is_ok(), "{:?}", validate(&c).err());
    }
}

/// A shared outbox outlives any node, and every agent running the bridge drains it: a lease
/// kept in one node's file can neither be shared nor keep its versions when the node is
/// replaced. Shared leases (postgres, control_plane) pair with it.
#[test]
fn a_shared_outbox_needs_a_shared_lease() {
    let outbox = "type: postgres\noptions:\n  url: postgres://ferry@db/ferry\n";
    let errs = errors(|c| {
        c.stores.outbox = Some(yaml(outbox));
        c.stores.lease = Some(yaml(
            "type: sqlite\noptions:\n  path: /var/lib/ferry/lease.db\n",
        ));
    });
    assert_only(
        &errs,
        "stores.lease.type",
        "a sqlite lease cannot back a shared postgres outbox",
    );
    for lease in [
        "type: postgres\noptions:\n  dsn: postgres://ferry@db/ferry\n  schema: ferry\n",
        "type: control_plane\n",
    ] {
        let mut c = base();
        c.stores.outbox = Some(yaml(outbox));
        c.stores.lease = Some(yaml(lease));
        c.stores.dlq = Some(yaml(
            "type: postgres\noptions:\n  url: postgres://ferry@db/ferry\n",
        ));
        assert!(validate(&c).is_ok(), "{lease}: {:?}", validate(&c).err());
    }
}

#[test]
fn memory_outbox_needs_acknowledge_volatile() {
    let errs = errors(|c| {
        c.stores.outbox = Some(OutboxStoreConfig::Memory(MemoryOptions::default()));
        c.stores.lease = Some(LeaseStoreConfig::Memory(MemoryOptions::default()));
    });
    assert_only(
        &errs,
        "stores.outbox.options.acknowledge_volatile",
        "set acknowledge_volatile: true",
    );
    let mut c = base();
    c.stores.outbox = Some(OutboxStoreConfig::Memory(MemoryOptions {
        acknowledge_volatile: true,
    }));
    c.stores.lease = Some(LeaseStoreConfig::Memory(MemoryOptions::default()));
    assert!(validate(&c).is_ok(), "memory + memory, acknowledged");
}

#[test]
fn memory_dlq_needs_acknowledge_volatile() {
    assert_only(
        &errors(|c| c.stores.dlq = Some(DlqStoreConfig::Memory(MemoryOptions::default()))),
        "stores.dlq.options.acknowledge_volatile",
        "a memory dlq loses its entries on restart",
    );
}

#[test]
fn stale_claim_duration_exceeds_send_timeout() {
    let errs = errors(|c| {
        c.stores.outbox = Some(yaml(
            "type: sqlite\noptions:\n  path: /x\n  stale_claim_duration: 10s\n",
        ));
    });
    assert_only(
        &errs,
        "stores.outbox.options.stale_claim_duration",
        "must exceed routes[0].policy.send_timeout (30s)",
    );
}

#[test]
fn store_options_are_checked() {
    let errs = errors(|c| {
        c.stores.outbox = Some(OutboxStoreConfig::Postgres(PostgresOutboxOptions {
            url: "mysql://x".into(),
            schema: "bad schema".into(),
            stale_claim_duration: None,
        }));
        c.stores.lease = Some(yaml(
            "type: control_plane\noptions:\n  endpoint: grpc://cp\n",
        ));
        c.stores.dlq = Some(yaml("type: dynamodb\noptions:\n  table_name: ''\n"));
    });
    assert_error(&errs, "stores.outbox.options.url", "postgres://");
    assert_error(
        &errs,
        "stores.outbox.options.schema",
        "not a plain SQL identifier",
    );
    assert_error(
        &errs,
        "stores.lease.options.endpoint",
        "http:// or https://",
    );
    assert_error(&errs, "stores.dlq.options.table_name", "must not be empty");
}

#[test]
fn dynamodb_stores_need_valid_tables_of_their_own() {
    let errs = errors(|c| {
        c.stores.outbox = Some(yaml(
            "type: dynamodb\noptions:\n  table_name: 'no spaces'\n",
        ));
        c.stores.lease = Some(yaml("type: dynamodb\noptions:\n  table_name: ferry\n"));
        c.stores.dlq = Some(yaml("type: dynamodb\noptions:\n  table_name: ferry\n"));
    });
    assert_error(
        &errs,
        "stores.outbox.options.table_name",
        "not a DynamoDB table name",
    );
    assert_error(
        &errs,
        "stores.dlq.options.table_name",
        "the lease store uses the table \"ferry\" already",
    );
}

// ---- sessions, receivers, senders, bindings

#[test]
fn qos_is_0_to_2() {
    assert_only(
        &errors(|c| c.receivers[0].topics.as_mut().expect("topics")[0].qos = 3),
        "receivers[0].topics[0].qos",
        "qos must be 0, 1 or 2, got 3",
    );
    assert_only(
        &errors(|c| c.senders[0].options.sender.qos = Some(7)),
        "senders[0].options.sender.qos",
        "qos must be 0, 1 or 2, got 7",
    );
}

#[test]
fn broker_url_scheme_is_an_mqtt_one() {
    assert_only(
        &errors(|c| c.sessions[0].options.session.broker_url = Some("http://broker:1883".into())),
        "sessions[0].options.session.broker_url",
        "an MQTT broker URL is tcp://, mqtt://, ssl://, mqtts:// or unix://",
    );
}

#[test]
fn broker_url_host_and_port_parse() {
    assert_only(
        &errors(|c| c.sessions[0].options.session.broker_url = Some("tcp://broker:70000".into())),
        "sessions[0].options.session.broker_url",
        "invalid port",
    );
    assert_only(
        &errors(|c| c.sessions[0].options.session.broker_url = Some("tcp://:1883".into())),
        "sessions[0].options.session.broker_url",
        "no valid host",
    );
    for ok in [
        "mqtt://b",
        "ssl://b:8883",
        "mqtts://10.0.0.1",
        "mqtts://[::1]:8883",
        "unix:///run/mosquitto/mqtt.sock",
    ] {
        let mut c = base();
        c.sessions[0].options.session.broker_url = Some(ok.into());
        assert!(validate(&c).is_ok(), "{ok}");
    }
}

#[test]
fn a_unix_socket_url_needs_an_absolute_path_and_no_tls_files() {
    assert_only(
        &errors(|c| c.sessions[0].options.session.broker_url = Some("unix://mqtt.sock".into())),
        "sessions[0].options.session.broker_url",
        "needs the absolute path of the socket file",
    );
    let errs = errors(|c| {
        let s = &mut c.sessions[0].options.session;
        s.broker_url = Some("unix:///run/mqtt.sock".into());
        s.ca_file = Some("/ca.pem".into());
        s.client_cert_file = Some("/c.pem".into());
        s.client_key_file = Some("/c.key".into());
    });
    for key in ["ca_file", "client_cert_file", "client_key_file"] {
        assert_error(
            &errs,
            &format!("sessions[0].options.session.{key}"),
            "needs a TLS broker_url",
        );
    }
}

#[test]
fn credentials_on_a_unix_socket_stay_on_the_host() {
    let mut c = base();
    let s = &mut c.sessions[0].options.session;
    s.broker_url = Some("unix:///run/mqtt.sock".into());
    s.username = Some("u".into());
    s.password = Some("p".into());
    assert!(validate(&c).is_ok());
}

#[test]
fn mqtt_session_needs_broker_url_and_client_id() {
    let errs = errors(|c| {
        c.sessions[0].options.session.broker_url = None;
        c.sessions[0].options.session.client_id = None;
    });
    assert_error(
        &errs,
        "sessions[0].options.session.broker_url",
        "needs broker_url",
    );
    assert_error(
        &errs,
        "sessions[0].options.session.client_id",
        "needs client_id",
    );
}

#[test]
fn plaintext_credentials_need_opt_in() {
    let errs = errors(|c| {
        let s = &mut c.sessions[0].options.session;
        s.username = Some("u".into());
        s.password = Some("p".into());
    });
    assert_only(
        &errs,
        "sessions[0].options.session.password",
        "allow_plaintext_credentials: true",
    );
    let mut c = base();
    let s = &mut c.sessions[0].options.session;
    s.username = Some("u".into());
    s.password = Some("p".into());
    s.allow_plaintext_credentials = Some(true);
    assert!(validate(&c).is_ok());
    c.sessions[0].options.session.allow_plaintext_credentials = None;
    c.sessions[0].options.session.broker_url = Some("mqtts://b".into());
    assert!(validate(&c).is_ok());
}

#[test]
fn a_masked_password_is_refused() {
    let errs = errors(|c| {
        let s = &mut c.sessions[0].options.session;
        s.broker_url = Some("mqtts://b".into());
        s.username = Some("u".into());
        s.password = Some("***".into());
    });
    assert_only(
        &errs,
        "sessions[0].options.session.password",
        "is the mask `***`",
    );
}

#[test]
fn tls_files_need_a_tls_url_and_come_in_pairs() {
    let errs = errors(|c| {
        c.sessions[0].options.session.ca_file = Some("/ca.pem".into());
        c.sessions[0].options.session.client_cert_file = Some("/c.pem".into());
    });
    assert_error(
        &errs,
        "sessions[0].options.session.ca_file",
        "needs a TLS broker_url",
    );
    assert_error(
        &errs,
        "sessions[0].options.session.client_key_file",
        "needs client_key_file",
    );
}

#[test]
fn session_expiry_is_v5_only() {
    assert_only(
        &errors(|c| {
            let s = &mut c.sessions[0].options.session;
            s.protocol_version = Some(ProtocolVersion::V311);
            s.session_expiry = Some(Duration::from_secs(60));
        }),
        "sessions[0].options.session.session_expiry",
        "needs protocol_version v5",
    );
}

#[test]
fn keep_alive_is_at_least_one_second() {
    assert_only(
        &errors(|c| c.sessions[0].options.session.keep_alive = Some(0)),
        "sessions[0].options.session.keep_alive",
        "at least 1",
    );
}

#[test]
fn session_keys_belong_to_its_transport() {
    assert_only(
        &errors(|c| c.sessions[0].options.session.region = Some("eu-west-1".into())),
        "sessions[0].options.session.region",
        "region is an option of sqs or sns sessions, and this session's transport is mqtt",
    );
    let errs = errors(|c| {
        let mut s = sqs_session();
        s.options.session.client_id = Some("x".into());
        c.sessions.push(s);
    });
    assert_only(
        &errs,
        "sessions[1].options.session.client_id",
        "option of mqtt sessions",
    );
}

#[test]
fn sqs_session_limits() {
    let errs = errors(|c| {
        let mut s = sqs_session();
        s.options.session.wait_time = Some(Duration::from_secs(30));
        s.options.session.endpoint_url = Some("localhost:4566".into());
        c.sessions.push(s);
    });
    assert_error(
        &errs,
        "sessions[1].options.session.wait_time",
        "from 1s to 20s",
    );
    assert_error(
        &errs,
        "sessions[1].options.session.endpoint_url",
        "not a URL",
    );
}

#[test]
fn receiver_transport_matches_its_session() {
    let errs = errors(|c| c.receivers[0].queue = Some("q".into()));
    assert_only(&errs, "receivers[0].queue", "queue is for sqs receivers");
    let errs = errors(|c| {
        c.sessions.push(sqs_session());
        let mut r: Receiver =
            yaml("id: sqs-in\nsession_id: aws\ntrust_message_id: true\ntopics:\n  - topic: a\n");
        r.queue = None;
        c.receivers.push(r);
    });
    assert_error(
        &errs,
        "receivers[1].trust_message_id",
        "trust_message_id is for mqtt receivers",
    );
    assert_error(
        &errs,
        "receivers[1].topics",
        "topics are for mqtt receivers",
    );
    assert_error(&errs, "receivers[1].queue", "an sqs receiver needs queue");
}

#[test]
fn sender_transport_matches_its_session() {
    assert_only(
        &errors(|c| c.senders[0].options.sender.queue_name = Some("q".into())),
        "senders[0].options.sender.queue_name",
        "queue_name is an option of sqs senders",
    );
    let errs = errors(|c| {
        c.sessions.push(sqs_session());
        let mut s = sqs_sender("queue_name: q");
        s.options.sender.retain = Some(true);
        c.senders.push(s);
    });
    assert_only(
        &errs,
        "senders[1].options.sender.retain",
        "retain is an option of mqtt senders",
    );
    let errs = errors(|c| {
        c.sessions.push(sqs_session());
        c.senders.push(sqs_sender("{}"));
    });
    assert_only(
        &errs,
        "senders[1].options.sender",
        "needs queue_url or queue_name",
    );
}

fn sns_session() -> Session {
    yaml("id: sns\ntransport: sns\noptions:\n  session:\n    region: us-east-1\n")
}

/// Adds an SNS session, a sender with `options`, a binding to `address`, and points route 0
/// at it.
fn sns_binding(c: &mut BridgeConfig, options: &str, address: &str) {
    direct_hold(c);
    c.sessions.push(sns_session());
    c.senders.push(yaml(&format!(
        "id: sns-out\nsession_id: sns\noptions:\n  sender:\n    {options}\n"
    )));
    c.bindings.push(yaml(&format!(
        "id: to-sns\nsender_id: sns-out\naddress: {address}\n"
    )));
    c.routes[0].bindings = vec!["to-sns".into()];
}

#[test]
fn sns_senders_are_pinned_to_a_topic() {
    const ARN: &str = "arn:aws:sns:us-east-1:123456789012:alerts";
    for (options, address) in [
        ("topic_name: alerts", "alerts"),
        ("topic_name: alerts", ARN),
        (&format!("topic_arn: {ARN}") as &str, "alerts"),
        (&format!("topic_arn: {ARN}"), ARN),
    ] {
        let mut c = base();
        sns_binding(&mut c, options, address);
        assert!(
            validate(&c).is_ok(),
            "{options} / {address}: {:?}",
            validate(&c).err()
        );
    }
    let errs = errors(|c| sns_binding(c, "topic_name: alerts", "other"));
    assert_only(&errs, "bindings[3].address", "is not the topic of sender");
    let errs = errors(|c| sns_binding(c, "queue_name: alerts", "alerts"));
    assert_error(
        &errs,
        "senders[1].options.sender.queue_name",
        "queue_name is an option of sqs senders, and session \"sns\" is sns",
    );
    assert_error(
        &errs,
        "senders[1].options.sender",
        "needs topic_arn or topic_name",
    );
    let errs = errors(|c| {
        sns_binding(c, "topic_name: alerts", "alerts");
        c.sessions
            .last_mut()
            .expect("sns")
            .options
            .session
            .wait_time = Some(Duration::from_secs(5));
        c.receivers
            .push(yaml("id: sns-in\nsession_id: sns\nqueue: q\n"));
    });
    assert_error(
        &errs,
        "sessions[1].options.session.wait_time",
        "wait_time is an option of sqs sessions",
    );
    assert_error(&errs, "receivers[1].session_id", "only publishes");
}

#[test]
fn fifo_destinations_need_a_group_id() {
    let errs = errors(|c| sns_binding(c, "topic_name: alerts.fifo", "alerts.fifo"));
    assert_only(
        &errs,
        "senders[1].options.sender.message_group_id",
        "is FIFO: set message_group_id",
    );
    let mut c = base();
    sns_binding(
        &mut c,
        "topic_name: alerts.fifo\n    message_group_id: \"{header:device}\"",
        "alerts.fifo",
    );
    assert!(validate(&c).is_ok(), "{:?}", validate(&c).err());
    let errs = errors(|c| {
        sqs_binding(c, "queue_name: q\n    message_group_id: g", "q");
    });
    assert_only(
        &errs,
        "senders[1].options.sender.message_group_id",
        "is not FIFO",
    );
    let errs = errors(|c| {
        sqs_binding(
            c,
            "queue_name: q.fifo\n    message_group_id: g\n    delay_seconds: 5s",
            "q.fifo",
        );
    });
    assert_only(
        &errs,
        "senders[1].options.sender.delay_seconds",
        "a FIFO queue takes no per-message delay",
    );
    let errs = errors(|c| {
        sqs_binding(c, "queue_name: q\n    delay_seconds: 16m", "q");
        c.sessions
            .last_mut()
            .expect("sqs")
            .options
            .session
            .max_messages = Some(11);
    });
    assert_error(
        &errs,
        "senders[1].options.sender.delay_seconds",
        "from 0s to 15m",
    );
    assert_error(
        &errs,
        "sessions[1].options.session.max_messages",
        "from 1 to 10",
    );
}

#[test]
fn topic_filters_follow_mqtt_rules() {
    let errs = errors(|c| {
        let topics = c.receivers[0].topics.as_mut().expect("topics");
        topics[0].topic = "sensors/#/x".into();
        topics.push(yaml("topic: a+/b"));
        topics.push(yaml("topic: $share/group"));
    });
    assert_error(
        &errs,
        "receivers[0].topics[0].topic",
        "'#' must be a whole level and the last one",
    );
    assert_error(
        &errs,
        "receivers[0].topics[1].topic",
        "'+' must be a whole level",
    );
    assert_error(
        &errs,
        "receivers[0].topics[2].topic",
        "$share/{group}/{filter}",
    );
}

#[test]
fn receiver_needs_topics() {
    assert_only(
        &errors(|c| c.receivers[0].topics = Some(Vec::new())),
        "receivers[0].topics",
        "at least one topic",
    );
}

#[test]
fn mqtt_binding_address_has_no_wildcards() {
    assert_only(
        &errors(|c| c.bindings[0].address = "events/+".into()),
        "bindings[0].address",
        "contains a wildcard",
    );
    assert_only(
        &errors(|c| c.bindings[0].address = "events/#".into()),
        "bindings[0].address",
        "contains a wildcard",
    );
}

/// A topic an MQTT packet cannot carry (Mosquitto closes the connection on it) is refused
/// when the configuration is validated, not at every send.
#[test]
fn mqtt_topics_hold_only_what_an_mqtt_string_may() {
    assert_only(
        &errors(|c| c.bindings[0].address = "events\tall".into()),
        "bindings[0].address",
        "topic contains a control character (U+0009)",
    );
    assert_only(
        &errors(|c| c.bindings[0].address = "x".repeat(65_536)),
        "bindings[0].address",
        "topic is 65536 bytes, more than an MQTT string holds (65535)",
    );
    let mut unusual = base();
    unusual.bindings[0].address = "événements/€".into();
    assert!(
        validate(&unusual).is_ok(),
        "non-ASCII text is an MQTT string"
    );
}

/// Adds an SQS session, an SQS sender pinned by `queue`, a binding to `address`, and points
/// route 0 (made direct_hold) at it.
fn sqs_binding(c: &mut BridgeConfig, queue: &str, address: &str) {
    direct_hold(c);
    c.sessions.push(sqs_session());
    c.senders.push(sqs_sender(queue));
    c.bindings.push(yaml(&format!(
        "id: to-sqs\nsender_id: sqs-out\naddress: {address}\n"
    )));
    c.routes[0].bindings = vec!["to-sqs".into()];
}

#[test]
fn sqs_binding_address_is_the_sender_queue() {
    const URL: &str = "https://sqs.us-east-1.amazonaws.com/123456789012/sensor-events";
    for (queue, address) in [
        ("queue_name: sensor-events", "sensor-events"),
        ("queue_name: sensor-events", URL),
        (&format!("queue_url: {URL}") as &str, "sensor-events"),
        (&format!("queue_url: {URL}"), URL),
    ] {
        let mut c = base();
        sqs_binding(&mut c, queue, address);
        assert!(
            validate(&c).is_ok(),
            "{queue} / {address}: {:?}",
            validate(&c).err()
        );
    }
    let errs = errors(|c| sqs_binding(c, "queue_name: sensor-events", "other-queue"));
    assert_only(
        &errs,
        "bindings[3].address",
        "\"other-queue\" is not the queue of sender \"sqs-out\" (queue_name \"sensor-events\")",
    );
    let errs = errors(|c| {
        sqs_binding(
            c,
            &format!("queue_url: {URL}"),
            "https://sqs.us-east-1.amazonaws.com/999999999999/sensor-events",
        )
    });
    assert_only(
        &errs,
        "bindings[3].address",
        "is not the queue of sender \"sqs-out\"",
    );
}

#[test]
fn telemetry_is_checked() {
    let errs = errors(|c| {
        c.telemetry.otlp_endpoint = Some("otel:4317".into());
        c.telemetry.sampling_ratio = 1.5;
        c.telemetry
            .resource_attributes
            .insert(" ".into(), "x".into());
    });
    assert_error(&errs, "telemetry.otlp_endpoint", "not a URL");
    assert_error(&errs, "telemetry.sampling_ratio", "between 0.0 and 1.0");
    assert_error(&errs, "telemetry.resource_attributes", "must not be empty");
}

#[test]
fn valid_config_resolves_lookups() {
    let valid = validate(&base()).expect("valid");
    let route = valid.route("sensor-ingest").expect("route");
    assert_eq!(
        valid.partition(route),
        "durable-sensor-ingest/sensor-ingest"
    );
    let ids: Vec<&str> = valid
        .route_bindings(route)
        .map(|b| b.address.as_str())
        .collect();
    assert_eq!(
        ids,
        ["events/sensors", "audit/sensors", "analytics/sensors"]
    );
    let mqtt = valid
        .session("mqtt-conn")
        .and_then(Session::mqtt)
        .expect("mqtt");
    assert_eq!(mqtt.keep_alive, std::time::Duration::from_secs(30));
    assert_eq!(mqtt.protocol_version, ProtocolVersion::V5);
    assert!(!mqtt.clean_start);
    assert_eq!(valid.stale_claim_duration(), Some(Duration::from_secs(300)));
    assert!(valid.receiver("mqtt-in").is_some() && valid.sender("mqtt-out").is_some());
}

fn rabbitmq_session(extra: &str) -> Session {
    yaml(&format!(
        "id: rmq\ntransport: rabbitmq\noptions:\n  session:\n    url: amqp://localhost:5672/%2f\n{extra}"
    ))
}

fn nats_session(extra: &str) -> Session {
    yaml(&format!(
        "id: js\ntransport: nats\noptions:\n  session:\n    url: nats://localhost:4222\n{extra}"
    ))
}

/// Adds sender `out` on session `session` and binding `b` to `address` on it.
fn bind(c: &mut BridgeConfig, session: Session, address: &str) {
    let id = session.id.clone();
    c.sessions.push(session);
    c.senders
        .push(yaml(&format!("id: out\nsession_id: {id}\n")));
    c.bindings.push(yaml(&format!(
        "id: b\nsender_id: out\naddress: \"{address}\"\n"
    )));
}

#[test]
fn rabbitmq_and_nats_sessions_are_valid_with_a_url() {
    let mut c = base();
    bind(&mut c, rabbitmq_session(""), "orders/created.{header:site}");
    let mut n = nats_session("    token: t\n    allow_plaintext_credentials: true\n");
    n.id = "js".into();
    c.sessions.push(n);
    c.senders.push(yaml("id: js-out\nsession_id: js\n"));
    c.bindings.push(yaml(
        "id: js-b\nsender_id: js-out\naddress: \"orders.{header:aggregate_id}\"\n",
    ));
    validate(&c).expect("valid");
}

#[test]
fn rabbitmq_and_nats_sessions_need_a_url_of_their_scheme() {
    let errs = errors(|c| {
        let mut s = rabbitmq_session("");
        s.options.session.url = None;
        c.sessions.push(s);
    });
    assert_only(&errs, "sessions[1].options.session.url", "needs url");
    let errs = errors(|c| {
        let mut s = nats_session("");
        s.options.session.url = Some("amqp://localhost".into());
        c.sessions.push(s);
    });
    assert_only(
        &errs,
        "sessions[1].options.session.url",
        "nats:// or tls://",
    );
    let errs = errors(|c| c.sessions.push(rabbitmq_session("    client_id: x\n")));
    assert_only(
        &errs,
        "sessions[1].options.session.client_id",
        "option of mqtt sessions",
    );
    let errs = errors(|c| c.sessions[0].options.session.token = Some("t".into()));
    assert_only(
        &errs,
        "sessions[0].options.session.token",
        "token is an option of nats sessions",
    );
}

#[test]
fn broker_credentials_need_tls_or_an_explicit_allowance() {
    let errs = errors(|c| {
        c.sessions
            .push(rabbitmq_session("    username: u\n    password: p\n"));
    });
    assert_only(
        &errs,
        "sessions[1].options.session.password",
        "use an amqps:// url",
    );
    let errs = errors(|c| {
        let mut s = rabbitmq_session("    username: u\n    password: p\n");
        s.options.session.url = Some("amqps://broker:5671/%2f".into());
        s.options.session.client_cert_file = Some("c.pem".into());
        c.sessions.push(s);
    });
    assert_only(
        &errs,
        "sessions[1].options.session.client_cert_file",
        "option of mqtt or nats sessions",
    );
    let errs = errors(|c| {
        c.sessions.push(nats_session(
            "    token: t\n    credentials_file: a.creds\n    allow_plaintext_credentials: true\n",
        ))
    });
    assert_only(&errs, "sessions[1].options.session", "set one of");
}

#[test]
fn rabbitmq_and_nats_sessions_only_send() {
    let errs = errors(|c| {
        c.sessions.push(nats_session(""));
        c.receivers
            .push(yaml("id: js-in\nsession_id: js\ntopics:\n  - topic: a\n"));
    });
    assert_error(&errs, "receivers[1].session_id", "only sends to nats");
    assert_only(
        &errors(|c| c.senders[0].options.sender.mandatory = Some(false)),
        "senders[0].options.sender.mandatory",
        "mandatory is an option of rabbitmq senders",
    );
}

#[test]
fn binding_addresses_have_their_transport_shape() {
    let errs = errors(|c| bind(c, rabbitmq_session(""), "bad exchange/key"));
    assert_only(&errs, "bindings[3].address", "exchange \"bad exchange\"");
    let errs = errors(|c| bind(c, nats_session(""), "orders.*"));
    assert_only(&errs, "bindings[3].address", "wildcard");
    let errs = errors(|c| bind(c, nats_session(""), "orders..x"));
    assert_only(&errs, "bindings[3].address", "empty token");
}

#[test]
fn address_templates_are_checked_when_validated() {
    let errs = errors(|c| c.bindings[0].address = "events/{site}".into());
    assert_only(&errs, "bindings[0].address", "unknown placeholder {site}");
    let errs = errors(|c| c.bindings[0].address = "events/{header:site".into());
    assert_only(&errs, "bindings[0].address", "without its '}'");
    let errs = errors(|c| c.bindings[0].address = "events/#/{header:site}".into());
    assert_only(&errs, "bindings[0].address", "wildcard");
    let mut c = base();
    c.bindings[0].address = "events/{header:site}/{{literal}}".into();
    validate(&c).expect("a template with escaped braces is valid");
    let errs = errors(|c| {
        c.sessions.push(sqs_session());
        c.senders.push(sqs_sender("queue_name: q"));
        c.bindings.push(yaml(
            "id: b\nsender_id: sqs-out\naddress: \"q{header:x}\"\n",
        ));
    });
    assert_only(&errs, "bindings[3].address", "cannot name headers");
}

fn table_session() -> Session {
    yaml(
        "id: pg\ntransport: postgres_table\noptions:\n  session:\n    url: postgres://db:5432/app\n",
    )
}

#[test]
fn an_outbox_table_receiver_needs_a_table() {
    let valid = |c: &mut BridgeConfig| {
        c.sessions.push(table_session());
        c.receivers.push(yaml(
            "id: rows\nsession_id: pg\ntable: public.outbox_events\n",
        ));
    };
    let mut c = base();
    valid(&mut c);
    // The route still reads from the MQTT receiver; the table receiver alone is valid.
    assert!(
        validate(&c)
            .err()
            .unwrap_or_default()
            .iter()
            .all(|e| !e.path.starts_with("receivers[1]") && !e.path.starts_with("sessions[1]")),
    );
    let errs = errors(|c| {
        c.sessions.push(table_session());
        c.receivers.push(yaml(
            "id: rows\nsession_id: pg\ntable: \"outbox; drop table x\"\ntopics:\n  - topic: a\n",
        ));
    });
    assert_error(&errs, "receivers[1].table", "is not a table name");
    assert_error(
        &errs,
        "receivers[1].topics",
        "not an option of postgres_table receivers",
    );
    let errs = errors(|c| c.receivers[0].table = Some("t".into()));
    assert_only(
        &errs,
        "receivers[0].table",
        "table is for postgres_table and mysql_table receivers",
    );
}

#[test]
fn outbox_table_columns_urls_and_retry_options_are_checked() {
    let mysql = || -> Session {
        yaml("id: my\ntransport: mysql_table\noptions:\n  session:\n    url: mysql://db:3306/app\n")
    };
    let errs = errors(|c| {
        c.sessions.push(mysql());
        c.receivers.push(yaml(
            "id: rows\nsession_id: my\ntable: outbox\ncolumns:\n  id: event_id\n  payload: \"body;\"\n  event: event_id\nretry_backoff: 10s\nretry_backoff_max: 1s\nnotify_channel: wake\nclaim_ttl: 0s\n",
        ));
    });
    assert_error(
        &errs,
        "receivers[1].columns.payload",
        "is not a column name",
    );
    assert_error(&errs, "receivers[1].columns.event", "named twice");
    assert_error(
        &errs,
        "receivers[1].retry_backoff_max",
        "shorter than retry_backoff",
    );
    assert_error(
        &errs,
        "receivers[1].notify_channel",
        "for postgres_table receivers",
    );
    assert_error(&errs, "receivers[1].claim_ttl", "greater than zero");
    // A plain connection refuses credentials; TLS is the URL's one query option.
    let errs = errors(|c| {
        let mut s = mysql();
        s.options.session.url = Some("postgres://db:5432/app".into());
        s.options.session.username = Some("relay".into());
        c.sessions.push(s);
    });
    assert_error(
        &errs,
        "sessions[1].options.session.url",
        "a mysql_table url is mysql://",
    );
    let errs = errors(|c| {
        let mut s = table_session();
        s.options.session.username = Some("relay".into());
        c.sessions.push(s);
    });
    assert_only(
        &errs,
        "sessions[1].options.session.username",
        "?sslmode=require",
    );
    let mut c = base();
    let mut tls = table_session();
    tls.options.session.url = Some("postgres://db:5432/app?sslmode=require".into());
    tls.options.session.username = Some("relay".into());
    c.sessions.push(tls);
    c.receivers.push(yaml(
        "id: rows\nsession_id: pg\ntable: outbox\nnotify_channel: ferry_outbox\n",
    ));
    let errs = validate(&c).err().unwrap_or_default();
    assert!(
        errs.iter()
            .all(|e| !e.path.starts_with("receivers[1]") && !e.path.starts_with("sessions[1]")),
        "{errs:?}"
    );
    let errs = errors(|c| {
        let mut s = table_session();
        s.options.session.url = Some("postgres://db:5432/app?sslmode=verify-full".into());
        c.sessions.push(s);
    });
    assert_only(
        &errs,
        "sessions[1].options.session.url",
        "not a query option",
    );
}

/// Seed 002's `outbox_events`: a uuid id, the event as the body, a status column, no
/// aggregate columns, ordered by `created_at`.
const SEED_002_RECEIVER: &str = "id: rows\nsession_id: pg\ntable: outbox_events\norder_by: created_at\ncolumns:\n  payload: event\n  event: null\n  aggregate_type: ~\n  aggregate_id: null\n  status: status\n";

#[test]
fn a_status_column_replaces_sent_at() {
    let mut c = base();
    c.sessions.push(table_session());
    c.receivers.push(yaml(SEED_002_RECEIVER));
    let errs = validate(&c).err().unwrap_or_default();
    assert!(
        errs.iter().all(|e| !e.path.starts_with("receivers[1]")),
        "{errs:?}"
    );
    let columns = c.receivers[1].columns.clone().unwrap_or_default();
    assert_eq!(columns.aggregate_id(), None, "null: the table has none");
    assert_eq!(columns.state(), StateColumn::Status("status"));
    assert_eq!(columns.created_at(OrderBy::CreatedAt), Some("created_at"));
    let receiver = |extra: &str| -> Receiver { yaml(&format!("{SEED_002_RECEIVER}{extra}")) };
    let errs = errors(|c| {
        c.sessions.push(table_session());
        c.receivers.push(receiver(
            "  sent_at: done_at\npending_status: new\nsent_status: new\nretention: 1d\n",
        ));
    });
    assert_error(
        &errs,
        "receivers[1].columns.status",
        "one of columns.sent_at and columns.status",
    );
    assert_error(
        &errs,
        "receivers[1].sent_status",
        "must differ from pending_status",
    );
    assert_error(
        &errs,
        "receivers[1].retention",
        "retention needs a sent_at column",
    );
    let errs = errors(|c| {
        c.sessions.push(table_session());
        c.receivers.push(receiver("pending_status: \"x'; --\"\n"));
    });
    assert_only(
        &errs,
        "receivers[1].pending_status",
        "is not a status value",
    );
    let errs = errors(|c| {
        c.sessions.push(table_session());
        c.receivers.push(yaml(
            "id: rows\nsession_id: pg\ntable: outbox\nsent_status: done\ncolumns:\n  payload: event\n",
        ));
    });
    assert_error(
        &errs,
        "receivers[1].sent_status",
        "for tables with columns.status",
    );
    // The default `event` column is the payload too: say how to drop it.
    assert_error(
        &errs,
        "receivers[1].columns.payload",
        "named twice, as event and payload",
    );
    assert!(
        errs.iter().any(|e| e
            .message
            .contains("to null if the table has no such column")),
        "{errs:?}"
    );
}

#[test]
fn an_outbox_table_ca_file_needs_tls() {
    for (transport, plain, tls, fix) in [
        (
            "postgres_table",
            "postgres://db:5432/app",
            "postgres://db:5432/app?sslmode=require",
            "?sslmode=require",
        ),
        (
            "mysql_table",
            "mysql://db:3306/app",
            "mysql://db:3306/app?require_ssl=true",
            "?require_ssl=true",
        ),
    ] {
        let session = |url: &str| -> Session {
            yaml(&format!(
                "id: db\ntransport: {transport}\noptions:\n  session:\n    url: {url}\n    ca_file: /etc/ferry/db-ca.pem\n"
            ))
        };
        let errs = errors(|c| c.sessions.push(session(plain)));
        assert_only(
            &errs,
            "sessions[1].options.session.ca_file",
            &format!("ca_file needs {fix}"),
        );
        let mut c = base();
        c.sessions.push(session(tls));
        let errs = validate(&c).err().unwrap_or_default();
        assert!(
            errs.iter().all(|e| !e.path.starts_with("sessions[1]")),
            "{errs:?}"
        );
    }
}

#[test]
fn an_outbox_table_session_is_received_from_only() {
    let errs = errors(|c| {
        c.sessions.push(table_session());
        c.senders.push(yaml("id: pg-out\nsession_id: pg\n"));
    });
    assert_only(&errs, "senders[1].session_id", "only receives from");
    let errs = errors(|c| {
        let mut s = table_session();
        s.options.session.url = Some("postgres://db:5432".into());
        c.sessions.push(s);
    });
    assert_only(
        &errs,
        "sessions[1].options.session.url",
        "names no database",
    );
}
