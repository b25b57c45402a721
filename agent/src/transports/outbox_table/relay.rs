//! The dialect-independent relay: connect, then claim → deliver → settle until shutdown, with
//! leases, retries and the purge (the invariants are in the module docs of `outbox_table`).
//!
//! State that outlives a connection: the rows in flight (their ids and retry counts) and the
//! outcomes not yet written. A lost connection is retried with backoff; the routes keep
//! settling meanwhile, and the outcomes are written once the relay is connected again.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use ferry_shared::config::OnSent;
use ferry_shared::envelope::{Envelope, Source};
use prost::bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use super::TableSettings;
use crate::transports::backoff::Backoff;
use crate::transports::{Defect, Delivery, Outcome, SettleHandle};

/// A database error, as text (each dialect renders its driver's errors).
#[derive(Debug)]
pub(crate) struct DbError(pub String);

impl fmt::Display for DbError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A claimed row.
#[derive(Debug)]
pub(crate) struct Row {
    /// The id as text (an integer's digits, a UUID …), as the dialect binds it back.
    pub id: String,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub event: Option<String>,
    pub payload: Vec<u8>,
    /// The `headers` column as text, if mapped and not null.
    pub headers: Option<String>,
    /// Failed deliveries so far (a null column counts as 0).
    pub retry_count: u32,
}

/// The SQL of one database on one connection. Every time is the database's clock, so agents on
/// different hosts agree on leases and retry times.
pub(crate) trait Dialect: Send + Sized + 'static {
    /// Connects (and `LISTEN`s, when the settings name a channel).
    fn connect(s: &TableSettings) -> impl Future<Output = Result<Self, DbError>> + Send;

    /// Claims up to `limit` head rows (module docs): locks them with `FOR UPDATE SKIP LOCKED`,
    /// leases them for `claim_ttl` and commits; in claim order (`order_by`).
    fn claim(&mut self, limit: u32) -> impl Future<Output = Result<Vec<Row>, DbError>> + Send;

    /// Marks rows sent (`on_sent: mark`) or deletes them (`delete`).
    fn settle_sent(
        &mut self,
        ids: &[String],
        on_sent: OnSent,
    ) -> impl Future<Output = Result<(), DbError>> + Send;

    /// Records a failed delivery: `retry_count = retry_count`, `retry_at = now + delay`.
    fn retry_later(
        &mut self,
        id: &str,
        retry_count: u32,
        delay: Duration,
    ) -> impl Future<Output = Result<(), DbError>> + Send;

    /// Gives unsent rows back at once (`retry_at = null`).
    fn release(&mut self, ids: &[String]) -> impl Future<Output = Result<(), DbError>> + Send;

    /// Extends the lease of unsent rows to `now + claim_ttl`.
    fn extend(&mut self, ids: &[String]) -> impl Future<Output = Result<(), DbError>> + Send;

    /// Deletes up to one slice of rows sent before `now - retention`; returns how many.
    fn purge(&mut self, retention: Duration) -> impl Future<Output = Result<u64, DbError>> + Send;

    /// Resolves when the database signals new rows (`NOTIFY`); never without a channel.
    fn woken(&mut self) -> impl Future<Output = ()> + Send;
}

/// What the session task shares with the session and the receiver.
pub(super) struct Link {
    pub deliveries: mpsc::Sender<Delivery>,
    pub connected: watch::Sender<bool>,
    pub reconnects: Arc<AtomicU64>,
    pub shutdown: CancellationToken,
}

/// Why the relay loop ended.
enum Ended {
    Shutdown,
    Lost(DbError),
}

impl From<DbError> for Ended {
    fn from(e: DbError) -> Self {
        Ended::Lost(e)
    }
}

/// The rows in flight and the outcomes not yet written.
struct State {
    /// Row id → its `retry_count` when claimed.
    in_flight: HashMap<String, u32>,
    /// Settled outcomes still to be written.
    pending: Vec<(String, Outcome)>,
    outcomes_tx: mpsc::UnboundedSender<(String, Outcome)>,
    outcomes: mpsc::UnboundedReceiver<(String, Outcome)>,
}

