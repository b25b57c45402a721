//! Sessions, receivers, senders and bindings: required and foreign keys per transport, URLs,
//! topics, queues, exchanges, subjects, address templates, and the references between them.

use std::collections::{HashMap, HashSet};

use crate::address::{AddressTemplate, amqp_address, nats_subject};

use super::super::duration::Duration;
use super::super::secret::MASK;
use super::super::transport::{
    DEFAULT_PENDING_STATUS, DEFAULT_SENT_STATUS, ProtocolVersion, Sender, SessionSettings,
    StateColumn, Transport,
};
use super::Validator;
use super::syntax::{self, BrokerLink};

/// The longest SQS long-poll wait.
const MAX_SQS_WAIT: Duration = Duration::from_secs(20);
/// The longest SQS visibility timeout.
const MAX_SQS_VISIBILITY: Duration = Duration::from_secs(12 * 3600);

/// The longest SQS delivery delay.
const MAX_SQS_DELAY: Duration = Duration::from_secs(15 * 60);

const MQTT: &[Transport] = &[Transport::Mqtt];
const SQS: &[Transport] = &[Transport::Sqs];
const AWS: &[Transport] = &[Transport::Sqs, Transport::Sns];
const SNS: &[Transport] = &[Transport::Sns];
const RABBITMQ: &[Transport] = &[Transport::Rabbitmq];
const NATS: &[Transport] = &[Transport::Nats];
/// The transports with a connection that takes a user name and password.
const BROKERS: &[Transport] = &[
    Transport::Mqtt,
    Transport::Rabbitmq,
    Transport::Nats,
    Transport::PostgresTable,
    Transport::MysqlTable,
];
const BROKERS_TLS: &[Transport] = &[
    Transport::Mqtt,
    Transport::Rabbitmq,
    Transport::Nats,
    Transport::PostgresTable,
    Transport::MysqlTable,
];
const MUTUAL_TLS: &[Transport] = &[Transport::Mqtt, Transport::Nats];
const URL: &[Transport] = &[
    Transport::Rabbitmq,
    Transport::Nats,
    Transport::PostgresTable,
    Transport::MysqlTable,
];

