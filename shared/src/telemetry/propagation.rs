//! W3C trace context (`traceparent` / `tracestate`) between Ferry's spans and
//! what travels with a message or a request: the envelope's
//! [`TraceContext`] (stored in the outbox with the message, written to
//! outgoing MQTT v5 user properties) and gRPC metadata.
//!
//! Every function here is a no-op on a disabled span ([`Span::none`], or any
//! span when tracing is off), so callers need no check of their own.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::envelope::TraceContext;

/// The W3C `traceparent` header.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C `tracestate` header.
pub const TRACESTATE: &str = "tracestate";

impl Extractor for &TraceContext {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            TRACEPARENT => self.traceparent.as_deref(),
            TRACESTATE => self.tracestate.as_deref(),
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT, TRACESTATE]
    }
}

impl Injector for TraceContext {
    fn set(&mut self, key: &str, value: String) {
        match key {
            TRACEPARENT => self.traceparent = Some(value),
            TRACESTATE => self.tracestate = Some(value).filter(|v| !v.is_empty()),
            _ => {}
        }
    }
}

/// Makes `span` a child of the span `parent` names (a publisher's, or the
/// one Ferry stored with the message). A missing or malformed `traceparent`
/// leaves `span` the root of a new trace. Call it before the span is entered.
pub fn follow(span: &Span, parent: &TraceContext) {
    if span.is_disabled() {
        return;
    }
    if parent.traceparent.is_some() {
        let cx = TraceContextPropagator::new().extract(&parent);
        if cx.span().span_context().is_valid() {
            // Fails only for a span already started, which this one is not.
            let _ = span.set_parent(cx);
        }
    }
}

/// The trace context naming `span`, to store with a message or send with it;
/// `None` for a disabled span (the message then keeps what it carries).
pub fn context_of(span: &Span) -> Option<TraceContext> {
    if span.is_disabled() {
        return None;
    }
    let mut out = TraceContext::default();
    TraceContextPropagator::new().inject_context(&span.context(), &mut out);
    out.traceparent.is_some().then_some(out)
}

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

#[cfg(test)]
mod tests {
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    const PUBLISHER: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    #[test]
    fn a_span_follows_the_stored_context_and_names_itself() {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        let ours = tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("receive");
            follow(
                &span,
                &TraceContext {
                    traceparent: Some(PUBLISHER.into()),
                    tracestate: Some("k=v".into()),
                },
            );
            context_of(&span)
        });
        let ours = ours.expect("a context");
        let tp = ours.traceparent.as_deref().unwrap_or_default();
        assert!(
            tp.starts_with("00-0af7651916cd43dd8448eb211c80319c-"),
            "{tp}"
        );
        assert!(!tp.contains("b7ad6b7169203331"), "a span of its own: {tp}");
        assert_eq!(ours.tracestate.as_deref(), Some("k=v"));
        let _ = provider.force_flush();
        let spans = exporter.get_finished_spans().unwrap_or_default();
        assert_eq!(spans.len(), 1);
        assert_eq!(spans[0].parent_span_id.to_string(), "b7ad6b7169203331");
    }

    #[test]
    fn malformed_or_disabled_is_a_no_op() {
        let span = Span::none();
        follow(
            &span,
            &TraceContext {
                traceparent: Some("garbage".into()),
                tracestate: None,
            },
        );
        assert_eq!(context_of(&span), None);
    }
}