pub(super) async fn run<D: Dialect>(s: TableSettings, link: Link) {
    let session = s.name.clone();
    let transport = s.transport();
    let (outcomes_tx, outcomes) = mpsc::unbounded_channel();
    let mut state = State {
        in_flight: HashMap::new(),
        pending: Vec::new(),
        outcomes_tx,
        outcomes,
    };
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
    let mut ever_connected = false;
    let mut down = false;
    loop {
        let attempt = tokio::select! {
            biased;
            () = link.shutdown.cancelled() => break,
            attempt = D::connect(&s) => attempt,
        };
        match attempt {
            Ok(mut db) => {
                if ever_connected {
                    link.reconnects.fetch_add(1, Ordering::Relaxed);
                }
                ever_connected = true;
                backoff.reset();
                tracing::info!(%session, table = %s.table, "{transport} connected");
                link.connected.send_replace(true);
                let ended = relay(&s, &mut db, &link, &mut state).await;
                link.connected.send_replace(false);
                match ended {
                    Ended::Shutdown => break,
                    Ended::Lost(error) => {
                        tracing::warn!(%session, %error, "{transport} connection lost; reconnecting with backoff");
                        down = true;
                    }
                }
            }
            Err(error) if !down => {
                tracing::warn!(%session, %error, "cannot relay the {transport} table (database unreachable, or the table not as configured); retrying with backoff");
                down = true;
            }
            Err(error) => {
                tracing::debug!(%session, %error, "{transport} connection failed; retrying")
            }
        }
        tokio::select! {
            biased;
            () = link.shutdown.cancelled() => break,
            () = tokio::time::sleep(backoff.next_delay()) => {}
        }
    }
    link.connected.send_replace(false);
}

/// What woke the relay loop.
enum Event {
    Shutdown,
    Settled(Option<(String, Outcome)>),
    PollDue,
    Woken,
    Heartbeat,
    Purge,
}

/// Claims, hands out and settles rows until shutdown or a database error.
async fn relay<D: Dialect>(s: &TableSettings, db: &mut D, link: &Link, state: &mut State) -> Ended {
    let capacity = usize::try_from(s.batch_size).unwrap_or(usize::MAX).max(1);
    let mut claim_due = true;
    let mut next_poll = Instant::now();
    // A third of the lease, so two extensions may fail before it runs out (never zero: an
    // interval of zero panics).
    let mut heartbeat = tokio::time::interval((s.claim_ttl / 3).max(Duration::from_millis(1)));
    heartbeat.set_missed_tick_behavior(MissedTickBehavior::Delay);
    heartbeat.reset();
    let purge_every = s.retention.map_or(Duration::from_secs(3600), |r| {
        (r / 2).clamp(Duration::from_millis(100), Duration::from_secs(60))
    });
    let mut purge = tokio::time::interval(purge_every);
    purge.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        while let Ok(settled) = state.outcomes.try_recv() {
            state.pending.push(settled);
        }
        if !state.pending.is_empty() {
            if let Err(e) = flush(s, db, state).await {
                return Ended::Lost(e);
            }
            // A settled head may have unblocked its aggregate.
            claim_due = true;
        }
        let room = capacity.saturating_sub(state.in_flight.len());
        if claim_due && room > 0 {
            let rows = match db.claim(u32::try_from(room).unwrap_or(u32::MAX)).await {
                Ok(rows) => rows,
                Err(e) => return Ended::Lost(e),
            };
            // A full claim may have left rows behind; a short one found all there was.
            claim_due = rows.len() >= room;
            if !claim_due {
                next_poll = Instant::now() + s.poll_interval;
            }
            for row in rows {
                if !hand_out(s, link, state, row) {
                    return Ended::Shutdown;
                }
            }
        }
        let event = tokio::select! {
            biased;
            () = link.shutdown.cancelled() => Event::Shutdown,
            settled = state.outcomes.recv() => Event::Settled(settled),
            () = tokio::time::sleep_until(next_poll), if !claim_due => Event::PollDue,
            () = db.woken() => Event::Woken,
            _ = heartbeat.tick() => Event::Heartbeat,
            _ = purge.tick(), if s.retention.is_some() => Event::Purge,
        };
        match event {
            Event::Shutdown => {
                // Write what has settled; rows still in flight keep their lease and are
                // claimed again once it ran out.
                while let Ok(settled) = state.outcomes.try_recv() {
                    state.pending.push(settled);
                }
                if !state.pending.is_empty()
                    && let Err(error) = flush(s, db, state).await
                {
                    tracing::info!(session = %s.name, %error, "settles not written at shutdown; those rows are relayed again");
                }
                return Ended::Shutdown;
            }
            // The state holds a sender, so the channel never closes.
            Event::Settled(settled) => state.pending.extend(settled),
            Event::PollDue | Event::Woken => claim_due = true,
            Event::Heartbeat => {
                let ids: Vec<String> = state.in_flight.keys().cloned().collect();
                if !ids.is_empty()
                    && let Err(e) = db.extend(&ids).await
                {
                    return Ended::Lost(e);
                }
            }
            Event::Purge => {
                if let Some(retention) = s.retention {
                    match db.purge(retention).await {
                        Ok(0) => {}
                        Ok(n) => {
                            tracing::debug!(session = %s.name, rows = n, "purged sent rows");
                            // A full slice may have left more: purge again soon.
                            purge.reset_after(Duration::from_millis(100));
                        }
                        Err(e) => return Ended::Lost(e),
                    }
                }
            }
        }
    }
}

