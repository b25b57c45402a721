//! Sessions, receivers, senders and bindings: the transport half of the document.
//!
//! The YAML keeps a session's transport (`transport: mqtt`) beside its options
//! (`options.session`), and receivers and senders take their transport from their session. So
//! the options blocks hold the keys of every transport (all optional), and the validator rejects
//! a key that does not belong to the session's transport and requires the ones that must be set.
//! [`Session::mqtt`] / [`Session::sqs`] / [`Session::rabbitmq`] / [`Session::nats`] give the typed, defaulted view the runtime uses.
//!
//! (A serde enum tagged by `transport` was the alternative; serde buffers such an enum before it
//! knows the variant, and with serde-saphyr that loses both the error location and the scalar
//! typing that lets `password: 123456` be a string.)

use serde::Deserialize;

use super::duration::Duration;
use super::secret::Secret;

/// The longest Unix socket path a `unix://` broker URL may name: Linux's `sun_path` holds 108
/// bytes with the terminating NUL.
pub const MAX_UNIX_SOCKET_PATH: usize = 107;

/// The socket path of a `unix:///absolute/path` broker URL, taken literally (no
/// percent-decoding): `None` when the URL is not a `unix://` one, the problem when its path is
/// not the absolute path of a file that fits a socket address. The one check of such a URL, for
/// the shared validator and the agent's session settings alike.
pub fn unix_socket_path(url: &str) -> Option<Result<&str, String>> {
    let (scheme, path) = url.split_once("://")?;
    if !scheme.eq_ignore_ascii_case("unix") {
        return None;
    }
    Some(if !path.starts_with('/') || path.ends_with('/') {
        Err("needs the absolute path of the socket file: unix:///path/to/socket".to_owned())
    } else if path.contains(['?', '#']) {
        Err("must not have a query or fragment".to_owned())
    } else if path.contains('\0') {
        Err("has a NUL in its socket path".to_owned())
    } else if path.len() > MAX_UNIX_SOCKET_PATH {
        Err(format!(
            "has a socket path of {} bytes; a Unix socket path holds at most {MAX_UNIX_SOCKET_PATH}",
            path.len()
        ))
    } else {
        Ok(path)
    })
}

/// The kind of broker or service a session connects to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Transport {
    /// An MQTT broker (v5 or v3.1.1).
    Mqtt,
    /// Amazon SQS (or a compatible endpoint): receive and send.
    Sqs,
    /// Amazon SNS (or a compatible endpoint): send only.
    Sns,
    /// A RabbitMQ broker (AMQP 0-9-1), for senders.
    Rabbitmq,
    /// A NATS server with JetStream, for senders.
    Nats,
    /// An application's outbox table in PostgreSQL, for receivers.
    PostgresTable,
    /// An application's outbox table in MySQL or MariaDB (10.6+), for receivers.
    MysqlTable,
}

