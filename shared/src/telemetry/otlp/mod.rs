//! Ferry's own OTLP/gRPC span exporter: a batch of the SDK's span data is
//! written straight into the bytes of an `ExportTraceServiceRequest`
//! ([`encode`]) and sent as one unary call to
//! `opentelemetry.proto.collector.trace.v1.TraceService/Export` through a
//! pass-through codec, instead of the SDK's exporter converting every span
//! into `opentelemetry-proto` structs and prost encoding those (about 55 k
//! of the 130 k instructions per message tracing cost; `docs/benchmarks.md`,
//! ADR 0011).
//!
//! Invariants:
//!
//! - **Same request, same collector**: the bytes are the request the SDK's
//!   exporter sends for the batch (`encode`'s tests), to the same endpoint,
//!   each call bounded by the same timeout.
//! - **Same failures, retried the same way**: the gRPC codes the OTLP
//!   specification calls retryable are retried with the SDK's recommended
//!   back-off (3 retries from 100 ms, doubling to at most 1.6 s) while the
//!   timeout allows; any other failure is the batch's failure, which the
//!   export queue counts as dropped.
//! - **Only where it can stand in**: [`OtlpExporter::for_endpoint`] declines
//!   (and the set-up keeps the SDK's exporter) for what this exporter does
//!   not do: an endpoint other than `http://` (TLS, or a scheme-less endpoint
//!   the SDK resolves with `OTEL_EXPORTER_OTLP_INSECURE`), and the standard
//!   headers and compression variables the SDK's exporter reads.

mod encode;

use std::time::{Duration, Instant};

use http::uri::PathAndQuery;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use prost::bytes::{Buf as _, BufMut as _, Bytes};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::config::Env;

/// The OTLP trace service's export method.
const EXPORT_PATH: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";

/// Variables the SDK's exporter reads that this one does not honour: while
/// one is set, the SDK's exporter is kept.
const SDK_ONLY_VARIABLES: [&str; 4] = [
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
    "OTEL_EXPORTER_OTLP_COMPRESSION",
    "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
];

/// Retries after the first attempt, and the back-off between them (the SDK
/// exporter's recommended policy, without its jitter).
const MAX_RETRIES: u32 = 3;
const FIRST_DELAY: Duration = Duration::from_millis(100);
const MAX_DELAY: Duration = Duration::from_millis(1600);

/// The exporter: a lazily connected channel and the resource's fields.
#[derive(Debug, Clone)]
pub(super) struct OtlpExporter {
    channel: Channel,
    resource: encode::ResourceFields,
    timeout: Duration,
}

impl OtlpExporter {
    /// The exporter for `endpoint`, or why the SDK's exporter must serve it
    /// instead. Must run inside a tokio runtime (the channel's worker).
    pub(super) fn for_endpoint(
        endpoint: &str,
        timeout: Duration,
        env: &dyn Env,
    ) -> Result<Self, String> {
        if !endpoint.starts_with("http://") {
            return Err(format!("endpoint {endpoint:?} is not plain http://"));
        }
        if let Some(name) = SDK_ONLY_VARIABLES
            .into_iter()
            .find(|name| env.var(name).is_some_and(|v| !v.trim().is_empty()))
        {
            return Err(format!("{name} is set"));
        }
        let channel = Endpoint::from_shared(endpoint.to_owned())
            .and_then(|e| e.user_agent(concat!("ferry/", env!("CARGO_PKG_VERSION"))))
            .map_err(|e| format!("endpoint {endpoint:?}: {e}"))?
            .timeout(timeout)
            .connect_lazy();
        Ok(OtlpExporter {
            channel,
            resource: encode::ResourceFields::default(),
            timeout,
        })
    }

    /// One export call.
    async fn call(&self, body: Bytes) -> Result<(), Status> {
        let mut grpc = tonic::client::Grpc::new(self.channel.clone());
        grpc.ready()
            .await
            .map_err(|e| Status::unavailable(format!("collector not ready: {e}")))?;
        grpc.unary::<_, (), _>(
            tonic::Request::new(body),
            PathAndQuery::from_static(EXPORT_PATH),
            BytesCodec,
        )
        .await
        .map(drop)
    }
}

/// Whether the OTLP specification says a call failing with `code` may be
/// retried (`RESOURCE_EXHAUSTED` only with the server's retry information,
/// which this exporter does not read, so not).
fn retryable(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable
            | Code::Cancelled
            | Code::DeadlineExceeded
            | Code::Aborted
            | Code::OutOfRange
            | Code::DataLoss
    )
}

impl SpanExporter for OtlpExporter {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let body = Bytes::from(encode::request(&self.resource, &batch));
        drop(batch);
        let start = Instant::now();
        let mut delay = FIRST_DELAY;
        let mut retries = 0;
        loop {
            let status = match self.call(body.clone()).await {
                Ok(()) => return Ok(()),
                Err(status) => status,
            };
            let retry = retryable(status.code())
                && retries < MAX_RETRIES
                && start.elapsed() + delay < self.timeout;
            if !retry {
                // The code only: a collector's message may echo credentials.
                return Err(OTelSdkError::InternalFailure(format!(
                    "OTLP export failed: gRPC {:?} after {} attempt(s)",
                    status.code(),
                    retries + 1
                )));
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(MAX_DELAY);
            retries += 1;
        }
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.resource = encode::ResourceFields::from(resource);
    }
}

/// A codec that sends the request's bytes as they are and ignores the
/// response body: an `ExportTraceServiceResponse` only reports a partial
/// success, which the SDK's exporter logs through its own internal logs
/// (not enabled in Ferry) and does not count either.
#[derive(Debug, Clone, Copy, Default)]
struct BytesCodec;