/// `a`, `a or b`, `a, b or c`.
fn either(transports: &[Transport]) -> String {
    let names: Vec<&str> = transports.iter().map(|t| t.as_str()).collect();
    match names.split_last() {
        Some((last, [])) => (*last).to_owned(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

impl SessionSettings {
    /// `(key, set, transports it belongs to)` for every key.
    fn keys(&self) -> [(&'static str, bool, &'static [Transport]); 20] {
        [
            ("broker_url", self.broker_url.is_some(), MQTT),
            ("client_id", self.client_id.is_some(), MQTT),
            ("keep_alive", self.keep_alive.is_some(), MQTT),
            ("username", self.username.is_some(), BROKERS),
            ("password", self.password.is_some(), BROKERS),
            ("protocol_version", self.protocol_version.is_some(), MQTT),
            ("clean_start", self.clean_start.is_some(), MQTT),
            ("session_expiry", self.session_expiry.is_some(), MQTT),
            ("ca_file", self.ca_file.is_some(), BROKERS_TLS),
            (
                "client_cert_file",
                self.client_cert_file.is_some(),
                MUTUAL_TLS,
            ),
            (
                "client_key_file",
                self.client_key_file.is_some(),
                MUTUAL_TLS,
            ),
            (
                "allow_plaintext_credentials",
                self.allow_plaintext_credentials.is_some(),
                BROKERS,
            ),
            ("region", self.region.is_some(), AWS),
            ("endpoint_url", self.endpoint_url.is_some(), AWS),
            ("wait_time", self.wait_time.is_some(), SQS),
            ("visibility_timeout", self.visibility_timeout.is_some(), SQS),
            ("max_messages", self.max_messages.is_some(), SQS),
            ("url", self.url.is_some(), URL),
            ("credentials_file", self.credentials_file.is_some(), NATS),
            ("token", self.token.is_some(), NATS),
        ]
    }
}

impl Sender {
    /// `(key, set, transports it belongs to)` for every key of `options.sender`.
    fn keys(&self) -> [(&'static str, bool, &'static [Transport]); 9] {
        let s = &self.options.sender;
        [
            ("qos", s.qos.is_some(), MQTT),
            ("retain", s.retain.is_some(), MQTT),
            ("queue_url", s.queue_url.is_some(), SQS),
            ("queue_name", s.queue_name.is_some(), SQS),
            ("topic_arn", s.topic_arn.is_some(), SNS),
            ("topic_name", s.topic_name.is_some(), SNS),
            ("message_group_id", s.message_group_id.is_some(), AWS),
            ("delay_seconds", s.delay_seconds.is_some(), SQS),
            ("mandatory", s.mandatory.is_some(), RABBITMQ),
        ]
    }
}

impl Validator<'_> {
    pub(super) fn sessions(&mut self) {
        for (i, session) in self.config.sessions.iter().enumerate() {
            let base = format!("sessions[{i}].options.session");
            let s = &session.options.session;
            for (key, set, transports) in s.keys() {
                if set && !transports.contains(&session.transport) {
                    self.error(
                        format!("{base}.{key}"),
                        format!(
                            "{key} is an option of {} sessions, and this session's transport is {}",
                            either(transports),
                            session.transport
                        ),
                    );
                }
            }
            match session.transport {
                Transport::Mqtt => self.mqtt_session(&base, s),
                Transport::Sqs | Transport::Sns => self.aws_session(&base, s),
                Transport::Rabbitmq => self.rabbitmq_session(&base, s),
                Transport::Nats => self.nats_session(&base, s),
                Transport::PostgresTable | Transport::MysqlTable => {
                    self.table_session(&base, session.transport, s);
                }
            }
        }
    }

    fn mqtt_session(&mut self, base: &str, s: &SessionSettings) {
        let mut link = None;
        match &s.broker_url {
            None => self.error(
                format!("{base}.broker_url"),
                "an mqtt session needs broker_url",
            ),
            Some(u) => match syntax::broker_url(u) {
                Ok(l) => link = Some(l),
                Err(e) => self.error(format!("{base}.broker_url"), e),
            },
        }
        match &s.client_id {
            None => self.error(
                format!("{base}.client_id"),
                "an mqtt session needs client_id (stable across restarts, so the broker keeps its session)",
            ),
            Some(id) if id.is_empty() => self.error(format!("{base}.client_id"), "must not be empty"),
            Some(_) => {}
        }
        if s.keep_alive == Some(0) {
            self.error(format!("{base}.keep_alive"), "must be at least 1 (second)");
        }
        let version = s.protocol_version.unwrap_or_default();
        if let Some(expiry) = s.session_expiry {
            if version == ProtocolVersion::V311 {
                self.error(
                    format!("{base}.session_expiry"),
                    "session_expiry needs protocol_version v5 (a v3.1.1 broker keeps a session until it decides otherwise)",
                );
            }
            self.positive(format!("{base}.session_expiry"), expiry);
            if expiry.get().as_secs() > u64::from(u32::MAX) {
                self.error(
                    format!("{base}.session_expiry"),
                    format!("must be at most {}s (MQTT's limit)", u32::MAX),
                );
            }
        }
        self.not_masked(base, "password", s.password.as_ref());
        if version == ProtocolVersion::V311 && s.password.is_some() && s.username.is_none() {
            self.error(
                format!("{base}.password"),
                "MQTT v3.1.1 does not allow a password without a username",
            );
        }
        // Credentials sent on a Unix socket stay on the host: only a plain network URL needs
        // the opt-in.
        if link == Some(BrokerLink::Plain) {
            self.plaintext(base, s, "an ssl:// or mqtts:// broker_url");
        }
        if matches!(link, Some(BrokerLink::Plain | BrokerLink::UnixSocket)) {
            self.tls_files_need_tls(base, s, "a TLS broker_url (ssl:// or mqtts://)");
        }
        self.client_cert_pair(base, s);
    }

    /// A secret that is the mask a masked document shows, not the value.
    fn not_masked(&mut self, base: &str, key: &str, secret: Option<&super::super::secret::Secret>) {
        if secret.is_some_and(|p| p.expose() == MASK) {
            self.error(
                format!("{base}.{key}"),
                format!("is the mask `***` that a masked document shows, not the {key}: apply the original document (or one read with --show-secrets)"),
            );
        }
    }

    /// Credentials on a plaintext URL, unless allowed; `tls_urls` says what to use instead.
    /// (A token is a NATS credential; on another transport it is reported as foreign.)
    fn plaintext(&mut self, base: &str, s: &SessionSettings, tls_urls: &str) {
        if s.allow_plaintext_credentials == Some(true) {
            return;
        }
        let token = s.token.is_some() && s.url.as_deref().is_some_and(|u| u.starts_with("nats"));
        let key = [
            ("password", s.password.is_some()),
            ("token", token),
            ("username", s.username.is_some()),
        ]
        .into_iter()
        .find_map(|(key, set)| set.then_some(key));
        if let Some(key) = key {
            self.error(
                format!("{base}.{key}"),
                format!(
                    "credentials would cross the network unencrypted: use {tls_urls}, or set allow_plaintext_credentials: true"
                ),
            );
        }
    }

    /// TLS files on a plaintext URL.
    fn tls_files_need_tls(&mut self, base: &str, s: &SessionSettings, tls_url: &str) {
        for (key, set) in [
            ("ca_file", s.ca_file.is_some()),
            ("client_cert_file", s.client_cert_file.is_some()),
            ("client_key_file", s.client_key_file.is_some()),
        ] {
            if set {
                self.error(format!("{base}.{key}"), format!("{key} needs {tls_url}"));
            }
        }
    }

    fn client_cert_pair(&mut self, base: &str, s: &SessionSettings) {
        match (&s.client_cert_file, &s.client_key_file) {
            (Some(_), None) => self.error(
                format!("{base}.client_key_file"),
                "client_cert_file needs client_key_file",
            ),
            (None, Some(_)) => self.error(
                format!("{base}.client_cert_file"),
                "client_key_file needs client_cert_file",
            ),
            _ => {}
        }
    }

    fn rabbitmq_session(&mut self, base: &str, s: &SessionSettings) {
        match &s.url {
            None => self.error(
                format!("{base}.url"),
                "a rabbitmq session needs url (amqp:// or amqps://)",
            ),
            Some(u) => match syntax::url(u) {
                Err(e) => self.error(format!("{base}.url"), e),
                Ok(parsed) => match parsed.scheme.as_str() {
                    "amqps" => {}
                    "amqp" => {
                        self.plaintext(base, s, "an amqps:// url");
                        self.tls_files_need_tls(base, s, "an amqps:// url");
                    }
                    other => self.error(
                        format!("{base}.url"),
                        format!(
                            "\"{u}\" has scheme \"{other}\"; a rabbitmq url is amqp:// or amqps://"
                        ),
                    ),
                },
            },
        }
        self.not_masked(base, "password", s.password.as_ref());
        if s.password.is_some() && s.username.is_none() {
            self.error(format!("{base}.password"), "password needs username");
        }
    }

    fn nats_session(&mut self, base: &str, s: &SessionSettings) {
        match &s.url {
            None => self.error(
                format!("{base}.url"),
                "a nats session needs url (nats:// or tls://)",
            ),
            Some(u) => match syntax::url(u) {
                Err(e) => self.error(format!("{base}.url"), e),
                Ok(parsed) if !parsed.path.is_empty() && parsed.path != "/" => self.error(
                    format!("{base}.url"),
                    format!("\"{u}\" has a path; a nats url is scheme://host[:port]"),
                ),
                Ok(parsed) => match parsed.scheme.as_str() {
                    "tls" => {}
                    // A nats:// url upgrades to TLS only when the server asks for it, so
                    // credentials on it may cross in the clear.
                    "nats" => self.plaintext(base, s, "a tls:// url"),
                    other => self.error(
                        format!("{base}.url"),
                        format!("\"{u}\" has scheme \"{other}\"; a nats url is nats:// or tls://"),
                    ),
                },
            },
        }
        self.not_masked(base, "password", s.password.as_ref());
        self.not_masked(base, "token", s.token.as_ref());
        let methods = [
            s.credentials_file.is_some(),
            s.token.is_some(),
            s.username.is_some() || s.password.is_some(),
        ];
        if methods.into_iter().filter(|set| *set).count() > 1 {
            self.error(
                base.to_owned(),
                "set one of credentials_file, token, or username with password",
            );
        }
        if s.username.is_some() != s.password.is_some() {
            let key = if s.username.is_some() {
                "password"
            } else {
                "username"
            };
            self.error(format!("{base}.{key}"), "username and password go together");
        }
        self.client_cert_pair(base, s);
    }

    /// An outbox-table session: `postgres://host[:port]/db[?sslmode=…]` or
    /// `mysql://host[:port]/db[?require_ssl=…]`, the one TLS switch as the only query.
    fn table_session(&mut self, base: &str, transport: Transport, s: &SessionSettings) {
        let (scheme, shape, tls_key, tls_on) = match transport {
            Transport::MysqlTable => (
                "mysql",
                "mysql://host[:port]/database",
                "require_ssl",
                "true",
            ),
            _ => (
                "postgres",
                "postgres://host[:port]/database",
                "sslmode",
                "require",
            ),
        };
        let path = format!("{base}.url");
        let Some(u) = &s.url else {
            self.error(path, format!("a {transport} session needs url ({shape})"));
            return;
        };
        let (address, query) = u.split_once('?').unwrap_or((u, ""));
        let mut tls = false;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some((k, v))
                    if k == tls_key
                        && transport == Transport::MysqlTable
                        && (v == "true" || v == "false") =>
                {
                    tls = v == "true"
                }
                Some((k, v))
                    if k == tls_key
                        && transport == Transport::PostgresTable
                        && ["disable", "prefer", "require"].contains(&v) =>
                {
                    tls = v == "require"
                }
                _ => {
                    self.error(
                        path.clone(),
                        format!(
                            "\"{pair}\" is not a query option of a {transport} url (only {tls_key})"
                        ),
                    );
                }
            }
        }
        match syntax::url(address) {
            Err(e) => self.error(path, e),
            Ok(parsed)
                if parsed.scheme != scheme
                    && !(scheme == "postgres" && parsed.scheme == "postgresql") =>
            {
                self.error(
                    path,
                    format!(
                        "\"{u}\" has scheme \"{}\"; a {transport} url is {scheme}://",
                        parsed.scheme
                    ),
                );
            }
            Ok(parsed) if parsed.path.trim_start_matches('/').is_empty() => {
                self.error(path, format!("\"{u}\" names no database ({shape})"));
            }
            Ok(_) if !tls => {
                let tls_url = format!("?{tls_key}={tls_on}");
                self.plaintext(base, s, &tls_url);
                self.tls_files_need_tls(base, s, &tls_url);
            }
            Ok(_) => {}
        }
        self.not_masked(base, "password", s.password.as_ref());
    }

    fn aws_session(&mut self, base: &str, s: &SessionSettings) {
        if let Some(endpoint) = &s.endpoint_url
            && let Err(e) = syntax::http_url(endpoint)
        {
            self.error(format!("{base}.endpoint_url"), e);
        }
        if let Some(region) = &s.region
            && region.trim().is_empty()
        {
            self.error(format!("{base}.region"), "must not be empty");
        }
        if let Some(wait) = s.wait_time
            && (wait.is_zero() || wait > MAX_SQS_WAIT || wait.get().subsec_nanos() != 0)
        {
            self.error(
                format!("{base}.wait_time"),
                format!("must be whole seconds from 1s to 20s, got {wait}"),
            );
        }
        if let Some(vis) = s.visibility_timeout
            && (vis.is_zero() || vis > MAX_SQS_VISIBILITY || vis.get().subsec_nanos() != 0)
        {
            self.error(
                format!("{base}.visibility_timeout"),
                format!("must be whole seconds from 1s to 12h, got {vis}"),
            );
        }
        if let Some(n) = s.max_messages
            && !(1..=10).contains(&n)
        {
            self.error(
                format!("{base}.max_messages"),
                format!("must be from 1 to 10 (SQS's limit), got {n}"),
            );
        }
    }

    /// The transport of session `id`, reporting a dangling reference at `path`.
    fn session_transport(&mut self, path: String, id: &str) -> Option<Transport> {
        match self.index.sessions.get(id) {
            Some(s) => Some(s.transport),
            None => {
                self.error(path, format!("unknown session \"{id}\""));
                None
            }
        }
    }

    pub(super) fn receivers(&mut self) {
        for (i, r) in self.config.receivers.iter().enumerate() {
            let base = format!("receivers[{i}]");
            let Some(transport) =
                self.session_transport(format!("{base}.session_id"), &r.session_id)
            else {
                continue;
            };
            if !transport.is_table() {
                for (key, set) in r.table_keys() {
                    if set {
                        self.error(
                            format!("{base}.{key}"),
                            format!("{key} is for postgres_table and mysql_table receivers; session \"{}\" is {transport}", r.session_id),
                        );
                    }
                }
            }
            match transport {
                Transport::PostgresTable | Transport::MysqlTable => {
                    self.table_receiver(&base, transport, r);
                }
                Transport::Rabbitmq | Transport::Nats => self.error(
                    format!("{base}.session_id"),
                    format!(
                        "session \"{}\" is {transport}, and Ferry only sends to {transport} (a receiver needs an mqtt or sqs session)",
                        r.session_id
                    ),
                ),
                Transport::Mqtt => {
                    if r.queue.is_some() {
                        self.error(
                            format!("{base}.queue"),
                            format!(
                                "queue is for sqs receivers; session \"{}\" is mqtt (use topics)",
                                r.session_id
                            ),
                        );
                    }
                    match &r.topics {
                        None => {
                            self.error(format!("{base}.topics"), "an mqtt receiver needs topics")
                        }
                        Some(t) if t.is_empty() => self.error(
                            format!("{base}.topics"),
                            "an mqtt receiver needs at least one topic",
                        ),
                        Some(topics) => {
                            let mut seen = HashSet::new();
                            for (j, t) in topics.iter().enumerate() {
                                let path = format!("{base}.topics[{j}]");
                                if let Err(e) = syntax::topic_filter(&t.topic) {
                                    self.error(format!("{path}.topic"), e);
                                } else if !seen.insert(t.topic.as_str()) {
                                    self.error(
                                        format!("{path}.topic"),
                                        format!("topic filter \"{}\" is listed twice", t.topic),
                                    );
                                }
                                self.qos(format!("{path}.qos"), t.qos);
                            }
                        }
                    }
                }
                Transport::Sns => self.error(
                    format!("{base}.session_id"),
                    format!(
                        "session \"{}\" is sns, which only publishes: receive from an sqs queue subscribed to the topic",
                        r.session_id
                    ),
                ),
                Transport::Sqs => {
                    if r.trust_message_id {
                        self.error(
                            format!("{base}.trust_message_id"),
                            format!(
                                "trust_message_id is for mqtt receivers; session \"{}\" is sqs",
                                r.session_id
                            ),
                        );
                    }
                    if r.topics.is_some() {
                        self.error(
                            format!("{base}.topics"),
                            format!(
                                "topics are for mqtt receivers; session \"{}\" is sqs (use queue)",
                                r.session_id
                            ),
                        );
                    }
                    match &r.queue {
                        None => self.error(
                            format!("{base}.queue"),
                            "an sqs receiver needs queue (a queue name or URL)",
                        ),
                        Some(q) => {
                            if let Err(e) = syntax::queue_ref(q) {
                                self.error(format!("{base}.queue"), e);
                            }
                        }
                    }
                }
            }
        }
    }

    fn table_receiver(
        &mut self,
        base: &str,
        transport: Transport,
        r: &super::super::transport::Receiver,
    ) {
        for (key, set) in [
            ("topics", r.topics.is_some()),
            ("queue", r.queue.is_some()),
            ("trust_message_id", r.trust_message_id),
        ] {
            if set {
                self.error(
                    format!("{base}.{key}"),
                    format!("{key} is not an option of {transport} receivers (use table)"),
                );
            }
        }
        match &r.table {
            None => self.error(
                format!("{base}.table"),
                format!("a {transport} receiver needs table"),
            ),
            Some(t) => {
                if let Err(e) = syntax::table_name(t) {
                    self.error(format!("{base}.table"), e);
                }
            }
        }
        self.table_columns(base, r);
        for (key, value) in [
            ("poll_interval", r.poll_interval),
            ("claim_ttl", r.claim_ttl),
            ("retry_backoff", r.retry_backoff),
            ("retry_backoff_max", r.retry_backoff_max),
            ("retention", r.retention),
        ] {
            if let Some(d) = value {
                self.positive(format!("{base}.{key}"), d);
            }
        }
        if let (Some(first), Some(max)) = (r.retry_backoff, r.retry_backoff_max)
            && first > max
        {
            self.error(
                format!("{base}.retry_backoff_max"),
                "must not be shorter than retry_backoff",
            );
        }
        if r.batch_size == Some(0) {
            self.error(format!("{base}.batch_size"), "must be at least 1");
        }
        if r.retention.is_some() && r.on_sent == Some(super::super::transport::OnSent::Delete) {
            self.error(
                format!("{base}.retention"),
                "on_sent: delete keeps no sent row to purge",
            );
        }
        if let Some(channel) = &r.notify_channel {
            let path = format!("{base}.notify_channel");
            if transport != Transport::PostgresTable {
                self.error(
                    path,
                    "notify_channel is for postgres_table receivers (LISTEN/NOTIFY)",
                );
            } else if !syntax::identifier(channel) {
                self.error(
                    path,
                    format!("\"{channel}\" is not a channel name (letters, digits and _)"),
                );
            }
        }
    }

    /// The column names (each a plain identifier, no two the same, defaults included) and the
    /// state they describe: `sent_at` or `status` with its two values.
    fn table_columns(&mut self, base: &str, r: &super::super::transport::Receiver) {
        let columns = r.columns.clone().unwrap_or_default();
        let configured = columns.names();
        for (key, name) in configured {
            if let Some(name) = name
                && !syntax::identifier(name)
            {
                self.error(
                    format!("{base}.columns.{key}"),
                    format!("\"{name}\" is not a column name (letters, digits and _, not starting with a digit)"),
                );
            }
        }
        if columns.status.is_some() && columns.sent_at.is_some() {
            self.error(
                format!("{base}.columns.status"),
                "set one of columns.sent_at and columns.status: a row's state is in one of them",
            );
        }
        // The defaults count too: `payload: event` needs `event: null` when the table has no
        // event-type column, or the relay would read that column twice.
        let mut seen: HashMap<String, &str> = HashMap::new();
        for (key, name) in columns.used(r.order_by.unwrap_or_default()) {
            let Some(first) = seen.insert(name.to_ascii_lowercase(), key) else {
                continue;
            };
            let defaulted = [first, key]
                .into_iter()
                .find(|k| configured.iter().any(|(c, n)| c == k && n.is_none()));
            let hint = defaulted.map_or_else(String::new, |k| {
                format!("; columns.{k} defaults to \"{name}\": set it to another name, or to null if the table has no such column")
            });
            self.error(
                format!("{base}.columns.{key}"),
                format!("column \"{name}\" is named twice, as {first} and {key}{hint}"),
            );
        }
        let status = matches!(columns.state(), StateColumn::Status(_));
        for (key, value) in [
            ("pending_status", &r.pending_status),
            ("sent_status", &r.sent_status),
        ] {
            let Some(value) = value else { continue };
            let path = format!("{base}.{key}");
            if !status {
                self.error(path, format!("{key} is for tables with columns.status"));
            } else if value.is_empty()
                || !value
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
            {
                self.error(
                    path,
                    format!("\"{value}\" is not a status value (letters, digits, _, - and .)"),
                );
            }
        }
        if status {
            let pending = r
                .pending_status
                .as_deref()
                .unwrap_or(DEFAULT_PENDING_STATUS);
            let sent = r.sent_status.as_deref().unwrap_or(DEFAULT_SENT_STATUS);
            if pending == sent {
                self.error(
                    format!("{base}.sent_status"),
                    format!("sent_status must differ from pending_status (both \"{sent}\")"),
                );
            }
            if r.retention.is_some() {
                self.error(
                    format!("{base}.retention"),
                    "retention needs a sent_at column (when each row was sent); with columns.status \
                     use on_sent: delete, or purge the rows whose status is sent_status yourself",
                );
            }
        }
    }

    fn qos(&mut self, path: String, qos: u8) {
        if qos > 2 {
            self.error(path, format!("qos must be 0, 1 or 2, got {qos}"));
        }
    }

    pub(super) fn senders(&mut self) {
        for (i, sender) in self.config.senders.iter().enumerate() {
            let base = format!("senders[{i}]");
            let Some(transport) =
                self.session_transport(format!("{base}.session_id"), &sender.session_id)
            else {
                continue;
            };
            let opts = format!("{base}.options.sender");
            let s = &sender.options.sender;
            for (key, set, transports) in sender.keys() {
                if set && !transports.contains(&transport) {
                    self.error(
                        format!("{opts}.{key}"),
                        format!(
                            "{key} is an option of {} senders, and session \"{}\" is {transport}",
                            either(transports),
                            sender.session_id
                        ),
                    );
                }
            }
            match transport {
                Transport::PostgresTable | Transport::MysqlTable => self.error(
                    format!("{base}.session_id"),
                    format!(
                        "session \"{}\" is postgres_table, which Ferry only receives from",
                        sender.session_id
                    ),
                ),
                Transport::Rabbitmq | Transport::Nats => {}
                Transport::Mqtt => {
                    if let Some(qos) = s.qos {
                        self.qos(format!("{opts}.qos"), qos);
                    }
                }
                Transport::Sqs => {
                    let name = match (&s.queue_url, &s.queue_name) {
                        (None, None) => {
                            self.error(
                                opts.clone(),
                                "an sqs sender needs queue_url or queue_name (the queue it is pinned to)",
                            );
                            None
                        }
                        (Some(_), Some(_)) => {
                            self.error(
                                format!("{opts}.queue_name"),
                                "set queue_url or queue_name, not both",
                            );
                            None
                        }
                        (Some(u), None) => match syntax::queue_url(u) {
                            Ok(name) => Some(name),
                            Err(e) => {
                                self.error(format!("{opts}.queue_url"), e);
                                None
                            }
                        },
                        (None, Some(n)) => match syntax::queue_name(n) {
                            Ok(()) => Some(n.as_str()),
                            Err(e) => {
                                self.error(format!("{opts}.queue_name"), e);
                                None
                            }
                        },
                    };
                    if let Some(name) = name {
                        self.group_id(&opts, s.message_group_id.as_deref(), "queue", name);
                        if let Some(delay) = s.delay_seconds {
                            if name.ends_with(".fifo") {
                                self.error(
                                    format!("{opts}.delay_seconds"),
                                    "a FIFO queue takes no per-message delay (set DelaySeconds on the queue)",
                                );
                            } else if delay > MAX_SQS_DELAY || delay.get().subsec_nanos() != 0 {
                                self.error(
                                    format!("{opts}.delay_seconds"),
                                    format!("must be whole seconds from 0s to 15m, got {delay}"),
                                );
                            }
                        }
                    }
                }
                Transport::Sns => {
                    let name = match (&s.topic_arn, &s.topic_name) {
                        (None, None) => {
                            self.error(
                                opts.clone(),
                                "an sns sender needs topic_arn or topic_name (the topic it is pinned to)",
                            );
                            None
                        }
                        (Some(_), Some(_)) => {
                            self.error(
                                format!("{opts}.topic_name"),
                                "set topic_arn or topic_name, not both",
                            );
                            None
                        }
                        (Some(a), None) => match syntax::topic_arn(a) {
                            Ok(name) => Some(name),
                            Err(e) => {
                                self.error(format!("{opts}.topic_arn"), e);
                                None
                            }
                        },
                        (None, Some(n)) => match syntax::sns_topic_name(n) {
                            Ok(()) => Some(n.as_str()),
                            Err(e) => {
                                self.error(format!("{opts}.topic_name"), e);
                                None
                            }
                        },
                    };
                    if let Some(name) = name {
                        self.group_id(&opts, s.message_group_id.as_deref(), "topic", name);
                    }
                }
            }
        }
    }

    /// `message_group_id` is required for a FIFO queue or topic and refused for a standard one.
    fn group_id(&mut self, opts: &str, group: Option<&str>, what: &str, name: &str) {
        match (name.ends_with(".fifo"), group) {
            (true, None) => self.error(
                format!("{opts}.message_group_id"),
                format!("{what} \"{name}\" is FIFO: set message_group_id (a fixed id or {{header:NAME}})"),
            ),
            (false, Some(_)) => self.error(
                format!("{opts}.message_group_id"),
                format!("{what} \"{name}\" is not FIFO (its name does not end in .fifo): message_group_id applies to FIFO {what}s only"),
            ),
            (true, Some(g)) => {
                if let Err(e) = syntax::group_id(g) {
                    self.error(format!("{opts}.message_group_id"), e);
                }
            }
            (false, None) => {}
        }
    }

    pub(super) fn bindings(&mut self) {
        for (i, b) in self.config.bindings.iter().enumerate() {
            let base = format!("bindings[{i}]");
            let Some(sender) = self.index.senders.get(b.sender_id.as_str()).copied() else {
                self.error(
                    format!("{base}.sender_id"),
                    format!("unknown sender \"{}\"", b.sender_id),
                );
                continue;
            };
            let Some(session) = self.index.sessions.get(sender.session_id.as_str()).copied() else {
                continue; // reported on the sender
            };
            let path = format!("{base}.address");
            let template = match AddressTemplate::parse(&b.address) {
                Ok(t) => t,
                Err(e) => {
                    self.error(path, e.to_string());
                    continue;
                }
            };
            // The literal parts of a template must already have the transport's shape.
            let sample = template.sample();
            let shape = match session.transport {
                Transport::Mqtt => syntax::publish_topic(&sample),
                Transport::Sqs | Transport::Sns if template.is_template() => Err(format!(
                    "an {} binding address is its sender's {} and cannot name headers",
                    session.transport,
                    if session.transport == Transport::Sqs {
                        "queue"
                    } else {
                        "topic"
                    }
                )),
                Transport::Sqs => sqs_address(sender, &b.address),
                Transport::Sns => sns_address(sender, &b.address),
                Transport::Rabbitmq => amqp_address(&sample).map(|_| ()),
                Transport::Nats => nats_subject(&sample),
                // Reported on the sender: Ferry does not send to a table.
                Transport::PostgresTable | Transport::MysqlTable => Ok(()),
            };
            if let Err(e) = shape {
                self.error(path, e);
            }
        }
    }
}