impl Transport {
    /// The name the configuration uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Mqtt => "mqtt",
            Transport::Sqs => "sqs",
            Transport::Sns => "sns",
            Transport::Rabbitmq => "rabbitmq",
            Transport::Nats => "nats",
            Transport::PostgresTable => "postgres_table",
            Transport::MysqlTable => "mysql_table",
        }
    }

    /// True for the outbox-table transports (`postgres_table`, `mysql_table`).
    pub fn is_table(self) -> bool {
        matches!(self, Transport::PostgresTable | Transport::MysqlTable)
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A connection to a broker or service (`sessions[]`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Session {
    /// Unique id; receivers, senders and route session blocks refer to it.
    pub id: String,
    /// `mqtt`, `sqs`, `sns`, `rabbitmq`, `nats`, `postgres_table` or `mysql_table`.
    pub transport: Transport,
    /// Transport options (`options.session`).
    #[serde(default)]
    pub options: SessionOptions,
}

/// A session's `options:` block.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionOptions {
    /// The connection settings (`options.session`).
    #[serde(default)]
    pub session: SessionSettings,
}

/// `options.session`: the keys of every transport; each applies to one transport only.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionSettings {
    /// mqtt, required: `tcp|mqtt://host[:port]` (plain, default port 1883),
    /// `ssl|mqtts://host[:port]` (TLS, 8883), or `unix:///absolute/path` (a Unix socket of a
    /// broker on the same host).
    #[serde(default)]
    pub broker_url: Option<String>,
    /// mqtt, required: the MQTT client id. Receivers use a persistent session keyed by it, so it
    /// must be stable across restarts and unique per agent.
    #[serde(default)]
    pub client_id: Option<String>,
    /// mqtt: keep-alive in whole seconds, as the protocol carries it (1–65535). Default 30.
    #[serde(default)]
    pub keep_alive: Option<u16>,
    /// mqtt, rabbitmq, nats, postgres_table, mysql_table: user name.
    #[serde(default)]
    pub username: Option<String>,
    /// mqtt, rabbitmq, nats, postgres_table, mysql_table: password (use `${VAR}` to keep it out of the
    /// file). A secret:
    /// printed and shown as `***`.
    #[serde(default)]
    pub password: Option<Secret>,
    /// mqtt: `v5` (default) or `v3.1.1`.
    #[serde(default)]
    pub protocol_version: Option<ProtocolVersion>,
    /// mqtt: start with a clean session. Default false, so the broker keeps QoS 1 and 2
    /// messages for the agent while it is down.
    #[serde(default)]
    pub clean_start: Option<bool>,
    /// mqtt v5: how long the broker keeps the session after a disconnect. Default 1h.
    #[serde(default)]
    pub session_expiry: Option<Duration>,
    /// mqtt, rabbitmq, nats: PEM file of CA certificates to trust for TLS (default: the
    /// platform's roots).
    #[serde(default)]
    pub ca_file: Option<String>,
    /// mqtt, nats: PEM client certificate for mutual TLS (with `client_key_file`).
    #[serde(default)]
    pub client_cert_file: Option<String>,
    /// mqtt, nats: PEM private key for mutual TLS (with `client_cert_file`).
    #[serde(default)]
    pub client_key_file: Option<String>,
    /// mqtt, rabbitmq, nats, postgres_table, mysql_table: allow credentials over an unencrypted
    /// URL (`tcp`, `mqtt`, `ws`, `amqp`, `nats`, `postgres` without `sslmode=require`, `mysql`
    /// without `require_ssl=true`). Default false.
    #[serde(default)]
    pub allow_plaintext_credentials: Option<bool>,
    /// sqs, sns: AWS region (default: the SDK's region chain, e.g. `AWS_REGION`).
    #[serde(default)]
    pub region: Option<String>,
    /// sqs, sns: endpoint override, e.g. `http://localhost:5000` for a local emulator.
    #[serde(default)]
    pub endpoint_url: Option<String>,
    /// sqs: long-poll wait per receive call, whole seconds from 1s to 20s. Default 20s.
    #[serde(default)]
    pub wait_time: Option<Duration>,
    /// sqs: visibility timeout of received messages, extended by a heartbeat while a delivery is
    /// held. Default: the queue's own `VisibilityTimeout`. Whole seconds, at most 12h.
    #[serde(default)]
    pub visibility_timeout: Option<Duration>,
    /// sqs: messages asked for per receive call, 1–10. Default 10.
    #[serde(default)]
    pub max_messages: Option<u8>,
    /// rabbitmq, required: `amqp://host[:port][/vhost]` (plain, 5672) or
    /// `amqps://host[:port][/vhost]` (TLS, 5671); the vhost is URL-encoded (`/%2f` is `/`, the
    /// default). nats, required: `nats://host[:port]` (4222; TLS when the server requires it)
    /// or `tls://host[:port]` (TLS always). postgres_table, required: `postgres://host[:port]/db`
    /// (`?sslmode=require` for TLS). mysql_table, required: `mysql://host[:port]/db`
    /// (`?require_ssl=true` for TLS). Credentials go in their own options, never in the URL.
    #[serde(default)]
    pub url: Option<String>,
    /// nats: a `.creds` file (user JWT and NKey seed) to authenticate with.
    #[serde(default)]
    pub credentials_file: Option<String>,
    /// nats: an authentication token. A secret: printed and shown as `***`.
    #[serde(default)]
    pub token: Option<Secret>,
}

