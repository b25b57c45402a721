//! Outbox-table receivers (`transport: postgres_table`, `mysql_table`): Ferry as the relay of an
//! application's transactional outbox (the table of `shared/seeds/004` by default; seed 002's
//! `outbox_events` with `columns.status`, `order_by: created_at` and its UUID ids).
//!
//! # Design
//!
//! The relay is split in two. [`relay`] is the dialect-independent core: the claim → deliver →
//! settle loop, per-aggregate order, the retry policy, leases and the purge. A [`Dialect`]
//! (`postgres`, `mysql`) is only the SQL of five operations on one connection: claim, settle,
//! extend, purge, and wait for a wake-up (PostgreSQL `LISTEN`; MySQL has none). The column names
//! come from [`Columns`] (seed 004's by default), validated as plain identifiers before they are
//! written into a statement; [`Columns`] also writes the SQL both dialects share (what is
//! unsent, how a row is marked, the claim order) and checks at connect that the table has
//! every column (the error names the table and the column). Ids are text in the relay (an
//! integer's digits or a UUID); each dialect binds them back in the id column's type.
//!
//! # Invariants
//!
//! - **A claim is a lease written into the row.** In one short transaction the relay locks the
//!   claimable rows with `SELECT … FOR UPDATE SKIP LOCKED` and pushes their `retry_at` to `now +
//!   claim_ttl` (database clock), then commits. A row is claimable when it is *unsent* (`sent_at`
//!   null, or `status` = `pending_status`) and `retry_at` is null or past, so another agent skips
//!   it both while it is locked and while its lease runs. While the row is in flight the lease is
//!   extended every third of `claim_ttl`; if the agent dies the extensions stop and the row is
//!   claimable again after at most `claim_ttl` (at least once). Nothing depends on "ids above the
//!   last one seen" (sequence ids commit out of order, which would skip rows forever). Why not hold
//!   the row locks for the whole delivery (the first version did): a transaction can only commit
//!   when every row it locked is settled, so one slow row (a long retry) held back the `sent_at` of
//!   its whole batch and, with it, every other aggregate.
//! - **Per-aggregate order: only head rows are claimed.** A row is claimable only if no row with
//!   the same `aggregate_id` earlier in the claim order (id, or `(created_at, id)` with `order_by:
//!   created_at`) is still unsent (a non-locking read of each aggregate's first unsent row just
//!   before the claim transaction; the locking read then re-checks that each row is still unsent
//!   and due). So at most one row per aggregate is in flight anywhere, the next one becomes
//!   claimable only after the previous one was marked sent (or dead-lettered), and a row that
//!   failed and waits for its `retry_at` holds back its aggregate, and only its aggregate. A second
//!   agent that finds the head locked or leased by the first skips the whole aggregate (its later
//!   rows are not heads). The price: one aggregate moves one row per round trip (send + mark); many
//!   aggregates move in parallel up to `batch_size`. Rows whose `aggregate_id` is null or empty (or
//!   a table without that column) have no order and are all claimable at once. (The alternative,
//!   claiming several rows of an aggregate and stopping at the first failure inside a batch, cannot
//!   keep order through the route's concurrent sends: a retried row would be overtaken by the next
//!   one.) Order holds for rows an application commits in claim order per aggregate, which it does
//!   when it serializes writes to one aggregate (it locks the aggregate's business row).
//! - **Settle.** A delivery settled with an acknowledging outcome (sent, persisted in Ferry's
//!   outbox, dead-lettered, filtered …) gets `sent_at = now()` or `status = sent_status` (or is
//!   deleted, `on_sent: delete`). [`Outcome::Failed`] (a transient failure the route gave up on,
//!   see [`Delivery::source_retries`]) and the other unacknowledged outcomes except shutdown count
//!   a retry: `retry_count + 1` and `retry_at = now + retry_backoff × 2^(retry_count)`, capped at
//!   `retry_backoff_max`. Shutdown releases the lease (`retry_at = null`) without counting. Settles
//!   that cannot be written (connection lost) are kept and written after reconnecting.
//! - **Retries end in the DLQ.** A row claimed with `retry_count >= max_retries` is delivered with
//!   [`Defect::RetriesExhausted`]: the route dead-letters it (or drops it, per
//!   `on_permanent_failure`) and the row is marked sent, so it stops blocking its aggregate. A
//!   permanent error (e.g. an address template naming a missing header) is dead-lettered by the
//!   route at once.
//! - **Back-pressure:** at most `batch_size` rows are in flight; the delivery channel has that
//!   capacity, so handing out a claimed row never waits.
//! - **Purge:** with `retention`, rows sent longer ago are deleted in slices, periodically (only
//!   with `sent_at`: a status holds no time, and the validator refuses `retention` then).
//! - Each message's id is `TABLE:ID`, stable across claims, so a consumer (or JetStream's
//!   `Nats-Msg-Id`) can drop the copy a re-claim after a crash produces; `aggregate_type`,
//!   `aggregate_id` and `event` become headers (`orders.{header:aggregate_id}`), then those of
//!   the `headers` column if mapped. A `headers` value that is not a JSON object of strings is
//!   delivered with [`Defect::InvalidHeaders`]: the same on every claim, so dead-lettered at once
//!   rather than retried.
//!
//! [`Outcome::Failed`]: crate::transports::Outcome::Failed
//! [`Delivery::source_retries`]: crate::transports::Delivery::source_retries
//! [`Defect::RetriesExhausted`]: crate::transports::Defect::RetriesExhausted
//! [`Defect::InvalidHeaders`]: crate::transports::Defect::InvalidHeaders

