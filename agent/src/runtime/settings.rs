//! Configuration → transport settings and stores.

use ferry_shared::auth::client::ClientAuth;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ferry_shared::config::secret::mask_url;
use ferry_shared::config::store::{
    ControlPlaneOptions, DynamoDbOptions as DynamoDbConfig, DynamoDbOutboxOptions,
    PostgresOptions as PostgresConfig, PostgresOutboxOptions, SqliteOptions as SqliteConfig,
    SqliteOutboxOptions, SqliteSynchronous,
};
use ferry_shared::config::{
    DlqStoreConfig, LeaseStoreConfig, OutboxStoreConfig, ProtocolVersion, Receiver, Route, Session,
    Transport,
};

use super::BuildError;
use crate::stores::control_plane::{ControlPlaneDlqStore, ControlPlaneLeaseStore};
use crate::stores::dynamodb::{
    DynamoDbDlqStore, DynamoDbLeaseStore, DynamoDbOptions, DynamoDbOutboxStore,
};
use crate::stores::memory::{MemoryDlqStore, MemoryLeaseStore, MemoryOutboxStore};
use crate::stores::postgres::{
    PostgresDlqStore, PostgresLeaseStore, PostgresOptions, PostgresOutboxStore,
};
use crate::stores::sqlite::{
    SqliteDlqStore, SqliteLeaseStore, SqliteOptions, SqliteOutboxStore, Synchronous,
};
use crate::stores::{DlqStore, LeaseStore, OutboxStore};
use crate::transports::aws::{
    AwsSenderSettings, AwsSessionSettings, AwsTarget, Service, SqsReceiverSettings,
};
use crate::transports::mqtt::{
    MQTT_MAX_PACKET_BYTES, MqttReceiverSettings, MqttSessionSettings, Protocol, Qos,
};
use crate::transports::nats::{NatsAuth, NatsSettings};
use crate::transports::outbox_table::{Columns, Database, TableSettings};
use crate::transports::rabbitmq::RabbitmqSettings;

/// The default largest MQTT packet; raised for routes that accept larger
/// payloads.
const DEFAULT_MAX_PACKET: u32 = 1024 * 1024;
/// Room for the topic and properties on top of the largest payload.
const PACKET_OVERHEAD: u32 = 64 * 1024;

/// An MQTT QoS from its number (the validator allows 0–2).
pub(super) fn qos(n: u8) -> Qos {
    match n {
        0 => Qos::AtMostOnce,
        2 => Qos::ExactlyOnce,
        _ => Qos::AtLeastOnce,
    }
}

fn not_this_transport(session: &Session) -> BuildError {
    BuildError::Unsupported(format!(
        "session {}: its {} options are incomplete",
        session.id, session.transport
    ))
}

/// A RabbitMQ session's settings.
pub(super) fn rabbitmq_session(session: &Session) -> Result<RabbitmqSettings, BuildError> {
    let r = session
        .rabbitmq()
        .ok_or_else(|| not_this_transport(session))?;
    let mut s = RabbitmqSettings::new(session.id.clone(), r.url);
    s.username = r.username;
    s.password = r.password;
    s.ca_file = r.ca_file.map(PathBuf::from);
    Ok(s)
}

/// An outbox-table receiver's settings: its session's connection and its own options, with
/// the documented defaults.
pub(super) fn outbox_table(
    session: &Session,
    receiver: &Receiver,
) -> Result<TableSettings, BuildError> {
    let p = session.table().ok_or_else(|| not_this_transport(session))?;
    let table = receiver
        .table
        .clone()
        .ok_or_else(|| BuildError::Unsupported(format!("receiver {}: no table", receiver.id)))?;
    let database = match p.transport {
        Transport::MysqlTable => Database::Mysql,
        _ => Database::Postgres,
    };
    let columns = Columns::new(
        &receiver.columns.clone().unwrap_or_default(),
        receiver.order_by.unwrap_or_default(),
        receiver.pending_status.as_deref(),
        receiver.sent_status.as_deref(),
    );
    let get = |d: Option<ferry_shared::config::Duration>, default: Duration| {
        d.map_or(default, |d| d.get())
    };
    Ok(TableSettings {
        name: session.id.clone(),
        database,
        url: p.url,
        username: p.username,
        password: p.password,
        ca_file: p.ca_file.map(PathBuf::from),
        table,
        columns,
        poll_interval: get(receiver.poll_interval, Duration::from_secs(1)),
        batch_size: receiver.batch_size.unwrap_or(DEFAULT_BATCH_SIZE),
        claim_ttl: get(receiver.claim_ttl, Duration::from_secs(30)),
        max_retries: receiver.max_retries.unwrap_or(DEFAULT_MAX_RETRIES),
        retry_backoff: get(receiver.retry_backoff, Duration::from_secs(1)),
        retry_backoff_max: get(receiver.retry_backoff_max, Duration::from_secs(600)),
        on_sent: receiver.on_sent.unwrap_or_default(),
        retention: receiver.retention.map(|d| d.get()),
        notify_channel: receiver.notify_channel.clone(),
    })
}