/// The MQTT protocol version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum ProtocolVersion {
    /// MQTT 5.0.
    #[default]
    #[serde(rename = "v5")]
    V5,
    /// MQTT 3.1.1.
    #[serde(rename = "v3.1.1")]
    V311,
}

/// Default MQTT keep-alive, in seconds.
pub fn default_keep_alive_secs() -> u16 {
    30
}

/// Default MQTT v5 session expiry.
pub fn default_session_expiry() -> Duration {
    Duration::from_secs(3600)
}

/// Default SQS long-poll wait.
pub fn default_sqs_wait_time() -> Duration {
    Duration::from_secs(20)
}

/// Default SQS messages per receive call (SQS's maximum).
pub fn default_sqs_max_messages() -> u8 {
    10
}

/// A validated MQTT session's settings with defaults applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MqttSession {
    /// The broker URL as written.
    pub broker_url: String,
    /// The client id.
    pub client_id: String,
    /// Keep-alive.
    pub keep_alive: std::time::Duration,
    /// User name.
    pub username: Option<String>,
    /// Password (prints as `***`).
    pub password: Option<Secret>,
    /// Protocol version.
    pub protocol_version: ProtocolVersion,
    /// Clean start.
    pub clean_start: bool,
    /// Session expiry (v5).
    pub session_expiry: Duration,
    /// CA file for TLS.
    pub ca_file: Option<String>,
    /// Client certificate for mutual TLS.
    pub client_cert_file: Option<String>,
    /// Client key for mutual TLS.
    pub client_key_file: Option<String>,
}

/// A validated SQS or SNS session's settings with defaults applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqsSession {
    /// Region, when set.
    pub region: Option<String>,
    /// Endpoint override, when set.
    pub endpoint_url: Option<String>,
    /// Long-poll wait (sqs receivers).
    pub wait_time: Duration,
    /// Visibility timeout (sqs receivers); `None`: the queue's own.
    pub visibility_timeout: Option<Duration>,
    /// Messages per receive call (sqs receivers).
    pub max_messages: u8,
}

/// A validated RabbitMQ session's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RabbitmqSession {
    /// `amqp://` or `amqps://` URL, without credentials.
    pub url: String,
    /// User name (the broker's default `guest` when unset).
    pub username: Option<String>,
    /// Password.
    pub password: Option<Secret>,
    /// CA file for TLS.
    pub ca_file: Option<String>,
}

/// A validated NATS session's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsSession {
    /// `nats://` or `tls://` URL, without credentials.
    pub url: String,
    /// Credentials file.
    pub credentials_file: Option<String>,
    /// Token.
    pub token: Option<Secret>,
    /// User name (with `password`).
    pub username: Option<String>,
    /// Password.
    pub password: Option<Secret>,
    /// CA file for TLS.
    pub ca_file: Option<String>,
    /// Client certificate for mutual TLS.
    pub client_cert_file: Option<String>,
    /// Client key for mutual TLS.
    pub client_key_file: Option<String>,
}

/// A validated outbox-table session's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableSession {
    /// `postgres_table` or `mysql_table`.
    pub transport: Transport,
    /// `postgres://host[:port]/db` or `mysql://host[:port]/db`, without credentials.
    pub url: String,
    /// User name.
    pub username: Option<String>,
    /// Password.
    pub password: Option<Secret>,
    /// CA file for TLS.
    pub ca_file: Option<String>,
}