mod mysql;
mod postgres;
mod relay;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ferry_shared::config::{
    DEFAULT_PENDING_STATUS, DEFAULT_SENT_STATUS, OnSent, OrderBy, Secret, StateColumn, TableColumns,
};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::transports::{Delivery, Receiver, RecvFuture, Session};
use relay::DbError;

/// Which database, and how to reach it.
#[derive(Clone, Debug)]
pub enum Database {
    /// `postgres://host[:port]/db[?sslmode=…]`.
    Postgres,
    /// `mysql://host[:port]/db[?require_ssl=…]` (MySQL 8 or MariaDB 10.6+).
    Mysql,
}

/// An outbox-table session's and receiver's settings.
#[derive(Clone, Debug)]
pub struct TableSettings {
    /// The session id, for logs and the envelopes' source.
    pub name: String,
    /// The database kind.
    pub database: Database,
    /// The URL, without credentials.
    pub url: String,
    /// User name.
    pub username: Option<String>,
    /// Password.
    pub password: Option<Secret>,
    /// PEM CA certificates to trust for TLS instead of the default roots.
    pub ca_file: Option<PathBuf>,
    /// The table (`name` or `schema.name`, validated as plain identifiers).
    pub table: String,
    /// The column names (validated as plain identifiers).
    pub columns: Columns,
    /// Wait after a claim that found no row.
    pub poll_interval: Duration,
    /// The most rows in flight at once.
    pub batch_size: u32,
    /// How long a claim reserves a row.
    pub claim_ttl: Duration,
    /// Failed deliveries before a row is dead-lettered.
    pub max_retries: u32,
    /// The first retry delay.
    pub retry_backoff: Duration,
    /// The longest retry delay.
    pub retry_backoff_max: Duration,
    /// Mark or delete settled rows.
    pub on_sent: OnSent,
    /// Delete rows sent longer ago than this.
    pub retention: Option<Duration>,
    /// PostgreSQL: the channel to `LISTEN` on.
    pub notify_channel: Option<String>,
}

impl TableSettings {
    /// The transport name, for envelopes and logs.
    pub fn transport(&self) -> &'static str {
        match self.database {
            Database::Postgres => "postgres_table",
            Database::Mysql => "mysql_table",
        }
    }

    /// The delay before the retry that follows failure number `retry_count + 1`.
    pub fn retry_delay(&self, retry_count: u32) -> Duration {
        self.retry_backoff
            .checked_mul(1u32 << retry_count.min(30))
            .map_or(self.retry_backoff_max, |d| d.min(self.retry_backoff_max))
    }
}

/// The table's column names, and how a row's state is kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Columns {
    /// The id: an integer, or text such as a UUID.
    pub id: String,
    /// Header `aggregate_type`, if the table has it.
    pub aggregate_type: Option<String>,
    /// The ordering key, header `aggregate_id`; without it every row is independent.
    pub aggregate_id: Option<String>,
    /// Header `event`, if the table has it.
    pub event: Option<String>,
    /// The body.
    pub payload: String,
    /// Relayed or not.
    pub state: State,
    /// Failed deliveries.
    pub retry_count: String,
    /// Not claimed before.
    pub retry_at: String,
    /// Rows go out in `(created_at, id)` order when set, in id order otherwise.
    pub created_at: Option<String>,
    /// A JSON object of string values, the message's headers, if the table has it.
    pub headers: Option<String>,
    /// `(config key, name)` of every column above, for the check at connect.
    used: Vec<(&'static str, String)>,
}

