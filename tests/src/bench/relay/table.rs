//! The application's side of the relay benchmark: the outbox table and the writers that fill it.
//!
//! The table is seed 004's (`id`, `aggregate_type`, `aggregate_id`, `event`, `payload`,
//! `created_at`, `sent_at`, and the retry columns `retry_count`, `retry_at` the relay keeps its
//! claims and retries in), with seed 002's partial index on the pending rows, in a fresh
//! database per run. `payload` is `text` (the `postgres_table` receiver reads json, jsonb or
//! text) holding the benchmark's own payload ([`payload::encode`]): the row's number and the
//! clock time at which its INSERT was sent, so a consumer computes commit-to-delivery latency.
//! Each row is its own autocommit INSERT, so the stamp is taken just before the row's
//! transaction is sent: the latency includes the commit itself.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_postgres::Client;

use crate::TestDatabase;
use crate::bench::payload::{self, Clock, PAYLOAD_BYTES};
use crate::bench::publisher::due_by;

/// The outbox table's name.
pub const TABLE: &str = "outbox";

/// The table, as an application following seeds 002 and 004 would create it.
const DDL: &str = "CREATE TABLE outbox (
        id bigserial PRIMARY KEY,
        aggregate_type text NOT NULL,
        aggregate_id text NOT NULL,
        event text NOT NULL,
        payload text NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        retry_count int,
        retry_at timestamptz,
        sent_at timestamptz);
    CREATE INDEX outbox_pending ON outbox (id) WHERE sent_at IS NULL";

/// Rows go to this many aggregates (`a0` … `a255`), in turn: the relay keeps one row per
/// aggregate in flight (per-aggregate order), so this is how many rows can be in flight.
const AGGREGATES: u64 = 256;

/// Connections the paced writer spreads its INSERTs over: one commit at a time each, so a slow
/// fsync holds back only the rows queued behind it on its own connection.
const WRITERS: u64 = 8;

const INSERT: &str = "INSERT INTO outbox (aggregate_type, aggregate_id, event, payload)
    VALUES ('orders', 'a' || ($1::bigint % $2::bigint), 'created', $3)";

/// Creates the outbox table in `database`; returns the application's connection.
pub async fn create(database: &TestDatabase) -> anyhow::Result<Client> {
    let client = database.connect().await?;
    client
        .batch_execute(DDL)
        .await
        .context("creating the outbox table")?;
    Ok(client)
}

/// Inserts one warm-up probe row ([`payload::PROBE`]).
pub async fn insert_probe(client: &Client) -> anyhow::Result<()> {
    let probe = String::from_utf8_lossy(payload::PROBE).into_owned();
    client
        .execute(INSERT, &[&0_i64, &1_i64, &probe])
        .await
        .context("inserting a probe row")?;
    Ok(())
}

/// Inserts rows `0..rows` in one transaction (one statement), stamped with the time it was
/// sent; returns the clock time at which the commit returned (when every row became visible).
pub async fn prefill(client: &Client, rows: u64, clock: Clock) -> anyhow::Result<u64> {
    let last = i64::try_from(rows).context("too many rows")? - 1;
    let width = i32::try_from(PAYLOAD_BYTES).context("payload size")?;
    let aggregates = i64::try_from(AGGREGATES).context("aggregates")?;
    let stamp = i64::try_from(clock.now_ns()).context("clock")?;
    // The payload of `payload::encode`: "{seq} {stamp}\n" padded with '.' to its size.
    client
        .execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event, payload)
             SELECT 'orders', 'a' || (i % $2), 'created',
                    rpad(i || ' ' || $3::bigint || chr(10), $4, '.')
             FROM generate_series(0, $1::bigint) AS i",
            &[&last, &aggregates, &stamp, &width],
        )
        .await
        .context("pre-filling the outbox table")?;
    Ok(clock.now_ns())
}

/// Writes rows `0..rows` at `rate` per second, each its own transaction, spread over
/// [`WRITERS`] connections to `database`; returns once every INSERT has committed.
pub async fn write_paced(
    database: &TestDatabase,
    rows: u64,
    rate: u32,
    clock: Clock,
) -> anyhow::Result<()> {
    const TICK: Duration = Duration::from_millis(1);
    let mut writers = JoinSet::new();
    let mut queues = Vec::new();
    for _ in 0..WRITERS {
        let client = Arc::new(database.connect().await?);
        // Unbounded in effect: a writer behind its schedule is measured, not throttled.
        let (tx, mut rx) = mpsc::channel::<u64>(usize::try_from(rows).unwrap_or(usize::MAX).max(1));
        queues.push(tx);
        writers.spawn(async move {
            while let Some(seq) = rx.recv().await {
                let row = i64::try_from(seq).context("row number")?;
                let text =
                    String::from_utf8_lossy(&payload::encode(seq, clock.now_ns())).into_owned();
                let aggregates = i64::try_from(AGGREGATES).context("aggregates")?;
                client
                    .execute(INSERT, &[&row, &aggregates, &text])
                    .await
                    .with_context(|| format!("inserting row {seq}"))?;
            }
            anyhow::Ok(())
        });
    }
    let start = Instant::now();
    let mut ticks = tokio::time::interval(TICK);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Burst);
    let mut seq = 0;
    while seq < rows {
        ticks.tick().await;
        let due = due_by(start.elapsed(), rate).min(rows);
        while seq < due {
            let writer = usize::try_from(seq % WRITERS).unwrap_or(0);
            queues[writer]
                .send(seq)
                .await
                .context("a writer stopped early")?;
            seq += 1;
        }
    }
    drop(queues);
    while let Some(outcome) = writers.join_next().await {
        outcome.context("a writer task failed")??;
    }
    Ok(())
}

/// Rows not marked sent yet.
pub async fn unsent(client: &Client) -> anyhow::Result<u64> {
    let row = client
        .query_one("SELECT count(*) FROM outbox WHERE sent_at IS NULL", &[])
        .await
        .context("counting unsent rows")?;
    Ok(u64::try_from(row.try_get::<_, i64>(0)?)?)
}