impl Session {
    /// The outbox-table view, if this is a `postgres_table` or `mysql_table` session with its
    /// URL set.
    pub fn table(&self) -> Option<TableSession> {
        let s = &self.options.session;
        if !self.transport.is_table() {
            return None;
        }
        Some(TableSession {
            transport: self.transport,
            url: s.url.clone()?,
            username: s.username.clone(),
            password: s.password.clone(),
            ca_file: s.ca_file.clone(),
        })
    }

    /// The RabbitMQ view, if this is a RabbitMQ session with its URL set.
    pub fn rabbitmq(&self) -> Option<RabbitmqSession> {
        let s = &self.options.session;
        if self.transport != Transport::Rabbitmq {
            return None;
        }
        Some(RabbitmqSession {
            url: s.url.clone()?,
            username: s.username.clone(),
            password: s.password.clone(),
            ca_file: s.ca_file.clone(),
        })
    }

    /// The NATS view, if this is a NATS session with its URL set.
    pub fn nats(&self) -> Option<NatsSession> {
        let s = &self.options.session;
        if self.transport != Transport::Nats {
            return None;
        }
        Some(NatsSession {
            url: s.url.clone()?,
            credentials_file: s.credentials_file.clone(),
            token: s.token.clone(),
            username: s.username.clone(),
            password: s.password.clone(),
            ca_file: s.ca_file.clone(),
            client_cert_file: s.client_cert_file.clone(),
            client_key_file: s.client_key_file.clone(),
        })
    }

    /// The MQTT view, if this is an MQTT session with its required keys set.
    pub fn mqtt(&self) -> Option<MqttSession> {
        let s = &self.options.session;
        if self.transport != Transport::Mqtt {
            return None;
        }
        Some(MqttSession {
            broker_url: s.broker_url.clone()?,
            client_id: s.client_id.clone()?,
            keep_alive: std::time::Duration::from_secs(u64::from(
                s.keep_alive.unwrap_or_else(default_keep_alive_secs),
            )),
            username: s.username.clone(),
            password: s.password.clone(),
            protocol_version: s.protocol_version.unwrap_or_default(),
            clean_start: s.clean_start.unwrap_or(false),
            session_expiry: s.session_expiry.unwrap_or_else(default_session_expiry),
            ca_file: s.ca_file.clone(),
            client_cert_file: s.client_cert_file.clone(),
            client_key_file: s.client_key_file.clone(),
        })
    }

    /// The AWS view, if this is an SQS or SNS session.
    pub fn sqs(&self) -> Option<SqsSession> {
        let s = &self.options.session;
        if !matches!(self.transport, Transport::Sqs | Transport::Sns) {
            return None;
        }
        Some(SqsSession {
            region: s.region.clone(),
            endpoint_url: s.endpoint_url.clone(),
            wait_time: s.wait_time.unwrap_or_else(default_sqs_wait_time),
            visibility_timeout: s.visibility_timeout,
            max_messages: s.max_messages.unwrap_or_else(default_sqs_max_messages),
        })
    }
}