/// Where a row's state is kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// Null until relayed, then the time it was (seed 004).
    SentAt(String),
    /// `pending` until relayed, then `sent` (seed 002); values validated as letters, digits,
    /// `_`, `-` and `.`.
    Status {
        /// The column.
        column: String,
        /// A row still to relay.
        pending: String,
        /// A relayed row.
        sent: String,
    },
}

impl Columns {
    /// The configured names over the defaults (`ferry_shared::config::TableColumns`).
    pub fn new(
        names: &TableColumns,
        order_by: OrderBy,
        pending_status: Option<&str>,
        sent_status: Option<&str>,
    ) -> Self {
        let state = match names.state() {
            StateColumn::SentAt(column) => State::SentAt(column.to_owned()),
            StateColumn::Status(column) => State::Status {
                column: column.to_owned(),
                pending: pending_status.unwrap_or(DEFAULT_PENDING_STATUS).to_owned(),
                sent: sent_status.unwrap_or(DEFAULT_SENT_STATUS).to_owned(),
            },
        };
        Self {
            id: names.id().to_owned(),
            aggregate_type: names.aggregate_type().map(str::to_owned),
            aggregate_id: names.aggregate_id().map(str::to_owned),
            event: names.event().map(str::to_owned),
            payload: names.payload().to_owned(),
            state,
            retry_count: names.retry_count().to_owned(),
            retry_at: names.retry_at().to_owned(),
            created_at: names.created_at(order_by).map(str::to_owned),
            headers: names.headers.clone(),
            used: names
                .used(order_by)
                .into_iter()
                .map(|(key, name)| (key, name.to_owned()))
                .collect(),
        }
    }

    /// SQL: the row is still to relay.
    fn unsent(&self) -> String {
        match &self.state {
            State::SentAt(column) => format!("{column} IS NULL"),
            State::Status {
                column, pending, ..
            } => format!("{column} = '{pending}'"),
        }
    }

    /// SQL assignment: the row is relayed, at `now` (the dialect's clock).
    fn mark_sent(&self, now: &str) -> String {
        match &self.state {
            State::SentAt(column) => format!("{column} = {now}"),
            State::Status { column, sent, .. } => format!("{column} = '{sent}'"),
        }
    }

    /// The column that says when a row was relayed, for the purge (the validator refuses
    /// `retention` without one).
    fn sent_at(&self) -> Option<&str> {
        match &self.state {
            State::SentAt(column) => Some(column),
            State::Status { .. } => None,
        }
    }

    /// The claim order: `created_at, id` or `id`, each column named through `name`.
    fn order(&self, name: impl Fn(&str) -> String) -> String {
        match &self.created_at {
            Some(created_at) => format!("{}, {}", name(created_at), name(&self.id)),
            None => name(&self.id),
        }
    }

    /// Checks that the table has every column this relay reads or writes, given the table's
    /// `(column, type)` list (names compared ignoring case: they are written unquoted, so both
    /// databases fold them). Returns the id column's type. The errors name the table and
    /// the column, so a missing migration is plain at start instead of a failing claim.
    fn check(&self, table: &str, found: &[(String, String)]) -> Result<String, DbError> {
        if found.is_empty() {
            return Err(DbError(format!(
                "table {table} does not exist (or its columns are not visible to this user)"
            )));
        }
        let type_of = |name: &str| {
            found
                .iter()
                .find(|(column, _)| column.eq_ignore_ascii_case(name))
                .map(|(_, kind)| kind.clone())
        };
        for (key, name) in &self.used {
            if type_of(name).is_none() {
                return Err(DbError(format!(
                    "table {table} has no column {name} (columns.{key}); add it or map \
                     columns.{key} to another column (docs/configuration.md, outbox tables)"
                )));
            }
        }
        type_of(&self.id).ok_or_else(|| DbError(format!("table {table} has no column {}", self.id)))
    }
}

impl Default for Columns {
    /// Seed 004's names.
    fn default() -> Self {
        Self::new(&TableColumns::default(), OrderBy::Id, None, None)
    }
}

