//! Spans made per message, directly on the OpenTelemetry SDK's tracer.
//!
//! The agent makes about five spans per message of a fan-out ×3 (`receive`,
//! `outbox.append`, a `send` per binding). Made as `tracing` spans, each went
//! through the registry (a slab slot, an extensions map), the OpenTelemetry
//! layer's field visitors and a `SpanBuilder` kept until close, and its trace
//! context in and out through the propagator's text map: about 90 k
//! instructions per message of the 180 k that tracing added
//! (`docs/benchmarks.md`, tracing overhead). A [`MessageSpan`] is the SDK's
//! span itself, with its attributes given as key-values.
//!
//! Invariants:
//!
//! - **Tracing off costs one atomic load per span**: [`MessageSpan::start`]
//!   returns the disabled span unless [`super::is_tracing`]; a disabled span
//!   allocates nothing, has no context and its children are disabled.
//! - **Same trace model as every other span**: the spans come from the
//!   provider's tracer named `ferry` (its sampler, resource and bounded export
//!   queue); a span ends when it is dropped.
//! - **Log lines still lead to the trace**: inside [`MessageSpan::scope`] a
//!   log line names the message span's trace and span ids (`log_ids`), as a
//!   line inside a `tracing` span does; the message span wins because it is
//!   the innermost in the data path. [`MessageSpan::instrument`] is the form
//!   that owns the span.
//! - **W3C trace context in and out** (`traceparent`, `tracestate`): a
//!   malformed `traceparent` is ignored (the span starts a new trace), never
//!   an error, since it comes from publishers.

use std::borrow::Cow;
use std::future::Future;
use std::str::FromStr as _;
use std::sync::RwLock;

use futures::FutureExt as _;
use futures::future::Either;
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceContextExt as _, TraceFlags, TraceId, TraceState,
    Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::SdkTracer;

use crate::envelope::TraceContext;

/// The tracer the message spans come from while spans are exported.
static TRACER: RwLock<Option<SdkTracer>> = RwLock::new(None);

tokio::task_local! {
    /// The ids of the message span a task is running in, for log lines.
    static CURRENT: (TraceId, SpanId);
}

/// Makes message spans from `tracer` (at start-up) or stops making them.
pub(super) fn set_tracer(tracer: Option<SdkTracer>) {
    let mut slot = TRACER
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    *slot = tracer;
}

/// The trace and span ids of the message span the current task runs in.
pub(super) fn current_ids() -> Option<(TraceId, SpanId)> {
    CURRENT.try_with(|ids| *ids).ok()
}

/// One span of a message's journey through the agent, or the disabled span.
///
/// Boxed: an SDK span is a few hundred bytes, and the disabled one is carried
/// through every delivery's future all the same (see [`MessageSpan::scope`]).
#[derive(Debug, Default)]
pub struct MessageSpan(Option<Box<opentelemetry_sdk::trace::Span>>);