/// Subscribes on a session (`receivers[]`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Receiver {
    /// Unique id; a route names it as `receiver_id`.
    pub id: String,
    /// The session it receives on.
    pub session_id: String,
    /// mqtt, required: topic filters to subscribe to (`$share/{group}/{filter}` for a shared
    /// subscription).
    #[serde(default)]
    pub topics: Option<Vec<TopicSubscription>>,
    /// sqs, required: the queue to receive from, a queue name or a queue URL. (sns sessions
    /// have no receivers.)
    #[serde(default)]
    pub queue: Option<String>,
    /// mqtt: keep an incoming `ferry-message-id` as the message id (and the other incoming
    /// `ferry-*` headers), for a hop from another Ferry agent. Default false: incoming
    /// `ferry-*` user properties are dropped and every message gets a fresh UUIDv7, because a
    /// forged or republished header would make two different messages share an id (a consumer
    /// deduplicating by it would drop the second).
    #[serde(default)]
    pub trust_message_id: bool,
    /// postgres_table, mysql_table, required: the outbox table (`name` or `schema.name`) with
    /// the seeds' columns (see `columns`).
    #[serde(default)]
    pub table: Option<String>,
    /// postgres_table, mysql_table: how long to wait before looking for new rows after finding
    /// none. Default 1s.
    #[serde(default)]
    pub poll_interval: Option<Duration>,
    /// postgres_table, mysql_table: the most rows in flight at once (claimed and not yet
    /// settled). Default 100.
    #[serde(default)]
    pub batch_size: Option<u32>,
    /// postgres_table, mysql_table: the table's column names, each defaulting to seed 004's.
    #[serde(default)]
    pub columns: Option<TableColumns>,
    /// postgres_table, mysql_table: how long a claimed row stays reserved for this agent
    /// (`retry_at` is pushed this far ahead, and again every third of it while the row is in
    /// flight). A row of an agent that died is claimed again after at most this. Default 30s.
    #[serde(default)]
    pub claim_ttl: Option<Duration>,
    /// postgres_table, mysql_table: failed deliveries of a row (its `retry_count`) before it is
    /// dead-lettered. Default 10.
    #[serde(default)]
    pub max_retries: Option<u32>,
    /// postgres_table, mysql_table: the first retry delay; the n-th failure waits
    /// `retry_backoff × 2^(n-1)`, at most `retry_backoff_max`. Default 1s.
    #[serde(default)]
    pub retry_backoff: Option<Duration>,
    /// postgres_table, mysql_table: the longest retry delay. Default 10m.
    #[serde(default)]
    pub retry_backoff_max: Option<Duration>,
    /// postgres_table, mysql_table: `mark` (default: set `sent_at`) or `delete` (delete the row
    /// once settled).
    #[serde(default)]
    pub on_sent: Option<OnSent>,
    /// postgres_table, mysql_table: delete rows sent longer ago than this. Default: never (the
    /// application purges).
    #[serde(default)]
    pub retention: Option<Duration>,
    /// postgres_table: `LISTEN` on this channel and claim at once on a notification (the
    /// optional trigger in docs/configuration.md sends it). Default: poll only.
    #[serde(default)]
    pub notify_channel: Option<String>,
    /// postgres_table, mysql_table: `id` (default: rows go out in id order, for sequence ids)
    /// or `created_at` (in `(created_at, id)` order, for ids the application chooses, such as
    /// UUIDs); per aggregate, the same order decides which row is next.
    #[serde(default)]
    pub order_by: Option<OrderBy>,
    /// postgres_table, mysql_table, with `columns.status`: the value of a row still to relay.
    /// Default `pending`.
    #[serde(default)]
    pub pending_status: Option<String>,
    /// postgres_table, mysql_table, with `columns.status`: the value written once a row is
    /// relayed. Default `processed`.
    #[serde(default)]
    pub sent_status: Option<String>,
}

impl Receiver {
    /// `(key, set)` of the outbox-table receivers' keys, which no other receiver takes.
    pub fn table_keys(&self) -> [(&'static str, bool); 14] {
        [
            ("table", self.table.is_some()),
            ("poll_interval", self.poll_interval.is_some()),
            ("batch_size", self.batch_size.is_some()),
            ("columns", self.columns.is_some()),
            ("claim_ttl", self.claim_ttl.is_some()),
            ("max_retries", self.max_retries.is_some()),
            ("retry_backoff", self.retry_backoff.is_some()),
            ("retry_backoff_max", self.retry_backoff_max.is_some()),
            ("on_sent", self.on_sent.is_some()),
            ("retention", self.retention.is_some()),
            ("notify_channel", self.notify_channel.is_some()),
            ("order_by", self.order_by.is_some()),
            ("pending_status", self.pending_status.is_some()),
            ("sent_status", self.sent_status.is_some()),
        ]
    }
}

/// What a relay does with a row once its delivery is settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnSent {
    /// Set `sent_at` (purged later per `retention`), or `status` to `sent_status`.
    #[default]
    Mark,
    /// Delete the row.
    Delete,
}

