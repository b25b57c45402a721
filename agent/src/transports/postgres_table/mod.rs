//! Outbox-table receiver for PostgreSQL (`transport: postgres_table`): Ferry as the relay of an
//! application's transactional outbox (the table of `shared/seeds/004`, which seed 002's
//! `outbox_events` also fits).
//!
//! The application inserts a row per event in the transaction of its business write; the table
//! has the columns `id` (bigint, ascending), `aggregate_type`, `aggregate_id`, `event`,
//! `payload` (json, jsonb or text) and `sent_at` (timestamp, null until relayed). The session
//! task claims and settles rows:
//!
//! - **claim**: in one transaction, `SELECT … WHERE sent_at IS NULL ORDER BY id LIMIT n FOR
//!   UPDATE SKIP LOCKED`. The row locks are the claim: another agent relaying the same table
//!   skips the locked rows and takes the next ones, and a claim never depends on "ids above the
//!   last one seen" (sequence ids commit out of order, which would skip rows forever);
//! - **deliver**: one delivery per row, in id order; its envelope's id is `TABLE:ID`, stable
//!   across claims, so a consumer (or JetStream's `Nats-Msg-Id`) can drop the copy a re-claim
//!   after a crash produces; `aggregate_type`, `aggregate_id` and `event` become headers (so an
//!   address can name them: `orders.{header:aggregate_id}`);
//! - **settle**: once every delivery of the batch is settled, the rows whose outcome
//!   acknowledges (sent, persisted in Ferry's outbox, dead-lettered …) get `sent_at = now()` and
//!   the transaction commits; the others are left as they were and are claimed again on a later
//!   poll. If the agent dies, its connection closes, PostgreSQL releases the locks, and the rows
//!   are claimed again (at least once).
//!
//! A batch that found no row waits `poll_interval` before the next claim. A lost connection is
//! retried with backoff and reported on the connected watch. Not yet: per-aggregate order
//! across batches, retry columns, LISTEN/NOTIFY, purging sent rows, TLS.

mod claim;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ferry_shared::config::Secret;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::transports::{Delivery, Receiver, RecvFuture, Session};

/// An outbox-table session's and receiver's settings.
#[derive(Clone, Debug)]
pub struct TableSettings {
    /// The session id, for logs and the envelopes' source.
    pub name: String,
    /// Host, port and database.
    pub host: String,
    /// The port.
    pub port: u16,
    /// The database.
    pub database: String,
    /// User name.
    pub username: Option<String>,
    /// Password.
    pub password: Option<Secret>,
    /// The table (`name` or `schema.name`, validated as plain identifiers).
    pub table: String,
    /// Wait after a claim that found no row.
    pub poll_interval: Duration,
    /// The most rows claimed at once.
    pub batch_size: u32,
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
        let task = tokio::spawn(claim::run(
            settings,
            tx,
            connected_tx,
            Arc::clone(&reconnects),
            shutdown,
        ));
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
            tracing::warn!(error = %e, "the postgres_table session task failed");
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
