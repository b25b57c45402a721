//! How fast the SQLite (or, with `--postgres URL`, the PostgreSQL) outbox
//! moves records on its own, without brokers:
//! one task appends messages (one record per binding, like the
//! `shared_outbox` writer, up to `--in-flight` appends at once) while a
//! drain loop claims batches and completes them, as the drainer does after
//! its sends. Prints records per second, writer commits, the time each
//! operation waited for its commit and the bytes written per message.
//!
//! ```sh
//! cargo run --release -p ferry-agent --example outbox_throughput -- --messages 20000
//! ```
//!
//! `--postgres postgres://postgres@127.0.0.1:5432/DB` runs it against a
//! fresh schema of that database instead (bytes written are the server's,
//! not counted here).
//!
//! `--sequential` makes one store call at a time (append a message; claim
//! and complete a batch whenever one is pending), so that every run does the
//! same work: the mode for counting instructions per message with
//! `valgrind --tool=callgrind`, which is repeatable on a noisy machine (see
//! `docs/benchmarks.md`).
//!
//! It isolates the store's share of the fan-out benchmark (`ferry-bench`,
//! `docs/benchmarks.md`): if the store alone cannot move records much
//! faster than the benchmark delivers them, the store is the limit.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use clap::Parser;
use ferry_agent::stores::postgres::{PostgresOptions, PostgresOutboxStore};
use ferry_agent::stores::sqlite::{SqliteOptions, SqliteOutboxStore, Synchronous};
use ferry_agent::stores::{NewMessage, NewRecord, OutboxStore};
use ferry_shared::envelope::{Envelope, Source, TraceContext};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use prost::bytes::Bytes;

#[derive(Parser)]
struct Args {
    /// Messages appended.
    #[arg(long, default_value_t = 20_000)]
    messages: usize,
    /// Records per message (bindings of the route).
    #[arg(long, default_value_t = 3)]
    bindings: usize,
    /// Appends in flight at once (the route's `max_in_flight`).
    #[arg(long, default_value_t = 100)]
    in_flight: usize,
    /// Records per claim (`drain_batch_size`).
    #[arg(long, default_value_t = 50)]
    batch: usize,
    /// Payload bytes.
    #[arg(long, default_value_t = 256)]
    payload: usize,
    /// `synchronous=NORMAL` instead of `FULL`.
    #[arg(long)]
    normal: bool,
    /// One store call at a time (repeatable work, for callgrind).
    #[arg(long)]
    sequential: bool,
    /// The PostgreSQL outbox in this database (a new schema) instead of SQLite.
    #[arg(long)]
    postgres: Option<String>,
}

const PARTITION: &str = "bench/route";

fn envelope(payload: &Bytes) -> Envelope {
    Envelope {
        id: uuid::Uuid::now_v7().to_string(),
        headers: Vec::new(),
        payload: payload.clone(),
        content_type: None,
        source: Source {
            transport: "mqtt".into(),
            session_id: "in".into(),
            address: "sensors/bench".into(),
            received_at: SystemTime::now(),
        },
        expires_at: None,
        trace: TraceContext::default(),
    }
}

/// The bindings' ids and addresses, made once and shared by every record, as
/// the `shared_outbox` writer does.
type Names = Arc<[(Arc<str>, Arc<str>)]>;

fn names(bindings: usize) -> Names {
    (0..bindings)
        .map(|b| (Arc::from(format!("b{b}")), Arc::from(format!("b{b}/x"))))
        .collect()
}

/// What one append writes: a message with one record per binding (the
/// `shared_outbox` writer's append).
fn message(payload: &Bytes, names: &Names) -> NewMessage {
    let records = names
        .iter()
        .map(|(binding, address)| NewRecord::new(Arc::clone(binding), Arc::clone(address)))
        .collect();
    NewMessage::new(envelope(payload), SystemTime::now(), records)
}

/// Claims one batch and completes it; the records completed.
async fn drain_batch(store: &dyn OutboxStore, batch: usize) -> anyhow::Result<usize> {
    let claimed = store
        .claim(PARTITION, "owner", 1, batch, SystemTime::now())
        .await?;
    let seqs: Vec<u64> = claimed.iter().map(|r| r.seq).collect();
    Ok(store.complete(PARTITION, 1, &seqs).await?.len())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = tempfile::tempdir().context("temporary directory")?;
    let (mut sqlite, mut postgres) = (None, None);
    let store: Arc<dyn OutboxStore> = match &args.postgres {
        Some(url) => {
            let schema = format!("bench_{}", uuid::Uuid::now_v7().simple());
            let options = PostgresOptions {
                schema: Some(schema),
                ..PostgresOptions::new(url)
            };
            let store = Arc::new(PostgresOutboxStore::open(options).await?);
            postgres = Some(Arc::clone(&store));
            store
        }
        None => {
            let mut options = SqliteOptions::new(dir.path().join("outbox.db"));
            if args.normal {
                options.synchronous = Synchronous::Normal;
            }
            let store = Arc::new(SqliteOutboxStore::open(options).await?);
            sqlite = Some(Arc::clone(&store));
            store
        }
    };
    let commits = || match (&sqlite, &postgres) {
        (Some(s), _) => s.commits(),
        (_, Some(p)) => p.append_commits(),
        _ => 0,
    };
    let written_before = written_bytes();
    let started = Instant::now();
    if args.sequential {
        sequential(store.as_ref(), &args).await?;
    } else {
        concurrent(&store, &args, started).await?;
    }
    let elapsed = started.elapsed();
    let written = written_bytes() - written_before;
    let total = args.messages * args.bindings;
    println!(
        "drained {total} records in {:.2} s: {:.0} records/s ({:.0} messages/s per binding)",
        elapsed.as_secs_f64(),
        total as f64 / elapsed.as_secs_f64(),
        args.messages as f64 / elapsed.as_secs_f64()
    );
    println!(
        "{} commits ({:.2} per message); {:.0} bytes written per message, {:.0} per record \
         ({:.1} MiB)",
        commits(),
        commits() as f64 / args.messages as f64,
        written as f64 / args.messages as f64,
        written as f64 / total as f64,
        written as f64 / f64::from(1 << 20)
    );
    drop(store);
    if let Some(store) = sqlite {
        Arc::into_inner(store)
            .context("store still shared")?
            .close()
            .await;
    }
    Ok(())
}