/// `pending_status` when not set: seed 002's value of a row still to relay.
pub const DEFAULT_PENDING_STATUS: &str = "pending";
/// `sent_status` when not set: seed 002's value of a relayed row.
pub const DEFAULT_SENT_STATUS: &str = "processed";

/// The order an outbox-table relay claims rows in, overall and per aggregate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OrderBy {
    /// By id: sequence ids (`bigserial`, `AUTO_INCREMENT`).
    #[default]
    Id,
    /// By `(created_at, id)`: ids the application chooses (UUIDs).
    CreatedAt,
}

/// How a relay tells a row still to relay from a relayed one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateColumn<'a> {
    /// This timestamp column is null until the row is relayed (seed 004).
    SentAt(&'a str),
    /// This column holds `pending_status` until the row is relayed, then `sent_status`
    /// (seed 002).
    Status(&'a str),
}

/// An outbox table's column names (plain identifiers); each defaults to seed 004's name. The
/// header columns (`aggregate_type`, `aggregate_id`, `event`) may be set to null when the table
/// has no such column (seed 002's has none).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableColumns {
    /// The id: an integer, or text such as a UUID (then see `order_by`). Default `id`.
    #[serde(default)]
    pub id: Option<String>,
    /// Sent as header `aggregate_type`. Default `aggregate_type`; null: none.
    #[serde(default, deserialize_with = "nullable")]
    pub aggregate_type: Option<Option<String>>,
    /// Rows with the same value are delivered in order (`order_by`); sent as header
    /// `aggregate_id`. Default `aggregate_id`; null: none, every row is independent.
    #[serde(default, deserialize_with = "nullable")]
    pub aggregate_id: Option<Option<String>>,
    /// The event type, sent as header `event`. Default `event`; null: none.
    #[serde(default, deserialize_with = "nullable")]
    pub event: Option<Option<String>>,
    /// The message body. Default `payload`.
    #[serde(default)]
    pub payload: Option<String>,
    /// Null until relayed. Default `sent_at`, unless `status` is set.
    #[serde(default)]
    pub sent_at: Option<String>,
    /// Instead of `sent_at`: a status column, `pending_status` until relayed and `sent_status`
    /// after. Default: none.
    #[serde(default)]
    pub status: Option<String>,
    /// Failed deliveries so far (null counts as 0). Default `retry_count`.
    #[serde(default)]
    pub retry_count: Option<String>,
    /// Not claimed before this time (null: at once). Default `retry_at`.
    #[serde(default)]
    pub retry_at: Option<String>,
    /// When the application wrote the row, for `order_by: created_at`. Default `created_at`.
    #[serde(default)]
    pub created_at: Option<String>,
    /// A JSON object of string values (json, jsonb or text), each a message header; a row
    /// whose value is not one is dead-lettered. Default: none.
    #[serde(default)]
    pub headers: Option<String>,
}

/// An absent key is `None`, an explicit null `Some(None)`.
fn nullable<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<String>>, D::Error> {
    Option::<String>::deserialize(d).map(Some)
}