impl Codec for BytesCodec {
    type Encode = Bytes;
    type Decode = ();
    type Encoder = BytesCodec;
    type Decoder = BytesCodec;

    fn encoder(&mut self) -> Self::Encoder {
        *self
    }

    fn decoder(&mut self) -> Self::Decoder {
        *self
    }
}

impl Encoder for BytesCodec {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for BytesCodec {
    type Item = ();
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<()>, Status> {
        src.advance(src.remaining());
        Ok(Some(()))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
        TraceService, TraceServiceServer,
    };
    use opentelemetry_proto::tonic::collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
    };
    use tokio_util::sync::CancellationToken;

    use super::*;

    /// A collector that answers the first `failures` calls with `code`,
    /// then accepts; it counts calls and the spans it accepted.
    #[derive(Clone)]
    struct Collector {
        code: Code,
        failures: usize,
        calls: Arc<AtomicUsize>,
        spans: Arc<AtomicUsize>,
    }

    #[tonic::async_trait]
    impl TraceService for Collector {
        async fn export(
            &self,
            request: tonic::Request<ExportTraceServiceRequest>,
        ) -> Result<tonic::Response<ExportTraceServiceResponse>, Status> {
            if self.calls.fetch_add(1, Ordering::SeqCst) < self.failures {
                return Err(Status::new(self.code, "not now"));
            }
            let spans = request
                .into_inner()
                .resource_spans
                .iter()
                .flat_map(|r| &r.scope_spans)
                .map(|s| s.spans.len())
                .sum();
            self.spans.fetch_add(spans, Ordering::SeqCst);
            Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
        }
    }

    /// Exports three spans to a collector failing `failures` times with
    /// `code`: the result, the calls it saw and the spans it accepted.
    async fn export_to(code: Code, failures: usize) -> (OTelSdkResult, usize, usize) {
        let collector = Collector {
            code,
            failures,
            calls: Arc::default(),
            spans: Arc::default(),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a loopback port");
        let endpoint = format!("http://{}", listener.local_addr().expect("its address"));
        let stop = CancellationToken::new();
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(collector.clone()))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    stop.clone().cancelled_owned(),
                ),
        );
        let none = |_: &str| None;
        let exporter = OtlpExporter::for_endpoint(&endpoint, Duration::from_secs(5), &none)
            .expect("a plain http endpoint");
        let span = opentelemetry_sdk::trace::SpanData {
            span_context: opentelemetry::trace::SpanContext::empty_context(),
            parent_span_id: opentelemetry::trace::SpanId::INVALID,
            parent_span_is_remote: false,
            span_kind: opentelemetry::trace::SpanKind::Internal,
            name: "send".into(),
            start_time: std::time::SystemTime::now(),
            end_time: std::time::SystemTime::now(),
            attributes: Vec::new(),
            dropped_attributes_count: 0,
            events: opentelemetry_sdk::trace::SpanEvents::default(),
            links: opentelemetry_sdk::trace::SpanLinks::default(),
            status: opentelemetry::trace::Status::Unset,
            instrumentation_scope: opentelemetry::InstrumentationScope::default(),
        };
        let result = exporter
            .export(vec![span.clone(), span.clone(), span])
            .await;
        stop.cancel();
        server
            .await
            .expect("the collector task")
            .expect("the collector ran");
        (
            result,
            collector.calls.load(Ordering::SeqCst),
            collector.spans.load(Ordering::SeqCst),
        )
    }

    #[tokio::test]
    async fn a_collector_gets_the_batch_and_retryable_failures_are_retried() {
        let (result, calls, spans) = export_to(Code::Ok, 0).await;
        assert!(result.is_ok(), "{result:?}");
        assert_eq!((calls, spans), (1, 3));

        let (result, calls, spans) = export_to(Code::Unavailable, 2).await;
        assert!(result.is_ok(), "{result:?}");
        assert_eq!((calls, spans), (3, 3), "two retries, then accepted");

        let (result, calls, spans) = export_to(Code::Unavailable, 10).await;
        let error = result.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(error.contains("Unavailable after 4 attempt(s)"), "{error}");
        assert_eq!((calls, spans), (4, 0), "three retries at most");

        let (result, calls, spans) = export_to(Code::InvalidArgument, 1).await;
        let error = result.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            error.contains("InvalidArgument after 1 attempt(s)"),
            "{error}"
        );
        assert_eq!((calls, spans), (1, 0), "not retried");
    }

    #[tokio::test]
    async fn the_sdk_exporter_keeps_what_this_one_does_not_do() {
        let none = |_: &str| None;
        let timeout = Duration::from_secs(1);
        assert!(OtlpExporter::for_endpoint("http://127.0.0.1:4317", timeout, &none).is_ok());
        let https = OtlpExporter::for_endpoint("https://collector:4317", timeout, &none);
        assert!(https.is_err_and(|e| e.contains("not plain http://")));
        let bare = OtlpExporter::for_endpoint("collector:4317", timeout, &none);
        assert!(bare.is_err());
        let headers = |name: &str| {
            (name == "OTEL_EXPORTER_OTLP_TRACES_HEADERS").then(|| "api-key=secret".to_owned())
        };
        let with_headers = OtlpExporter::for_endpoint("http://collector:4317", timeout, &headers);
        assert_eq!(
            with_headers.err().as_deref(),
            Some("OTEL_EXPORTER_OTLP_TRACES_HEADERS is set")
        );
        let empty = |_: &str| Some(" ".to_owned());
        assert!(OtlpExporter::for_endpoint("http://collector:4317", timeout, &empty).is_ok());
    }
}