/// One call at a time: append messages one by one and drain a batch
/// whenever one is pending.
async fn sequential(store: &dyn OutboxStore, args: &Args) -> anyhow::Result<()> {
    let payload = Bytes::from(vec![b'x'; args.payload]);
    let bindings = names(args.bindings);
    let (mut pending, mut drained) = (0, 0);
    for _ in 0..args.messages {
        store
            .append(PARTITION, message(&payload, &bindings))
            .await?;
        pending += args.bindings;
        while pending >= args.batch {
            let done = drain_batch(store, args.batch).await?;
            anyhow::ensure!(done > 0, "a pending batch claimed nothing");
            (pending, drained) = (pending - done, drained + done);
        }
    }
    while pending > 0 {
        let done = drain_batch(store, args.batch).await?;
        anyhow::ensure!(done > 0, "{pending} records left unclaimed");
        (pending, drained) = (pending - done, drained + done);
    }
    println!(
        "{} messages × {} records, sequential, batch {}: {drained} records drained",
        args.messages, args.bindings, args.batch
    );
    Ok(())
}

/// Appends (up to `--in-flight` at once) racing a claim / complete loop.
async fn concurrent(
    store: &Arc<dyn OutboxStore>,
    args: &Args,
    started: Instant,
) -> anyhow::Result<()> {
    let payload = Bytes::from(vec![b'x'; args.payload]);
    let total = args.messages * args.bindings;
    let appending = Arc::new(AtomicBool::new(true));
    let appender = {
        let (store, appending) = (Arc::clone(store), Arc::clone(&appending));
        let (messages, bindings, in_flight) = (args.messages, names(args.bindings), args.in_flight);
        tokio::spawn(async move {
            let mut pending = FuturesUnordered::new();
            let mut waited = Duration::ZERO;
            for _ in 0..messages {
                if pending.len() >= in_flight
                    && let Some(r) = pending.next().await
                {
                    waited += r?;
                }
                let next = message(&payload, &bindings);
                let store = Arc::clone(&store);
                pending.push(async move {
                    let t = Instant::now();
                    store.append(PARTITION, next).await.map(|_| t.elapsed())
                });
            }
            while let Some(r) = pending.next().await {
                waited += r?;
            }
            appending.store(false, Ordering::Relaxed);
            Ok::<_, anyhow::Error>((started.elapsed(), waited / messages as u32))
        })
    };

    let mut drained = 0;
    let (mut claims, mut claim_time, mut complete_time) = (0u32, Duration::ZERO, Duration::ZERO);
    while drained < total {
        let t = Instant::now();
        let batch = store
            .claim(PARTITION, "owner", 1, args.batch, SystemTime::now())
            .await?;
        claim_time += t.elapsed();
        claims += 1;
        if batch.is_empty() {
            anyhow::ensure!(
                appending.load(Ordering::Relaxed),
                "outbox empty after {drained} of {total} records"
            );
            tokio::task::yield_now().await;
            continue;
        }
        let seqs: Vec<u64> = batch.iter().map(|r| r.seq).collect();
        let t = Instant::now();
        drained += store.complete(PARTITION, 1, &seqs).await?.len();
        complete_time += t.elapsed();
    }
    let (append_elapsed, append_wait) = appender.await??;
    println!(
        "{} messages × {} records, {}, batch {}, {} appends in flight",
        args.messages,
        args.bindings,
        match (&args.postgres, args.normal) {
            (Some(_), _) => "postgres",
            (None, true) => "sqlite NORMAL",
            (None, false) => "sqlite FULL",
        },
        args.batch,
        args.in_flight
    );
    println!(
        "appends finished after {:.2} s, {:.2} ms each on average",
        append_elapsed.as_secs_f64(),
        append_wait.as_secs_f64() * 1e3
    );
    println!(
        "{claims} claims at {:.2} ms, completes at {:.2} ms on average",
        claim_time.as_secs_f64() * 1e3 / f64::from(claims),
        complete_time.as_secs_f64() * 1e3 / f64::from(claims)
    );
    Ok(())
}

/// Bytes this process asked the kernel to write so far (`wchar` in
/// `/proc/self/io`): the WAL frames and checkpoints; 0 where unavailable.
fn written_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|io| {
            io.lines()
                .find_map(|l| l.strip_prefix("wchar: "))
                .and_then(|n| n.trim().parse().ok())
        })
        .unwrap_or(0)
}