impl TableColumns {
    /// `(key, configured name)` of every column set to a name.
    pub fn names(&self) -> [(&'static str, Option<&str>); 11] {
        [
            ("id", self.id.as_deref()),
            (
                "aggregate_type",
                self.aggregate_type.as_ref().and_then(|n| n.as_deref()),
            ),
            (
                "aggregate_id",
                self.aggregate_id.as_ref().and_then(|n| n.as_deref()),
            ),
            ("event", self.event.as_ref().and_then(|n| n.as_deref())),
            ("payload", self.payload.as_deref()),
            ("sent_at", self.sent_at.as_deref()),
            ("status", self.status.as_deref()),
            ("retry_count", self.retry_count.as_deref()),
            ("retry_at", self.retry_at.as_deref()),
            ("created_at", self.created_at.as_deref()),
            ("headers", self.headers.as_deref()),
        ]
    }

    /// The id column.
    pub fn id(&self) -> &str {
        self.id.as_deref().unwrap_or("id")
    }

    /// The `aggregate_type` column, if the table has one.
    pub fn aggregate_type(&self) -> Option<&str> {
        nullable_or(&self.aggregate_type, "aggregate_type")
    }

    /// The ordering key's column, if the table has one.
    pub fn aggregate_id(&self) -> Option<&str> {
        nullable_or(&self.aggregate_id, "aggregate_id")
    }

    /// The event type's column, if the table has one.
    pub fn event(&self) -> Option<&str> {
        nullable_or(&self.event, "event")
    }

    /// The body's column.
    pub fn payload(&self) -> &str {
        self.payload.as_deref().unwrap_or("payload")
    }

    /// The state column: `status` when set, else `sent_at`.
    pub fn state(&self) -> StateColumn<'_> {
        match &self.status {
            Some(status) => StateColumn::Status(status),
            None => StateColumn::SentAt(self.sent_at.as_deref().unwrap_or("sent_at")),
        }
    }

    /// The retry counter's column.
    pub fn retry_count(&self) -> &str {
        self.retry_count.as_deref().unwrap_or("retry_count")
    }

    /// The retry time's (and lease's) column.
    pub fn retry_at(&self) -> &str {
        self.retry_at.as_deref().unwrap_or("retry_at")
    }

    /// The creation time's column, when `order_by` reads it.
    pub fn created_at(&self, order_by: OrderBy) -> Option<&str> {
        match order_by {
            OrderBy::Id => None,
            OrderBy::CreatedAt => Some(self.created_at.as_deref().unwrap_or("created_at")),
        }
    }

    /// `(key, name)` of every column a relay with `order_by` reads or writes.
    pub fn used(&self, order_by: OrderBy) -> Vec<(&'static str, &str)> {
        let state = match self.state() {
            StateColumn::SentAt(c) => ("sent_at", c),
            StateColumn::Status(c) => ("status", c),
        };
        let mut used = vec![("id", self.id())];
        used.extend(self.aggregate_type().map(|c| ("aggregate_type", c)));
        used.extend(self.aggregate_id().map(|c| ("aggregate_id", c)));
        used.extend(self.event().map(|c| ("event", c)));
        used.extend([
            ("payload", self.payload()),
            state,
            ("retry_count", self.retry_count()),
            ("retry_at", self.retry_at()),
        ]);
        used.extend(self.created_at(order_by).map(|c| ("created_at", c)));
        used.extend(self.headers.as_deref().map(|c| ("headers", c)));
        used
    }
}

/// The configured name, the default when the key is absent, `None` when set to null.
fn nullable_or<'a>(name: &'a Option<Option<String>>, default: &'a str) -> Option<&'a str> {
    match name {
        None => Some(default),
        Some(name) => name.as_deref(),
    }
}

/// One MQTT subscription of a receiver.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopicSubscription {
    /// The topic filter (`+` and `#` wildcards allowed).
    pub topic: String,
    /// Maximum QoS of the subscription, 0–2. Default 1 (at-least-once needs 1 or 2).
    #[serde(default = "default_qos")]
    pub qos: u8,
}

/// Default QoS of subscriptions and MQTT senders.
pub fn default_qos() -> u8 {
    1
}

/// Publishes on a session (`senders[]`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sender {
    /// Unique id; bindings and route session blocks name it.
    pub id: String,
    /// The session it publishes on.
    pub session_id: String,
    /// Sender options (`options.sender`).
    #[serde(default)]
    pub options: SenderOptions,
}

/// A sender's `options:` block.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SenderOptions {
    /// The publishing settings (`options.sender`).
    #[serde(default)]
    pub sender: SenderSettings,
}