/// An SQS binding address is its sender's queue: the bare name or the URL.
fn sqs_address(sender: &Sender, address: &str) -> Result<(), String> {
    let s = &sender.options.sender;
    // The sender's own queue settings are checked (and reported) on the sender.
    let (url, name) = match (&s.queue_url, &s.queue_name) {
        (Some(u), _) => match syntax::queue_url(u) {
            Ok(name) => (Some(u.trim_end_matches('/')), name),
            Err(_) => return Ok(()),
        },
        (None, Some(n)) => (None, n.as_str()),
        (None, None) => return Ok(()),
    };
    let matches = if syntax::looks_like_url(address) {
        match url {
            Some(u) => address.trim_end_matches('/') == u,
            None => syntax::queue_url(address).is_ok_and(|n| n == name),
        }
    } else {
        address == name
    };
    if matches {
        Ok(())
    } else {
        let pinned = match url {
            Some(u) => format!("queue_url \"{u}\""),
            None => format!("queue_name \"{name}\""),
        };
        Err(format!(
            "\"{address}\" is not the queue of sender \"{}\" ({pinned}); an sqs binding address is that queue's bare name \"{name}\" or its URL",
            sender.id
        ))
    }
}

/// An SNS binding address is its sender's topic: the bare name or the ARN.
fn sns_address(sender: &Sender, address: &str) -> Result<(), String> {
    let s = &sender.options.sender;
    // The sender's own topic settings are checked (and reported) on the sender.
    let (arn, name) = match (&s.topic_arn, &s.topic_name) {
        (Some(a), _) => match syntax::topic_arn(a) {
            Ok(name) => (Some(a.as_str()), name),
            Err(_) => return Ok(()),
        },
        (None, Some(n)) => (None, n.as_str()),
        (None, None) => return Ok(()),
    };
    let matches = if address.starts_with("arn:") {
        match arn {
            Some(a) => address == a,
            None => syntax::topic_arn(address).is_ok_and(|n| n == name),
        }
    } else {
        address == name
    };
    if matches {
        Ok(())
    } else {
        let pinned = match arn {
            Some(a) => format!("topic_arn \"{a}\""),
            None => format!("topic_name \"{name}\""),
        };
        Err(format!(
            "\"{address}\" is not the topic of sender \"{}\" ({pinned}); an sns binding address is that topic's bare name \"{name}\" or its ARN",
            sender.id
        ))
    }
}