/// Writes the pending outcomes; on success they leave the in-flight set. On failure nothing
/// is forgotten: each statement is idempotent and all are written again after reconnecting.
async fn flush<D: Dialect>(
    s: &TableSettings,
    db: &mut D,
    state: &mut State,
) -> Result<(), DbError> {
    let mut sent = Vec::new();
    let mut released = Vec::new();
    let mut failed = Vec::new();
    for (id, outcome) in &state.pending {
        let retry_count = state.in_flight.get(id).copied().unwrap_or_default();
        if outcome.acknowledges() {
            sent.push(id.clone());
        } else if *outcome == Outcome::Shutdown {
            released.push(id.clone());
        } else {
            tracing::debug!(session = %s.name, %id, ?outcome, retry_count, "row not relayed; retried later");
            failed.push((id.as_str(), retry_count, s.retry_delay(retry_count)));
        }
    }
    if !sent.is_empty() {
        db.settle_sent(&sent, s.on_sent).await?;
    }
    if !released.is_empty() {
        db.release(&released).await?;
    }
    for (id, retry_count, delay) in failed {
        db.retry_later(id, retry_count.saturating_add(1), delay)
            .await?;
    }
    for (id, _) in state.pending.drain(..) {
        state.in_flight.remove(&id);
    }
    Ok(())
}

/// Hands one claimed row to the route; false once the receiver is gone.
fn hand_out(s: &TableSettings, link: &Link, state: &mut State, row: Row) -> bool {
    let id = row.id.clone();
    state.in_flight.insert(id.clone(), row.retry_count);
    let retry_count = row.retry_count;
    let (envelope, invalid_headers) = envelope_of(s, row);
    // A malformed headers value stays malformed: to the DLQ at once, not through the retries.
    let defect = invalid_headers.map(Defect::InvalidHeaders).or_else(|| {
        (retry_count >= s.max_retries).then_some(Defect::RetriesExhausted {
            retries: retry_count,
            limit: s.max_retries,
        })
    });
    let outcomes = state.outcomes_tx.clone();
    let delivery = Delivery {
        envelope,
        defect,
        redelivered: retry_count > 0,
        source_retries: true,
        settle: SettleHandle::new(move |outcome| {
            outcomes.send((id, outcome)).ok();
        }),
    };
    match link.deliveries.try_send(delivery) {
        Ok(()) => true,
        // Cannot happen (the channel holds `batch_size`, the rows in flight at most); the
        // dropped delivery settles itself as abandoned, so the row is retried.
        Err(mpsc::error::TrySendError::Full(_)) => {
            tracing::warn!(session = %s.name, "delivery channel full; row retried later");
            true
        }
        Err(mpsc::error::TrySendError::Closed(_)) => false,
    }
}

