//! W3C trace context (`traceparent` / `tracestate`) between Ferry's `tracing`
//! spans and gRPC requests (the message spans carry theirs in the envelope:
//! [`super::message`]).
//!
//! Every function here is a no-op on a disabled span ([`Span::none`], or any
//! span when tracing is off), so callers need no check of their own.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// gRPC metadata as a carrier.
struct Metadata<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for Metadata<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(key, value);
        }
    }
}

/// Writes the current span's trace context into outgoing gRPC metadata, so
/// the server's span continues the caller's trace.
pub fn inject_current(metadata: &mut tonic::metadata::MetadataMap) {
    let span = Span::current();
    if span.is_disabled() {
        return;
    }
    TraceContextPropagator::new().inject_context(&span.context(), &mut Metadata(metadata));
}

/// HTTP request headers as a carrier.
struct Headers<'a>(&'a tonic::codegen::http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// Makes `span` a child of the trace context an incoming request carries in
/// its headers (when it carries a valid one).
pub fn follow_headers(span: &Span, headers: &tonic::codegen::http::HeaderMap) {
    if span.is_disabled() {
        return;
    }
    let cx = TraceContextPropagator::new().extract(&Headers(headers));
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}
