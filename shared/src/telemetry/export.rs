//! The export queue: finished spans go to the OTLP exporter in batches through
//! a bounded queue, so a slow or unreachable collector never makes the data
//! path wait.
//!
//! Invariants:
//!
//! - **`on_end` never blocks.** It offers the span to a bounded queue of
//!   [`QUEUE_CAPACITY`] spans; when the queue is full the span is dropped and
//!   counted ([`dropped_spans`]).
//! - **Every sampled span is exported or counted as dropped**: dropped at the
//!   full queue, in a batch the collector did not accept (error or
//!   [`EXPORT_TIMEOUT`]), or still queued when the flush at shutdown ran out
//!   of time.
//! - **One export at a time**, on a task of the runtime the set-up ran in
//!   (the tonic channel needs it); while it runs, spans gather in the queue
//!   and leave as the next batch of up to [`MAX_BATCH`].
//!
//! Why not the SDK's `BatchSpanProcessor`: it counts the spans it drops but
//! keeps the count private (a log line at shutdown), and the operator needs it
//! as a metric while the agent runs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SpanData, SpanExporter, SpanProcessor};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Spans waiting for export at most; more are dropped.
pub const QUEUE_CAPACITY: usize = 2048;
/// Spans per export call at most.
pub const MAX_BATCH: usize = 512;
/// How long one export call may take before its spans count as dropped.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// Spans dropped since the process started: one counter per process, as
/// there is one telemetry set-up per process.
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Spans that were never exported: queue full, export failed or timed out,
/// or left queued at shutdown.
pub fn dropped_spans() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

fn count_dropped(n: usize) {
    DROPPED.fetch_add(n as u64, Ordering::Relaxed);
}

/// The span processor: hands finished spans to the export task.
#[derive(Debug)]
pub(super) struct ExportQueue {
    spans: mpsc::Sender<SpanData>,
    stop: CancellationToken,
}

/// The export task, awaited at shutdown so the queue is flushed.
#[derive(Debug)]
pub(super) struct ExportTask {
    stop: CancellationToken,
    handle: JoinHandle<()>,
}

/// The queue and its export task, spawned on the current tokio runtime.
pub(super) fn start<E>(exporter: E) -> (ExportQueue, ExportTask)
where
    E: SpanExporter + 'static,
{
    let (spans, rx) = mpsc::channel(QUEUE_CAPACITY);
    let stop = CancellationToken::new();
    let handle = tokio::spawn(run(exporter, rx, stop.clone()));
    (
        ExportQueue {
            spans,
            stop: stop.clone(),
        },
        ExportTask { stop, handle },
    )
}

impl ExportTask {
    /// Exports what is queued, for at most `deadline`; what is left counts
    /// as dropped.
    pub(super) async fn flush_and_stop(self, deadline: Duration) {
        self.stop.cancel();
        let abort = self.handle.abort_handle();
        if tokio::time::timeout(deadline, self.handle).await.is_err() {
            abort.abort();
            tracing::warn!(
                ?deadline,
                "span export did not finish in time; the spans left are dropped"
            );
        }
    }
}

impl SpanProcessor for ExportQueue {
    fn on_start(&self, _span: &mut opentelemetry_sdk::trace::Span, _cx: &opentelemetry::Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        if self.spans.try_send(span).is_err() {
            count_dropped(1);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        // The flush is `ExportTask::flush_and_stop`, awaited by the set-up's
        // shutdown; the export task exports continuously anyway.
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        self.stop.cancel();
        Ok(())
    }
}

async fn run<E: SpanExporter>(
    exporter: E,
    mut rx: mpsc::Receiver<SpanData>,
    stop: CancellationToken,
) {
    let mut failing = false;
    let mut batch = Vec::with_capacity(MAX_BATCH);
    loop {
        tokio::select! {
            biased;
            () = stop.cancelled() => break,
            n = rx.recv_many(&mut batch, MAX_BATCH) => if n == 0 { break },
        }
        export(&exporter, std::mem::take(&mut batch), &mut failing).await;
    }
    // Shutdown: what was queued before it goes out too.
    rx.close();
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        export(&exporter, std::mem::take(&mut batch), &mut failing).await;
    }
    if let Err(e) = exporter.shutdown() {
        tracing::debug!(error = %e, "span exporter shutdown");
    }
}

/// One export call; a batch that does not go through counts as dropped.
/// Logs once when exports start failing and once when they recover.
async fn export<E: SpanExporter>(exporter: &E, batch: Vec<SpanData>, failing: &mut bool) {
    let n = batch.len();
    let error = match tokio::time::timeout(EXPORT_TIMEOUT, exporter.export(batch)).await {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e.to_string()),
        Err(_) => Some(format!("no answer within {EXPORT_TIMEOUT:?}")),
    };
    match error {
        Some(error) => {
            count_dropped(n);
            if !*failing {
                *failing = true;
                tracing::warn!(%error, spans = n, "span export failing; spans are dropped until the collector answers");
            }
        }
        None if *failing => {
            *failing = false;
            tracing::info!("span export recovered");
        }
        None => {}
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    use opentelemetry_sdk::error::OTelSdkError;

    use super::*;

    /// Keeps what it is given, or fails every call.
    #[derive(Debug, Clone, Default)]
    struct Sink {
        got: Arc<Mutex<usize>>,
        fail: bool,
    }

    impl SpanExporter for Sink {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            if self.fail {
                return Err(OTelSdkError::InternalFailure("refused".into()));
            }
            *self.got.lock().unwrap_or_else(|e| e.into_inner()) += batch.len();
            Ok(())
        }
    }

    fn span(sampled: bool) -> SpanData {
        let flags = if sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        };
        SpanData {
            span_context: SpanContext::new(
                TraceId::from(1),
                SpanId::from(1),
                flags,
                false,
                TraceState::NONE,
            ),
            parent_span_id: SpanId::INVALID,
            parent_span_is_remote: false,
            span_kind: opentelemetry::trace::SpanKind::Internal,
            name: "s".into(),
            start_time: std::time::SystemTime::now(),
            end_time: std::time::SystemTime::now(),
            attributes: Vec::new(),
            dropped_attributes_count: 0,
            events: opentelemetry_sdk::trace::SpanEvents::default(),
            links: opentelemetry_sdk::trace::SpanLinks::default(),
            status: opentelemetry::trace::Status::Unset,
            instrumentation_scope: opentelemetry::InstrumentationScope::default(),
        }
    }

    // One test touches the process-wide counter, so the figures are exact.
    #[tokio::test]
    async fn spans_are_exported_or_counted_as_dropped() {
        let before = dropped_spans();
        let sink = Sink::default();
        let (queue, task) = start(sink.clone());
        for _ in 0..10 {
            queue.on_end(span(true));
        }
        // Not sampled: neither exported nor dropped.
        queue.on_end(span(false));
        task.flush_and_stop(Duration::from_secs(10)).await;
        assert_eq!(*sink.got.lock().unwrap_or_else(|e| e.into_inner()), 10);
        assert_eq!(dropped_spans(), before);

        // A collector that refuses everything, and a queue that overflows
        // before the export task runs (this test's runtime is one thread).
        let refusing = Sink {
            fail: true,
            ..Sink::default()
        };
        let (queue, task) = start(refusing);
        for _ in 0..QUEUE_CAPACITY + 5 {
            queue.on_end(span(true));
        }
        assert_eq!(dropped_spans(), before + 5, "the full queue drops at once");
        task.flush_and_stop(Duration::from_secs(10)).await;
        assert_eq!(dropped_spans(), before + 5 + QUEUE_CAPACITY as u64);
    }
}