/// The row's message, and what is wrong with its `headers` value if it is not a JSON object of
/// strings (the message then carries the other headers).
fn envelope_of(s: &TableSettings, row: Row) -> (Envelope, Option<String>) {
    let mut headers = Vec::with_capacity(3);
    for (key, value) in [
        ("aggregate_type", row.aggregate_type),
        ("aggregate_id", row.aggregate_id),
        ("event", row.event),
    ] {
        if let Some(value) = value {
            headers.push((key.to_owned(), value));
        }
    }
    let mut envelope = Envelope::new(
        format!("{}:{}", s.table, row.id),
        Bytes::from(row.payload),
        Source::new(s.transport(), &s.name, &s.table, SystemTime::now()),
    );
    let invalid = match row.headers.as_deref().map(parse_headers) {
        Some(Ok(more)) => {
            headers.extend(more);
            None
        }
        Some(Err(e)) => Some(e),
        None => None,
    };
    envelope.headers = headers;
    (envelope, invalid)
}

/// A `headers` value: a JSON object whose values are strings, sorted by key (an object has no
/// order). Keys starting with `ferry-` are dropped (Ferry's own, as from other sources).
fn parse_headers(text: &str) -> Result<Vec<(String, String)>, String> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not JSON ({e})"))?;
    let serde_json::Value::Object(object) = value else {
        return Err(format!("not a JSON object: {text:.80}"));
    };
    let mut headers = Vec::with_capacity(object.len());
    for (key, value) in object {
        let serde_json::Value::String(value) = value else {
            return Err(format!("the value of {key:?} is not a string"));
        };
        if !key.to_ascii_lowercase().starts_with("ferry-") {
            headers.push((key, value));
        }
    }
    // Sorted here: serde_json keeps insertion order when any crate of the build enables its
    // `preserve_order` feature, as one of ours does.
    headers.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records what the relay writes.
    #[derive(Default)]
    struct Recorded {
        sent: Vec<String>,
        released: Vec<String>,
        retried: Vec<(String, u32, Duration)>,
    }

    impl Dialect for Recorded {
        async fn connect(_: &TableSettings) -> Result<Self, DbError> {
            Ok(Self::default())
        }
        async fn claim(&mut self, _: u32) -> Result<Vec<Row>, DbError> {
            Ok(Vec::new())
        }
        async fn settle_sent(&mut self, ids: &[String], _: OnSent) -> Result<(), DbError> {
            self.sent.extend_from_slice(ids);
            Ok(())
        }
        async fn retry_later(&mut self, id: &str, n: u32, delay: Duration) -> Result<(), DbError> {
            self.retried.push((id.to_owned(), n, delay));
            Ok(())
        }
        async fn release(&mut self, ids: &[String]) -> Result<(), DbError> {
            self.released.extend_from_slice(ids);
            Ok(())
        }
        async fn extend(&mut self, _: &[String]) -> Result<(), DbError> {
            Ok(())
        }
        async fn purge(&mut self, _: Duration) -> Result<u64, DbError> {
            Ok(0)
        }
        async fn woken(&mut self) {
            std::future::pending().await
        }
    }

    fn settings() -> TableSettings {
        TableSettings {
            batch_size: 10,
            max_retries: 2,
            retry_backoff_max: Duration::from_secs(60),
            ..TableSettings::for_tests()
        }
    }

    fn state() -> State {
        let (outcomes_tx, outcomes) = mpsc::unbounded_channel();
        State {
            in_flight: HashMap::new(),
            pending: Vec::new(),
            outcomes_tx,
            outcomes,
        }
    }

    /// A connected link and the receiving end of its deliveries.
    fn link() -> (Link, mpsc::Receiver<Delivery>) {
        let (deliveries, receiver) = mpsc::channel(10);
        let link = Link {
            deliveries,
            connected: watch::channel(true).0,
            reconnects: Arc::new(AtomicU64::new(0)),
            shutdown: CancellationToken::new(),
        };
        (link, receiver)
    }

    fn row(id: &str, retry_count: u32) -> Row {
        Row {
            id: id.into(),
            aggregate_type: Some("orders".into()),
            aggregate_id: Some("a1".into()),
            event: None,
            payload: b"{}".to_vec(),
            headers: None,
            retry_count,
        }
    }

    /// Acknowledged rows are marked, a shutdown gives the row back uncounted, every other
    /// unacknowledged outcome counts a retry with the row's backoff.
    #[tokio::test]
    async fn outcomes_become_sent_released_or_retried_rows() {
        let s = settings();
        let mut db = Recorded::default();
        let mut state = state();
        state
            .in_flight
            .extend([("1", 0), ("2", 0), ("3", 2), ("4", 0)].map(|(id, n)| (id.to_owned(), n)));
        state.pending.extend(
            [
                ("1", Outcome::DeadLettered),
                ("2", Outcome::Shutdown),
                ("3", Outcome::Failed),
                ("4", Outcome::BackPressure),
            ]
            .map(|(id, outcome)| (id.to_owned(), outcome)),
        );
        flush(&s, &mut db, &mut state).await.expect("flush");
        assert_eq!(db.sent, ["1"]);
        assert_eq!(db.released, ["2"]);
        assert_eq!(
            db.retried,
            [
                ("3".to_owned(), 3, Duration::from_secs(4)),
                ("4".to_owned(), 1, Duration::from_secs(1))
            ]
        );
        assert!(state.in_flight.is_empty() && state.pending.is_empty());
    }

    /// A row within its retries goes as it is; one that reached `max_retries` goes with a
    /// defect, which the route dead-letters. Either way its settle comes back with its id.
    #[tokio::test]
    async fn a_row_past_its_retries_is_handed_out_for_the_dlq() {
        let s = settings();
        let (link, mut receiver) = link();
        let mut state = state();
        let uuid = "0190a8c2-7a5e-7c3d-9f1e-2b4c6d8e0f12";
        assert!(hand_out(&s, &link, &mut state, row(uuid, 1)));
        assert!(hand_out(&s, &link, &mut state, row("8", 2)));
        let first = receiver.recv().await.expect("delivery");
        assert_eq!(first.envelope.id, format!("outbox:{uuid}"));
        assert_eq!(first.envelope.header("aggregate_id"), Some("a1"));
        assert!(first.defect.is_none() && first.redelivered && first.source_retries);
        let second = receiver.recv().await.expect("delivery");
        assert_eq!(
            second.defect,
            Some(Defect::RetriesExhausted {
                retries: 2,
                limit: 2
            })
        );
        second.settle.settle(Outcome::DeadLettered);
        drop(first);
        let mut settled = vec![
            state.outcomes.recv().await.expect("settled"),
            state.outcomes.recv().await.expect("settled"),
        ];
        settled.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            settled,
            [
                (uuid.to_owned(), Outcome::Abandoned),
                ("8".to_owned(), Outcome::DeadLettered)
            ]
        );
        assert_eq!(state.in_flight.len(), 2);
    }

    /// A `headers` object becomes headers after the table's own (sorted, `ferry-*` dropped);
    /// a value that is not an object of strings sends the row to the DLQ at once, with the
    /// other headers kept, even when it still has retries left.
    #[tokio::test]
    async fn a_headers_column_becomes_headers_and_a_malformed_one_a_permanent_defect() {
        let s = settings();
        let (link, mut receiver) = link();
        let mut state = state();
        let with = |id: &str, headers: &str| Row {
            headers: Some(headers.into()),
            ..row(id, 0)
        };
        let good = r#"{"tenant": "t1", "ferry-message-id": "forged", "site": "s9"}"#;
        assert!(hand_out(&s, &link, &mut state, with("1", good)));
        for (id, bad) in [("2", "[1]"), ("3", r#"{"n": 1}"#), ("4", "{oops")] {
            assert!(hand_out(&s, &link, &mut state, with(id, bad)));
        }
        let first = receiver.recv().await.expect("delivery");
        assert!(first.defect.is_none());
        assert_eq!(
            first.envelope.headers,
            [
                ("aggregate_type", "orders"),
                ("aggregate_id", "a1"),
                ("site", "s9"),
                ("tenant", "t1")
            ]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
        );
        for expected in ["not a JSON object", "\"n\" is not a string", "not JSON"] {
            let d = receiver.recv().await.expect("delivery");
            match &d.defect {
                Some(Defect::InvalidHeaders(why)) => assert!(why.contains(expected), "{why}"),
                other => panic!("expected invalid headers, got {other:?}"),
            }
            assert_eq!(d.envelope.header("aggregate_id"), Some("a1"));
        }
    }
}