/// What a new span's parent is.
#[derive(Clone, Copy, Debug)]
pub enum Parent<'a> {
    /// The span a stored or received trace context names (a publisher's, or
    /// the one Ferry stored with the message); none or a malformed one makes
    /// the span the root of a new trace.
    Carried(&'a TraceContext),
    /// Another message span of this agent.
    Span(&'a MessageSpan),
}

impl MessageSpan {
    /// The disabled span: no context, no export, no cost.
    pub fn none() -> Self {
        Self(None)
    }

    /// Starts span `name` of `kind` under `parent`, with `attributes` (built
    /// only when tracing is on, hence the closure).
    pub fn start(
        name: &'static str,
        kind: SpanKind,
        parent: Parent<'_>,
        attributes: impl FnOnce() -> Vec<KeyValue>,
    ) -> Self {
        if !super::is_tracing() {
            return Self::none();
        }
        let parent = match parent {
            Parent::Carried(carried) => parse(carried),
            Parent::Span(span) => match &span.0 {
                Some(span) => Some(opentelemetry::trace::Span::span_context(span.as_ref()).clone()),
                None => return Self::none(),
            },
        };
        let parent = parent.map_or_else(Context::new, |sc| {
            Context::new().with_remote_span_context(sc)
        });
        let tracer = TRACER
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(tracer) = tracer.as_ref() else {
            return Self::none();
        };
        let builder = tracer
            .span_builder(name)
            .with_kind(kind)
            .with_attributes(attributes());
        Self(Some(Box::new(tracer.build_with_context(builder, &parent))))
    }

    /// Whether this is the disabled span.
    pub fn is_disabled(&self) -> bool {
        self.0.is_none()
    }

    /// The context naming this span, to store with a message or send with it;
    /// `None` for the disabled span (the message then keeps what it carries).
    pub fn context(&self) -> Option<TraceContext> {
        let sc = self.span_context()?;
        let state = sc.trace_state().header();
        Some(TraceContext {
            traceparent: Some(format_traceparent(sc)),
            tracestate: (!state.is_empty()).then_some(state),
        })
    }

    /// Adds an attribute.
    pub fn set_attribute(&mut self, attribute: KeyValue) {
        if let Some(span) = &mut self.0 {
            opentelemetry::trace::Span::set_attribute(span.as_mut(), attribute);
        }
    }

    /// Marks the span failed with `description`.
    pub fn set_error(&mut self, description: impl Into<Cow<'static, str>>) {
        if let Some(span) = &mut self.0 {
            opentelemetry::trace::Span::set_status(span.as_mut(), Status::error(description));
        }
    }

    /// Runs `future` inside this span: log lines written meanwhile name it.
    ///
    /// A function returning a future rather than an `async fn`, here and in
    /// [`MessageSpan::instrument`]: an `async fn` keeps its argument beside
    /// the future it awaits, so each wrapper doubled the size of what it
    /// wrapped, and the routes move a whole per-delivery future into their
    /// set of deliveries in flight, for every message (`docs/benchmarks.md`,
    /// issue 15).
    pub fn scope<F: Future>(&self, future: F) -> impl Future<Output = F::Output> + use<F> {
        match self.span_context() {
            Some(sc) => Either::Left(CURRENT.scope((sc.trace_id(), sc.span_id()), future)),
            None => Either::Right(future),
        }
    }

    /// Runs `future` inside this span, which ends when `future` is done (or
    /// dropped): the owning form of [`MessageSpan::scope`], for a future
    /// returned to a caller.
    pub fn instrument<F: Future>(self, future: F) -> impl Future<Output = F::Output> {
        self.scope(future).map(move |output| {
            drop(self);
            output
        })
    }

    fn span_context(&self) -> Option<&SpanContext> {
        let sc = opentelemetry::trace::Span::span_context(self.0.as_deref()?);
        sc.is_valid().then_some(sc)
    }
}

/// The span context a W3C `traceparent` (with its `tracestate`) names, if
/// it is well formed: version `00` with exactly four fields, or a later
/// version with at least four; ids not all zero. Parsed by hand: this runs
/// for every send of every traced message, and the SDK's `from_hex` (through
/// `from_str_radix`) cost several times more.
fn parse(carried: &TraceContext) -> Option<SpanContext> {
    let mut fields = carried.traceparent.as_deref()?.trim().split('-');
    let (version, trace_id, span_id, flags) = (
        fields.next()?,
        fields.next()?,
        fields.next()?,
        fields.next()?,
    );
    let [version] = hex_bytes::<1>(version)?;
    if version == 0xff || (version == 0 && fields.next().is_some()) {
        return None;
    }
    let trace_id = TraceId::from_bytes(hex_bytes(trace_id)?);
    let span_id = SpanId::from_bytes(hex_bytes(span_id)?);
    let [flags] = hex_bytes::<1>(flags)?;
    let state = carried
        .tracestate
        .as_deref()
        .and_then(|s| TraceState::from_str(s).ok())
        .unwrap_or_default();
    let sc = SpanContext::new(
        trace_id,
        span_id,
        TraceFlags::new(flags & TraceFlags::SAMPLED.to_u8()),
        true,
        state,
    );
    sc.is_valid().then_some(sc)
}

/// `N` bytes from exactly `2N` lowercase hex digits (W3C trace context
/// allows no other case).
fn hex_bytes<const N: usize>(digits: &str) -> Option<[u8; N]> {
    let digits = digits.as_bytes();
    if digits.len() != 2 * N {
        return None;
    }
    let value = |d: u8| match d {
        b'0'..=b'9' => Some(d - b'0'),
        b'a'..=b'f' => Some(d - b'a' + 10),
        _ => None,
    };
    let mut bytes = [0; N];
    for (byte, pair) in bytes.iter_mut().zip(digits.chunks_exact(2)) {
        *byte = (value(pair[0])? << 4) | value(pair[1])?;
    }
    Some(bytes)
}

/// The `traceparent` of `sc`: `00-{trace id}-{span id}-{flags}`, written by
/// hand for the same reason as [`parse`].
fn format_traceparent(sc: &SpanContext) -> String {
    let mut out = String::with_capacity(55);
    out.push_str("00-");
    push_hex(&mut out, &sc.trace_id().to_bytes());
    out.push('-');
    push_hex(&mut out, &sc.span_id().to_bytes());
    out.push('-');
    push_hex(&mut out, &[sc.trace_flags().to_u8()]);
    out
}

/// Appends `bytes` as lowercase hex.
fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};

    use super::*;

    const PUBLISHER: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    fn carried(traceparent: &str, tracestate: Option<&str>) -> TraceContext {
        TraceContext {
            traceparent: Some(traceparent.into()),
            tracestate: tracestate.map(Into::into),
        }
    }

    #[test]
    fn a_traceparent_round_trips() {
        let sc = parse(&carried(PUBLISHER, Some("k=v,a=b"))).expect("valid");
        assert!(sc.is_remote() && sc.is_sampled());
        assert_eq!(format_traceparent(&sc), PUBLISHER);
        assert_eq!(sc.trace_state().header(), "k=v,a=b");
        let unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
        let sc = parse(&carried(unsampled, None)).expect("valid");
        assert!(!sc.is_sampled());
        assert_eq!(format_traceparent(&sc), unsampled);
    }

    #[test]
    fn later_versions_keep_their_first_four_fields() {
        let sc = parse(&carried(
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-03-extra",
            None,
        ))
        .expect("a later version is read as 00");
        // Only the sampled flag is known; the others are not passed on.
        assert_eq!(format_traceparent(&sc), PUBLISHER);
    }

    #[test]
    fn malformed_traceparents_are_ignored() {
        for bad in [
            "",
            "garbage",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b716920333-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1",
            "00-0af7651916cd43dd8448eb211c8031+c-b7ad6b7169203331-01",
        ] {
            assert!(parse(&carried(bad, None)).is_none(), "{bad:?}");
        }
        // A bad tracestate is dropped, the traceparent kept.
        let sc = parse(&carried(PUBLISHER, Some("not a state"))).expect("valid");
        assert_eq!(sc.trace_state().header(), "");
    }

    /// `is_tracing` and the tracer are process-wide: the tests that read or
    /// set them take turns.
    static GLOBAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

    /// The wrappers add a few words to what they wrap, not a copy of it:
    /// the routes move every delivery's future, spans and all, once per
    /// message (issue 15).
    #[test]
    fn wrapping_a_future_does_not_double_its_size() {
        let payload = [7u8; 4096];
        let inner = || async move { payload.len() };
        let bare = std::mem::size_of_val(&inner());
        let span = MessageSpan::none();
        let scoped = std::mem::size_of_val(&span.scope(inner()));
        let instrumented = std::mem::size_of_val(&MessageSpan::none().instrument(inner()));
        assert!(scoped <= bare + 256, "scope: {scoped} bytes around {bare}");
        assert!(
            instrumented <= bare + 256,
            "instrument: {instrumented} bytes around {bare}"
        );
        assert_eq!(std::mem::size_of::<MessageSpan>(), 8, "a boxed span");
    }

    #[tokio::test]
    async fn tracing_off_makes_only_disabled_spans() {
        let _turn = GLOBAL.lock().await;
        let span = MessageSpan::start(
            "receive",
            SpanKind::Consumer,
            Parent::Carried(&carried(PUBLISHER, None)),
            || panic!("attributes are not built with tracing off"),
        );
        assert!(span.is_disabled());
        assert_eq!(span.context(), None);
        let child = MessageSpan::start(
            "outbox.append",
            SpanKind::Internal,
            Parent::Span(&span),
            Vec::new,
        );
        assert!(child.is_disabled());
        assert_eq!(child.instrument(async { current_ids() }).await, None);
    }

    #[tokio::test]
    async fn spans_join_their_parents_and_name_themselves() {
        let _turn = GLOBAL.lock().await;
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        set_tracer(Some(provider.tracer("ferry")));
        super::super::TRACING.store(true, Ordering::Relaxed);

        let mut receive = MessageSpan::start(
            "receive",
            SpanKind::Consumer,
            Parent::Carried(&carried(PUBLISHER, Some("k=v"))),
            || vec![KeyValue::new("route", "r")],
        );
        let ours = receive.context().expect("a context");
        let append = MessageSpan::start(
            "outbox.append",
            SpanKind::Internal,
            Parent::Span(&receive),
            Vec::new,
        );
        let ids = append.scope(async { current_ids() }).await;
        let append_cx = append.context().expect("a context");
        drop(append);
        receive.set_error("refused");
        drop(receive);

        super::super::TRACING.store(false, Ordering::Relaxed);
        set_tracer(None);
        let _ = provider.force_flush();
        let spans = exporter.get_finished_spans().unwrap_or_default();
        let [append, receive] = spans.as_slice() else {
            panic!("two spans: {spans:#?}");
        };
        let traceparent = ours.traceparent.unwrap_or_default();
        assert_eq!(
            traceparent,
            format!(
                "00-0af7651916cd43dd8448eb211c80319c-{}-01",
                receive.span_context.span_id()
            )
        );
        assert_eq!(ours.tracestate.as_deref(), Some("k=v"));
        assert_eq!(receive.parent_span_id.to_string(), "b7ad6b7169203331");
        assert!(receive.parent_span_is_remote);
        assert_eq!(receive.span_kind, SpanKind::Consumer);
        assert_eq!(receive.attributes, [KeyValue::new("route", "r")]);
        assert_eq!(receive.status, Status::error("refused"));
        assert_eq!(append.parent_span_id, receive.span_context.span_id());
        assert!(!append.parent_span_is_remote);
        assert_eq!(
            ids,
            Some((
                append.span_context.trace_id(),
                append.span_context.span_id()
            ))
        );
        assert!(
            append_cx
                .traceparent
                .unwrap_or_default()
                .contains(&append.span_context.span_id().to_string())
        );
    }
}
