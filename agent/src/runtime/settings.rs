//! Configuration → transport settings and stores.

use ferry_shared::auth::client::ClientAuth;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ferry_shared::config::secret::mask_url;
use ferry_shared::config::store::{
    ControlPlaneOptions, PostgresOptions as PostgresConfig, PostgresOutboxOptions,
    SqliteOptions as SqliteConfig, SqliteOutboxOptions, SqliteSynchronous,
};
use ferry_shared::config::{
    DlqStoreConfig, LeaseStoreConfig, OutboxStoreConfig, ProtocolVersion, Route, Session,
};

use super::BuildError;
use crate::stores::control_plane::{ControlPlaneDlqStore, ControlPlaneLeaseStore};
use crate::stores::memory::{MemoryDlqStore, MemoryLeaseStore, MemoryOutboxStore};
use crate::stores::postgres::{
    PostgresDlqStore, PostgresLeaseStore, PostgresOptions, PostgresOutboxStore,
};
use crate::stores::sqlite::{
    SqliteDlqStore, SqliteLeaseStore, SqliteOptions, SqliteOutboxStore, Synchronous,
};
use crate::stores::{DlqStore, LeaseStore, OutboxStore};
use crate::transports::mqtt::{
    MQTT_MAX_PACKET_BYTES, MqttReceiverSettings, MqttSessionSettings, Protocol, Qos,
};

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

fn unsupported(store: &str, kind: &str) -> BuildError {
    BuildError::Unsupported(format!(
        "stores.{store}: type {kind} is not supported by this agent yet"
    ))
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
        other => Err(unsupported("outbox", other.type_name())),
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
        other => Err(unsupported("lease", other.type_name())),
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
        other => Err(unsupported("dlq", other.type_name())),
    }
}
