//! Outbox-table receivers (`transport: postgres_table`, `mysql_table`): Ferry as the relay of an
//! application's transactional outbox (the table of `shared/seeds/004`, which seed 002's
//! `outbox_events` also fits with renamed columns).
//!
//! # Design
//!
//! The relay is split in two. [`relay`] is the dialect-independent core: the claim → deliver →
//! settle loop, per-aggregate order, the retry policy, leases and the purge. A [`Dialect`]
//! (`postgres`, `mysql`) is only the SQL of five operations on one connection: claim, settle,
//! extend, purge, and wait for a wake-up (PostgreSQL `LISTEN`; MySQL has none). The column names
//! come from [`Columns`] (seed 004's by default), validated as plain identifiers before they are
//! written into a statement.
//!
//! # Invariants
//!
//! - **A claim is a lease written into the row.** In one short transaction the relay locks the
//!   claimable rows with `SELECT … FOR UPDATE SKIP LOCKED` and pushes their `retry_at` to
//!   `now + claim_ttl` (database clock), then commits. A row is claimable when `sent_at` is null
//!   and `retry_at` is null or past, so another agent skips it both while it is locked and while
//!   its lease runs. While the row is in flight the lease is extended every third of
//!   `claim_ttl`; if the agent dies the extensions stop and the row is claimable again after at
//!   most `claim_ttl` (at least once). Nothing depends on "ids above the last one seen"
//!   (sequence ids commit out of order, which would skip rows forever). Why not hold the row
//!   locks for the whole delivery (the first version did): a transaction can only commit when
//!   every row it locked is settled, so one slow row (a long retry) held back the `sent_at` of
//!   its whole batch and, with it, every other aggregate.
//! - **Per-aggregate order: only head rows are claimed.** A row is claimable only if no row with
//!   the same `aggregate_id` and a smaller id is still unsent (a non-locking read of each
//!   aggregate's first unsent row just before the claim transaction; the locking read then
//!   re-checks that each row is still unsent and due). So at most one row per aggregate is in
//!   flight anywhere, the next one becomes claimable only after the previous one was marked
//!   sent (or dead-lettered), and a row that failed and waits for its `retry_at` holds back its
//!   aggregate, and only its aggregate. A second agent that finds the head locked or leased by
//!   the first skips the whole aggregate (its later rows are not heads). The price: one
//!   aggregate moves one row per round trip (send + mark); many aggregates move in parallel up
//!   to `batch_size`. Rows whose `aggregate_id` is null or empty have no order and are all
//!   claimable at once. (The alternative, claiming several rows of an aggregate and stopping at
//!   the first failure inside a batch, cannot keep order through the route's concurrent sends:
//!   a retried row would be overtaken by the next one.) Order holds for rows an application
//!   commits in id order per aggregate, which it does when it serializes writes to one
//!   aggregate (it locks the aggregate's business row).
//! - **Settle.** A delivery settled with an acknowledging outcome (sent, persisted in Ferry's
//!   outbox, dead-lettered, filtered …) gets `sent_at = now()` (or is deleted, `on_sent:
//!   delete`). [`Outcome::Failed`] (a transient failure the route gave up on, see
//!   [`Delivery::source_retries`]) and the other unacknowledged outcomes except shutdown count a
//!   retry: `retry_count + 1` and `retry_at = now + retry_backoff × 2^(retry_count)`, capped at
//!   `retry_backoff_max`. Shutdown releases the lease (`retry_at = null`) without counting.
//!   Settles that cannot be written (connection lost) are kept and written after reconnecting.
//! - **Retries end in the DLQ.** A row claimed with `retry_count >= max_retries` is delivered
//!   with [`Defect::RetriesExhausted`]: the route dead-letters it (or drops it, per
//!   `on_permanent_failure`) and the row is marked sent, so it stops blocking its aggregate. A
//!   permanent error (e.g. an address template naming a missing header) is dead-lettered by the
//!   route at once.
//! - **Back-pressure:** at most `batch_size` rows are in flight; the delivery channel has that
//!   capacity, so handing out a claimed row never waits.
//! - **Purge:** with `retention`, rows sent longer ago are deleted in slices, periodically.
//! - Each message's id is `TABLE:ID`, stable across claims, so a consumer (or JetStream's
//!   `Nats-Msg-Id`) can drop the copy a re-claim after a crash produces; `aggregate_type`,
//!   `aggregate_id` and `event` become headers (`orders.{header:aggregate_id}`).
//!
//! [`Outcome::Failed`]: crate::transports::Outcome::Failed
//! [`Delivery::source_retries`]: crate::transports::Delivery::source_retries
//! [`Defect::RetriesExhausted`]: crate::transports::Defect::RetriesExhausted

mod mysql;
mod postgres;
mod relay;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ferry_shared::config::{OnSent, Secret};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::transports::{Delivery, Receiver, RecvFuture, Session};

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

/// The table's column names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Columns {
    /// Integer id, ascending in insert order.
    pub id: String,
    /// Header `aggregate_type`.
    pub aggregate_type: String,
    /// The ordering key, header `aggregate_id`.
    pub aggregate_id: String,
    /// Header `event`.
    pub event: String,
    /// The body.
    pub payload: String,
    /// Null until relayed.
    pub sent_at: String,
    /// Failed deliveries.
    pub retry_count: String,
    /// Not claimed before.
    pub retry_at: String,
}

impl Default for Columns {
    /// Seed 004's names.
    fn default() -> Self {
        Self {
            id: "id".into(),
            aggregate_type: "aggregate_type".into(),
            aggregate_id: "aggregate_id".into(),
            event: "event".into(),
            payload: "payload".into(),
            sent_at: "sent_at".into(),
            retry_count: "retry_count".into(),
            retry_at: "retry_at".into(),
        }
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
}
