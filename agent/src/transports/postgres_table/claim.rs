//! The session task: connect, then claim, deliver and settle batches of rows until shutdown
//! (see the module docs of `postgres_table` for the invariants).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use ferry_shared::envelope::{Envelope, Source, TraceContext};
use prost::bytes::Bytes;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio_postgres::{Client, NoTls, Row};
use tokio_util::sync::CancellationToken;

use super::TableSettings;
use crate::transports::backoff::Backoff;
use crate::transports::{Delivery, Outcome, SettleHandle};

/// The user when the session names none (tokio-postgres needs one).
const DEFAULT_USER: &str = "postgres";
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the relay loop ended.
enum Ended {
    Shutdown,
    Lost(tokio_postgres::Error),
}

impl From<tokio_postgres::Error> for Ended {
    fn from(e: tokio_postgres::Error) -> Self {
        Ended::Lost(e)
    }
}

pub(super) async fn run(
    settings: TableSettings,
    deliveries: mpsc::Sender<Delivery>,
    connected: watch::Sender<bool>,
    reconnects: Arc<AtomicU64>,
    shutdown: CancellationToken,
) {
    let session = settings.name.clone();
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
    let mut ever_connected = false;
    let mut down = false;
    loop {
        let attempt = tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            attempt = connect(&settings) => attempt,
        };
        match attempt {
            Ok((mut client, connection)) => {
                if ever_connected {
                    reconnects.fetch_add(1, Ordering::Relaxed);
                }
                ever_connected = true;
                backoff.reset();
                tracing::info!(%session, table = %settings.table, "postgres_table connected");
                connected.send_replace(true);
                let ended = relay(&settings, &mut client, &deliveries, &shutdown).await;
                connected.send_replace(false);
                connection.abort();
                match ended {
                    Ended::Shutdown => break,
                    Ended::Lost(error) => {
                        tracing::warn!(%session, %error, "postgres_table connection lost; reconnecting with backoff");
                        down = true;
                    }
                }
            }
            Err(error) if !down => {
                tracing::warn!(%session, %error, "cannot reach postgres; retrying with backoff");
                down = true;
            }
            Err(error) => tracing::debug!(%session, %error, "postgres connection failed; retrying"),
        }
        tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            () = tokio::time::sleep(backoff.next_delay()) => {}
        }
    }
    connected.send_replace(false);
}

async fn connect(s: &TableSettings) -> Result<(Client, JoinHandle<()>), tokio_postgres::Error> {
    let mut config = tokio_postgres::Config::new();
    config
        .host(&s.host)
        .port(s.port)
        .dbname(&s.database)
        .user(s.username.as_deref().unwrap_or(DEFAULT_USER))
        .application_name("ferry-agent")
        .connect_timeout(CONNECT_TIMEOUT);
    if let Some(password) = &s.password {
        config.password(password.expose());
    }
    let (client, connection) = config.connect(NoTls).await?;
    let task = tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "postgres connection ended");
        }
    });
    Ok((client, task))
}

/// Claims, delivers and settles batches until shutdown or a database error.
async fn relay(
    s: &TableSettings,
    client: &mut Client,
    deliveries: &mpsc::Sender<Delivery>,
    shutdown: &CancellationToken,
) -> Ended {
    let table = &s.table;
    // The table name is a validated identifier (`name` or `schema.name`).
    let claim = format!(
        "SELECT id::bigint, aggregate_type::text, aggregate_id::text, event::text, payload::text \
         FROM {table} WHERE sent_at IS NULL ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED"
    );
    let mark = format!("UPDATE {table} SET sent_at = now() WHERE id = ANY($1)");
    loop {
        match batch(s, client, &claim, &mark, deliveries, shutdown).await {
            Ok(true) => {}
            Ok(false) => {
                tokio::select! {
                    () = shutdown.cancelled() => return Ended::Shutdown,
                    () = tokio::time::sleep(s.poll_interval) => {}
                }
            }
            Err(ended) => return ended,
        }
    }
}

/// One claim: returns whether any row was marked sent (false: wait before the next claim).
async fn batch(
    s: &TableSettings,
    client: &mut Client,
    claim: &str,
    mark: &str,
    deliveries: &mpsc::Sender<Delivery>,
    shutdown: &CancellationToken,
) -> Result<bool, Ended> {
    let txn = client.transaction().await?;
    let rows = txn.query(claim, &[&i64::from(s.batch_size)]).await?;
    let mut pending = Vec::with_capacity(rows.len());
    for row in &rows {
        let (id, envelope) = envelope_of(s, row)?;
        let (settled, outcome) = oneshot::channel();
        let delivery = Delivery {
            envelope,
            defect: None,
            redelivered: false,
            settle: SettleHandle::new(move |o| {
                settled.send(o).ok();
            }),
        };
        tokio::select! {
            // Dropping the transaction rolls it back: the rows are claimed again later.
            () = shutdown.cancelled() => return Err(Ended::Shutdown),
            sent = deliveries.send(delivery) => if sent.is_err() { return Err(Ended::Shutdown) },
        }
        pending.push((id, outcome));
    }
    let mut acknowledged = Vec::with_capacity(pending.len());
    for (id, outcome) in pending {
        let outcome = tokio::select! {
            () = shutdown.cancelled() => return Err(Ended::Shutdown),
            o = outcome => o.unwrap_or(Outcome::Abandoned),
        };
        if outcome.acknowledges() {
            acknowledged.push(id);
        }
    }
    if !acknowledged.is_empty() {
        txn.execute(mark, &[&acknowledged]).await?;
    }
    txn.commit().await?;
    Ok(!acknowledged.is_empty())
}

fn envelope_of(s: &TableSettings, row: &Row) -> Result<(i64, Envelope), tokio_postgres::Error> {
    let id: i64 = row.try_get(0)?;
    let text = |i: usize| -> Result<Option<String>, tokio_postgres::Error> { row.try_get(i) };
    let mut headers = Vec::with_capacity(3);
    for (i, key) in [(1, "aggregate_type"), (2, "aggregate_id"), (3, "event")] {
        if let Some(value) = text(i)? {
            headers.push((key.to_owned(), value));
        }
    }
    let payload = text(4)?.unwrap_or_default();
    let envelope = Envelope {
        id: format!("{}:{id}", s.table),
        headers,
        payload: Bytes::from(payload.into_bytes()),
        content_type: None,
        source: Source {
            transport: "postgres_table".into(),
            session_id: s.name.clone(),
            address: s.table.clone(),
            received_at: SystemTime::now(),
        },
        expires_at: None,
        trace: TraceContext::default(),
    };
    Ok((id, envelope))
}