/// One outbox-table session with its receiver's task.
#[derive(Debug)]
pub struct TableSession {
    connected: watch::Receiver<bool>,
    reconnects: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

/// Yields the claimed rows as deliveries.
#[derive(Debug)]
pub struct TableReceiver {
    deliveries: mpsc::Receiver<Delivery>,
}

impl TableSession {
    /// Starts claiming rows in the background until `shutdown` fires. Must be called inside a
    /// Tokio runtime.
    pub fn start(settings: TableSettings, shutdown: CancellationToken) -> (Self, TableReceiver) {
        let (connected_tx, connected) = watch::channel(false);
        let reconnects = Arc::new(AtomicU64::new(0));
        let capacity = usize::try_from(settings.batch_size).unwrap_or(1).max(1);
        let (tx, deliveries) = mpsc::channel(capacity);
        let link = relay::Link {
            deliveries: tx,
            connected: connected_tx,
            reconnects: Arc::clone(&reconnects),
            shutdown,
        };
        let task = match settings.database {
            Database::Postgres => tokio::spawn(relay::run::<postgres::Postgres>(settings, link)),
            Database::Mysql => tokio::spawn(relay::run::<mysql::Mysql>(settings, link)),
        };
        (
            Self {
                connected,
                reconnects,
                task,
            },
            TableReceiver { deliveries },
        )
    }

    /// Resolves once the task has stopped (after the token fired).
    pub async fn stopped(self) {
        if let Err(e) = self.task.await {
            tracing::warn!(error = %e, "the outbox-table session task failed");
        }
    }
}

impl Session for TableSession {
    fn connected(&self) -> watch::Receiver<bool> {
        self.connected.clone()
    }

    fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::Relaxed)
    }
}

impl Receiver for TableReceiver {
    fn recv(&mut self) -> RecvFuture<'_> {
        Box::pin(self.deliveries.recv())
    }
}

#[cfg(test)]
impl TableSettings {
    /// A PostgreSQL table's settings for unit tests: 3 retries, backoff from 1 s to 10 s.
    pub(crate) fn for_tests() -> Self {
        TableSettings {
            name: "db".into(),
            database: Database::Postgres,
            url: "postgres://h/db".into(),
            username: None,
            password: None,
            ca_file: None,
            table: "outbox".into(),
            columns: Columns::default(),
            poll_interval: Duration::from_secs(1),
            batch_size: 1,
            claim_ttl: Duration::from_secs(30),
            max_retries: 3,
            retry_backoff: Duration::from_secs(1),
            retry_backoff_max: Duration::from_secs(10),
            on_sent: OnSent::Mark,
            retention: None,
            notify_channel: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays_double_up_to_the_cap() {
        let s = TableSettings::for_tests();
        let delays: Vec<u64> = (0..6).map(|n| s.retry_delay(n).as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 8, 10, 10]);
        assert_eq!(s.retry_delay(u32::MAX), Duration::from_secs(10));
    }

    /// Seed 002's `outbox_events`, mapped: a status column, no aggregate columns.
    fn seed_002() -> Columns {
        let names = TableColumns {
            payload: Some("event".into()),
            event: Some(None),
            aggregate_type: Some(None),
            aggregate_id: Some(None),
            status: Some("status".into()),
            ..TableColumns::default()
        };
        Columns::new(&names, OrderBy::CreatedAt, None, Some("done"))
    }

    #[test]
    fn a_status_column_decides_what_is_unsent_and_how_a_row_is_marked() {
        let c = seed_002();
        assert_eq!(c.unsent(), "status = 'pending'");
        assert_eq!(c.mark_sent("now()"), "status = 'done'");
        assert_eq!(c.sent_at(), None, "no time to purge by");
        assert_eq!(c.order(|k| format!("h.{k}")), "h.created_at, h.id");
        let d = Columns::default();
        assert_eq!(d.unsent(), "sent_at IS NULL");
        assert_eq!(d.mark_sent("NOW(6)"), "sent_at = NOW(6)");
        assert_eq!(d.sent_at(), Some("sent_at"));
        assert_eq!(d.order(str::to_owned), "id");
    }

    /// The check at connect names the table and the missing column (seed 002's table without
    /// the retry columns), and returns the id's type.
    #[test]
    fn a_missing_column_is_named_with_its_table() {
        let c = seed_002();
        let found = |names: &[&str]| -> Vec<(String, String)> {
            names
                .iter()
                .map(|n| ((*n).to_owned(), "uuid".to_owned()))
                .collect()
        };
        let seed = found(&["ID", "event", "status", "created_at"]);
        let error = c
            .check("outbox_events", &seed)
            .expect_err("no retry_count")
            .0;
        assert!(
            error.contains("table outbox_events has no column retry_count (columns.retry_count)"),
            "{error}"
        );
        let error = c.check("outbox_events", &[]).expect_err("no table").0;
        assert!(
            error.contains("table outbox_events does not exist"),
            "{error}"
        );
        let migrated = found(&[
            "id",
            "event",
            "status",
            "created_at",
            "retry_count",
            "retry_at",
        ]);
        assert_eq!(
            c.check("outbox_events", &migrated).expect("all there"),
            "uuid"
        );
    }
}