const DEFAULT_BATCH_SIZE: u32 = 100;
const DEFAULT_MAX_RETRIES: u32 = 10;

/// A NATS session's settings.
pub(super) fn nats_session(session: &Session) -> Result<NatsSettings, BuildError> {
    let n = session.nats().ok_or_else(|| not_this_transport(session))?;
    let auth = match (n.credentials_file, n.token, n.username, n.password) {
        (Some(file), ..) => NatsAuth::CredentialsFile(PathBuf::from(file)),
        (None, Some(token), ..) => NatsAuth::Token(token),
        (None, None, Some(user), Some(password)) => NatsAuth::UserPassword(user, password),
        _ => NatsAuth::None,
    };
    Ok(NatsSettings {
        name: session.id.clone(),
        url: n.url,
        auth,
        ca_file: n.ca_file.map(PathBuf::from),
        client_cert: n
            .client_cert_file
            .zip(n.client_key_file)
            .map(|(c, k)| (PathBuf::from(c), PathBuf::from(k))),
    })
}

/// The session's settings; `route` is the route its receiver feeds, if any.
pub(super) fn mqtt_session(
    session: &Session,
    route: Option<&Route>,
) -> Result<MqttSessionSettings, BuildError> {
    let m = session.mqtt().ok_or_else(|| {
        BuildError::Unsupported(format!(
            "session {}: transport {} is not supported by this agent yet",
            session.id, session.transport
        ))
    })?;
    if m.client_cert_file.is_some() || m.client_key_file.is_some() {
        return Err(BuildError::Unsupported(format!(
            "session {}: client certificates (mutual TLS) are not supported yet",
            session.id
        )));
    }
    let mut s = MqttSessionSettings::new(session.id.clone(), m.broker_url, m.client_id);
    s.keep_alive = m.keep_alive.max(Duration::from_secs(5));
    s.username = m.username;
    s.password = m.password;
    s.allow_plaintext_credentials = session
        .options
        .session
        .allow_plaintext_credentials
        .unwrap_or(false);
    s.protocol = match m.protocol_version {
        ProtocolVersion::V5 => Protocol::V5,
        ProtocolVersion::V311 => Protocol::V311,
    };
    s.clean_start = m.clean_start;
    s.session_expiry = m.session_expiry.get();
    s.ca_file = m.ca_file.map(PathBuf::from);
    if let Some(route) = route {
        let payload = route.policy.max_payload_bytes;
        s.max_packet_bytes = DEFAULT_MAX_PACKET
            .max(payload.saturating_add(PACKET_OVERHEAD))
            .min(MQTT_MAX_PACKET_BYTES);
    }
    Ok(s)
}

/// A receiver's settings: its topic filters, the route's in-flight window
/// and payload limit.
pub(super) fn mqtt_receiver(
    receiver: &ferry_shared::config::Receiver,
    route: &Route,
) -> MqttReceiverSettings {
    let filters = receiver
        .topics
        .iter()
        .flatten()
        .map(|t| (t.topic.clone(), qos(t.qos)))
        .collect();
    let mut r = MqttReceiverSettings::new(filters);
    r.max_in_flight = u16::try_from(route.policy.max_in_flight).unwrap_or(u16::MAX);
    r.max_payload_bytes = route.policy.max_payload_bytes as usize;
    r.trust_message_id = receiver.trust_message_id;
    r
}

/// An `sqs` or `sns` session's settings.
pub(super) fn aws_session(session: &Session) -> Result<AwsSessionSettings, BuildError> {
    let service = match session.transport {
        Transport::Sqs => Service::Sqs,
        Transport::Sns => Service::Sns,
        Transport::Mqtt
        | Transport::Rabbitmq
        | Transport::Nats
        | Transport::PostgresTable
        | Transport::MysqlTable => {
            return Err(BuildError::Session(format!(
                "session {}: not an AWS session",
                session.id
            )));
        }
    };
    let s = &session.options.session;
    Ok(AwsSessionSettings {
        id: session.id.clone(),
        service,
        region: s.region.clone(),
        endpoint_url: s.endpoint_url.clone(),
    })
}

