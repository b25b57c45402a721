//! The reference relay: what seed 002's relay does, in Rust, in the benchmark's process.
//!
//! Seed 002 (`shared/seeds/002_*`, a Go relay): on every tick of a one-second ticker it reads
//! the pending rows (`GetPendingEvents`), then for each row publishes it to RabbitMQ
//! (`PublishEvent`) and marks it processed (`MarkAsProcessed`, one UPDATE per row); a failure
//! skips the row until the next tick. Here, on every tick of `poll_interval` (the same as
//! Ferry's, so both wait alike for new rows; Go's ticker, like `MissedTickBehavior::Skip`,
//! fires at once when a pass overran), it reads every row with `sent_at IS NULL` in id order,
//! then for each publishes it and waits for the broker to take it (publisher confirm, or the
//! stream's ack), then sets its `sent_at`: one publish, one confirm and one autocommit UPDATE
//! per row, strictly in turn, on one database connection. A failure ends the relay with its
//! error (a benchmark does not retry behind the figures' back).

use std::time::Duration;

use anyhow::{Context, bail};
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use super::target::Publisher;
use crate::TestDatabase;

/// The relay running in a task of its own.
pub struct MinimalRelay {
    task: Option<JoinHandle<anyhow::Result<()>>>,
    shutdown: CancellationToken,
}

impl MinimalRelay {
    /// Connects to `database` and starts relaying its outbox table through `publisher`.
    pub async fn start(
        database: &TestDatabase,
        publisher: Publisher,
        poll_interval: Duration,
    ) -> anyhow::Result<Self> {
        let client = database.connect().await?;
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(relay(client, publisher, poll_interval, shutdown.clone()));
        Ok(Self {
            task: Some(task),
            shutdown,
        })
    }

    /// Fails with the relay's error if it has stopped.
    pub async fn check_running(&mut self) -> anyhow::Result<()> {
        match self.task.take_if(|task| task.is_finished()) {
            None => Ok(()),
            Some(task) => match task.await {
                Ok(Ok(())) => bail!("the minimal relay stopped"),
                Ok(Err(error)) => Err(error.context("the minimal relay failed")),
                Err(error) => bail!("the minimal relay's task failed: {error}"),
            },
        }
    }

    /// Stops the relay after the row it is on; returns its error if it had failed.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        match self.task.take() {
            None => Ok(()),
            Some(task) => task.await.context("the minimal relay's task failed")?,
        }
    }
}

impl Drop for MinimalRelay {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

async fn relay(
    client: Client,
    publisher: Publisher,
    poll_interval: Duration,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let pending = client
        .prepare("SELECT id, payload FROM outbox WHERE sent_at IS NULL ORDER BY id")
        .await?;
    let mark = client
        .prepare("UPDATE outbox SET sent_at = now() WHERE id = $1")
        .await?;
    let mut ticks = tokio::time::interval(poll_interval);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            _ = ticks.tick() => {}
        }
        let rows = client
            .query(&pending, &[])
            .await
            .context("reading pending rows")?;
        for row in rows {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            let id: i64 = row.try_get(0)?;
            let payload: String = row.try_get(1)?;
            publisher.send(payload.into_bytes()).await?;
            client
                .execute(&mark, &[&id])
                .await
                .with_context(|| format!("marking row {id} processed"))?;
        }
    }
}