/// `options.sender`: the keys of every transport; each applies to one transport only.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SenderSettings {
    /// mqtt: QoS of published messages, 0–2. Default 1 (a send resolves on PUBACK).
    #[serde(default)]
    pub qos: Option<u8>,
    /// mqtt: publish with the retain flag. Default false.
    #[serde(default)]
    pub retain: Option<bool>,
    /// sqs: the queue this sender is pinned to, by URL (exactly one of `queue_url`,
    /// `queue_name`).
    #[serde(default)]
    pub queue_url: Option<String>,
    /// sqs: the queue this sender is pinned to, by name (resolved to its URL at start).
    #[serde(default)]
    pub queue_name: Option<String>,
    /// sns: the topic this sender is pinned to, by ARN (exactly one of `topic_arn`,
    /// `topic_name`).
    #[serde(default)]
    pub topic_arn: Option<String>,
    /// sns: the topic this sender is pinned to, by name (resolved to its ARN at start).
    #[serde(default)]
    pub topic_name: Option<String>,
    /// sqs, sns: the message group id for FIFO queues and topics: a fixed id, or
    /// `{header:NAME}` for the value of the message's header `NAME`. Required for a FIFO queue
    /// or topic (name ending in `.fifo`), refused for a standard one.
    #[serde(default)]
    pub message_group_id: Option<String>,
    /// sqs: delay before a sent message becomes visible, 0s–15m, whole seconds (standard
    /// queues only). Default: the queue's own `DelaySeconds`.
    #[serde(default)]
    pub delay_seconds: Option<Duration>,
    /// rabbitmq: publish with the `mandatory` flag, so a message no queue is bound for comes
    /// back and fails as a permanent error (dead-lettered) instead of being dropped by the
    /// broker. Default true.
    #[serde(default)]
    pub mandatory: Option<bool>,
}

/// How a FIFO sender picks a message's group id (`message_group_id`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupId {
    /// Every message in one group.
    Fixed(String),
    /// `{header:NAME}`: the value of the message's first header `NAME`.
    Header(String),
}

impl GroupId {
    /// Reads `message_group_id` as written: `{header:NAME}` or a fixed id.
    pub fn parse(s: &str) -> Self {
        match s
            .strip_prefix("{header:")
            .and_then(|rest| rest.strip_suffix('}'))
        {
            Some(name) => GroupId::Header(name.to_owned()),
            None => GroupId::Fixed(s.to_owned()),
        }
    }
}

impl SenderSettings {
    /// The FIFO group id rule, when set.
    pub fn group_id(&self) -> Option<GroupId> {
        self.message_group_id.as_deref().map(GroupId::parse)
    }

    /// MQTT QoS with its default.
    pub fn qos(&self) -> u8 {
        self.qos.unwrap_or_else(default_qos)
    }

    /// MQTT retain flag with its default.
    pub fn retain(&self) -> bool {
        self.retain.unwrap_or(false)
    }

    /// RabbitMQ `mandatory` flag with its default.
    pub fn mandatory(&self) -> bool {
        self.mandatory.unwrap_or(true)
    }
}

/// A destination: a sender plus an address (`bindings[]`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Binding {
    /// Unique id; routes list it in `bindings`.
    pub id: String,
    /// The sender that delivers to it.
    pub sender_id: String,
    /// mqtt: the topic to publish to (no wildcards). sqs: the sender's queue, as its bare name
    /// or its full URL. sns: the sender's topic, as its bare name or its ARN. rabbitmq:
    /// `EXCHANGE/ROUTING_KEY` (an empty exchange, `/queue` or plain `queue`, is the default
    /// exchange). nats: the JetStream subject.
    ///
    /// mqtt, rabbitmq and nats addresses may name headers, `orders.{header:aggregate_id}`,
    /// filled per message (see [`crate::address`]).
    pub address: String,
}