/// An SQS receiver's settings: its queue, the session's polling options and
/// the route's payload limit.
pub(super) fn sqs_receiver(
    session: &Session,
    receiver: &ferry_shared::config::Receiver,
    route: &Route,
) -> Result<SqsReceiverSettings, BuildError> {
    let (Some(s), Some(queue)) = (session.sqs(), receiver.queue.clone()) else {
        return Err(BuildError::Session(format!(
            "receiver {}: an sqs receiver needs an sqs session and a queue",
            receiver.id
        )));
    };
    if session.transport != Transport::Sqs {
        return Err(BuildError::Session(format!(
            "receiver {}: session {} is {}, which only publishes",
            receiver.id, session.id, session.transport
        )));
    }
    Ok(SqsReceiverSettings {
        queue,
        wait_time: s.wait_time.get(),
        visibility_timeout: s.visibility_timeout.map(|d| d.get()),
        max_messages: s.max_messages,
        max_payload_bytes: route.policy.max_payload_bytes as usize,
        max_receives: route.policy.max_replay_attempts.saturating_add(1),
    })
}

/// An `sqs` or `sns` sender's settings (the validator made sure its queue
/// or topic is set).
pub(super) fn aws_sender(
    sender: &ferry_shared::config::Sender,
    send_timeout: Duration,
) -> AwsSenderSettings {
    let s = &sender.options.sender;
    let target = match s.topic_arn.as_ref().or(s.topic_name.as_ref()) {
        Some(topic) => AwsTarget::Topic(topic.clone()),
        None => AwsTarget::Queue {
            queue: s
                .queue_url
                .as_ref()
                .or(s.queue_name.as_ref())
                .cloned()
                .unwrap_or_default(),
            delay: s.delay_seconds.map(|d| d.get()),
        },
    };
    AwsSenderSettings {
        target,
        group_id: s.group_id(),
        send_timeout,
    }
}

fn sync(s: SqliteSynchronous) -> Synchronous {
    match s {
        SqliteSynchronous::Full => Synchronous::Full,
        SqliteSynchronous::Normal => Synchronous::Normal,
    }
}

fn sqlite(o: &SqliteConfig) -> SqliteOptions {
    let mut options = SqliteOptions::new(&o.path);
    options.synchronous = sync(o.synchronous);
    options.busy_timeout = o.busy_timeout.get();
    options.max_size_bytes = o.max_size_bytes;
    options
}

fn sqlite_outbox(o: &SqliteOutboxOptions, stale: Duration) -> SqliteOptions {
    let mut options = SqliteOptions::new(&o.path);
    options.synchronous = sync(o.synchronous);
    options.busy_timeout = o.busy_timeout.get();
    options.stale_claim_duration = stale;
    options.max_size_bytes = o.max_size_bytes;
    options
}

fn postgres(url: &str, schema: &str) -> PostgresOptions {
    PostgresOptions {
        schema: Some(schema.to_owned()),
        ..PostgresOptions::new(url)
    }
}

fn postgres_store(o: &PostgresConfig) -> PostgresOptions {
    postgres(o.url.expose(), &o.schema)
}

fn postgres_outbox(o: &PostgresOutboxOptions, stale: Duration) -> PostgresOptions {
    PostgresOptions {
        stale_claim_duration: stale,
        ..postgres(o.url.expose(), &o.schema)
    }
}

/// A `control_plane` store's options with its endpoint defaulted to the
/// control plane the agent is managed by.
fn endpoint(o: &ControlPlaneOptions, managed_by: Option<&str>) -> ControlPlaneOptions {
    ControlPlaneOptions {
        endpoint: o.endpoint.clone().or_else(|| managed_by.map(str::to_owned)),
    }
}

fn dynamodb(
    table_name: &str,
    region: &Option<String>,
    endpoint_url: &Option<String>,
    create_tables: bool,
) -> DynamoDbOptions {
    DynamoDbOptions {
        region: region.clone(),
        endpoint_url: endpoint_url.clone(),
        create_tables,
        ..DynamoDbOptions::new(table_name)
    }
}

fn dynamodb_store(o: &DynamoDbConfig) -> DynamoDbOptions {
    dynamodb(&o.table_name, &o.region, &o.endpoint_url, o.create_tables)
}

fn dynamodb_outbox(o: &DynamoDbOutboxOptions, stale: Duration) -> DynamoDbOptions {
    DynamoDbOptions {
        stale_claim_duration: stale,
        ..dynamodb(&o.table_name, &o.region, &o.endpoint_url, o.create_tables)
    }
}

