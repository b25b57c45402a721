//! An OTLP trace receiver in the test process: the OTLP/gRPC `TraceService`
//! (from `opentelemetry-proto`, on tonic) on a free loopback port, keeping
//! every span it is sent, so a test can point an agent's
//! `telemetry.otlp_endpoint` at it and assert on the trace.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::wait;

/// One received span, with what the tests look at.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    /// Hex trace id.
    pub trace_id: String,
    /// Hex span id.
    pub span_id: String,
    /// Hex parent span id; empty for a root.
    pub parent_span_id: String,
    /// The span name.
    pub name: String,
    /// String (or stringified) attributes.
    pub attributes: Vec<(String, String)>,
    /// The resource's `service.name`.
    pub service_name: String,
}

impl Span {
    /// The value of attribute `key`.
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// What the receiver was sent: every span, or (for a benchmark) only how many.
#[derive(Clone, Default)]
struct Sink {
    spans: Arc<Mutex<Vec<Span>>>,
    count: Arc<std::sync::atomic::AtomicU64>,
    count_only: bool,
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let request = request.into_inner();
        let n: usize = request
            .resource_spans
            .iter()
            .flat_map(|rs| &rs.scope_spans)
            .map(|ss| ss.spans.len())
            .sum();
        self.count
            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        if self.count_only {
            return Ok(tonic::Response::new(ExportTraceServiceResponse {
                partial_success: None,
            }));
        }
        let mut spans = Vec::new();
        for rs in request.resource_spans {
            let service_name = rs
                .resource
                .iter()
                .flat_map(|r| r.attributes.iter())
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref())
                .map(any_text)
                .unwrap_or_default();
            for s in rs.scope_spans.into_iter().flat_map(|ss| ss.spans) {
                spans.push(Span {
                    trace_id: hex(&s.trace_id),
                    span_id: hex(&s.span_id),
                    parent_span_id: hex(&s.parent_span_id),
                    name: s.name,
                    attributes: s
                        .attributes
                        .iter()
                        .map(|kv| {
                            (
                                kv.key.clone(),
                                kv.value.as_ref().map(any_text).unwrap_or_default(),
                            )
                        })
                        .collect(),
                    service_name: service_name.clone(),
                });
            }
        }
        self.spans
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(spans);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn any_text(v: &opentelemetry_proto::tonic::common::v1::AnyValue) -> String {
    match &v.value {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

/// The running receiver; stops when dropped.
pub struct TraceReceiver {
    endpoint: String,
    spans: Sink,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl TraceReceiver {
    /// Listens on a free loopback port and keeps every span.
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_with(Sink::default()).await
    }

    /// Listens on a free loopback port and only counts the spans (a local sink for a
    /// benchmark: [`Self::spans`] stays empty).
    pub async fn start_counting() -> anyhow::Result<Self> {
        Self::start_with(Sink {
            count_only: true,
            ..Sink::default()
        })
        .await
    }

    async fn start_with(spans: Sink) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        let stop = CancellationToken::new();
        let server = tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(spans.clone()))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                stop.clone().cancelled_owned(),
            );
        let task = tokio::spawn(async move {
            if let Err(e) = server.await {
                eprintln!("OTLP test receiver: {e}");
            }
        });
        Ok(Self {
            endpoint,
            spans,
            stop,
            task,
        })
    }

    /// `http://127.0.0.1:PORT`, for `telemetry.otlp_endpoint`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// How many spans were received so far.
    pub fn count(&self) -> u64 {
        self.spans.count.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Span> {
        self.spans
            .spans
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Waits until the spans received satisfy `done`; returns them.
    pub async fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&[Span]) -> bool,
    ) -> anyhow::Result<Vec<Span>> {
        wait::until(timeout, what, || std::future::ready(done(&self.spans()))).await?;
        Ok(self.spans())
    }
}

impl Drop for TraceReceiver {
    fn drop(&mut self) {
        self.stop.cancel();
        self.task.abort();
    }
}