/// What a store's open failure names: a DynamoDB table.
fn table(name: &str) -> String {
    format!("dynamodb table {name}")
}

fn open_failed(store: &str, path: &str, e: impl std::fmt::Display) -> BuildError {
    BuildError::Store(format!("stores.{store}: cannot open {path}: {e}"))
}

/// Opens the outbox.
pub(super) async fn outbox(
    c: &OutboxStoreConfig,
    stale: Duration,
) -> Result<Arc<dyn OutboxStore>, BuildError> {
    match c {
        OutboxStoreConfig::Memory(_) => Ok(Arc::new(MemoryOutboxStore::new(stale))),
        OutboxStoreConfig::Sqlite(o) => SqliteOutboxStore::open(sqlite_outbox(o, stale))
            .await
            .map(|s| Arc::new(s) as Arc<dyn OutboxStore>)
            .map_err(|e| open_failed("outbox", &o.path, e)),
        OutboxStoreConfig::Postgres(o) => PostgresOutboxStore::open(postgres_outbox(o, stale))
            .await
            .map(|s| Arc::new(s) as Arc<dyn OutboxStore>)
            .map_err(|e| open_failed("outbox", &mask_url(o.url.expose()), e)),
        OutboxStoreConfig::Dynamodb(o) => DynamoDbOutboxStore::open(dynamodb_outbox(o, stale))
            .await
            .map(|s| Arc::new(s) as Arc<dyn OutboxStore>)
            .map_err(|e| open_failed("outbox", &table(&o.table_name), e)),
    }
}

/// Opens the lease store; `managed_by` is the endpoint of a `control_plane`
/// store that names none, `client` the credentials it presents.
pub(super) async fn lease(
    c: &LeaseStoreConfig,
    managed_by: Option<&str>,
    client: &ClientAuth,
) -> Result<Arc<dyn LeaseStore>, BuildError> {
    match c {
        LeaseStoreConfig::Memory(_) => Ok(Arc::new(MemoryLeaseStore::new())),
        LeaseStoreConfig::Sqlite(o) => SqliteLeaseStore::open(sqlite(o))
            .await
            .map(|s| Arc::new(s) as Arc<dyn LeaseStore>)
            .map_err(|e| open_failed("lease", &o.path, e)),
        LeaseStoreConfig::Postgres(o) => PostgresLeaseStore::open(postgres_store(o))
            .await
            .map(|s| Arc::new(s) as Arc<dyn LeaseStore>)
            .map_err(|e| open_failed("lease", &mask_url(o.url.expose()), e)),
        LeaseStoreConfig::ControlPlane(o) => {
            ControlPlaneLeaseStore::open(&endpoint(o, managed_by), client)
                .map(|s| Arc::new(s) as Arc<dyn LeaseStore>)
                .map_err(|e| BuildError::Store(e.to_string()))
        }
        LeaseStoreConfig::Dynamodb(o) => DynamoDbLeaseStore::open(dynamodb_store(o))
            .await
            .map(|s| Arc::new(s) as Arc<dyn LeaseStore>)
            .map_err(|e| open_failed("lease", &table(&o.table_name), e)),
    }
}

/// Opens the DLQ; `managed_by` as for [`lease`].
pub(super) async fn dlq(
    c: &DlqStoreConfig,
    managed_by: Option<&str>,
    client: &ClientAuth,
) -> Result<Arc<dyn DlqStore>, BuildError> {
    match c {
        DlqStoreConfig::Memory(_) => Ok(Arc::new(MemoryDlqStore::new())),
        DlqStoreConfig::Sqlite(o) => SqliteDlqStore::open(sqlite(o))
            .await
            .map(|s| Arc::new(s) as Arc<dyn DlqStore>)
            .map_err(|e| open_failed("dlq", &o.path, e)),
        DlqStoreConfig::Postgres(o) => PostgresDlqStore::open(postgres_store(o))
            .await
            .map(|s| Arc::new(s) as Arc<dyn DlqStore>)
            .map_err(|e| open_failed("dlq", &mask_url(o.url.expose()), e)),
        DlqStoreConfig::ControlPlane(o) => {
            ControlPlaneDlqStore::open(&endpoint(o, managed_by), client)
                .map(|s| Arc::new(s) as Arc<dyn DlqStore>)
                .map_err(|e| BuildError::Store(e.to_string()))
        }
        DlqStoreConfig::Dynamodb(o) => DynamoDbDlqStore::open(dynamodb_store(o))
            .await
            .map(|s| Arc::new(s) as Arc<dyn DlqStore>)
            .map_err(|e| open_failed("dlq", &table(&o.table_name), e)),
    }
}
