//! A batch of the SDK's [`SpanData`] written straight into the protobuf bytes
//! of an OTLP `ExportTraceServiceRequest`, without the intermediate proto
//! structs the SDK's exporter builds (`opentelemetry_proto::transform`) and
//! then encodes with prost.
//!
//! Invariants:
//!
//! - **Same message as the SDK's conversion**: decoded, the bytes equal what
//!   `group_spans_by_resource_and_scope` builds from the same batch and
//!   resource, field by field (the tests compare them): one `ResourceSpans`,
//!   one `ScopeSpans` per instrumentation scope in the order the scopes first
//!   appear, the spans in batch order; fields proto3 leaves out when they
//!   hold their default are left out here too, and the messages the SDK
//!   always sets (`resource`, `scope`, `status`, an attribute's `value`) are
//!   always written.
//! - **One pass, no length computed twice**: the message is written back to
//!   front ([`Reversed`]), so a nested message's length is known when its
//!   header is written; prost's `encode` instead asks every nested message
//!   for its `encoded_len` at each level above it.
//! - **No panic on any value**: an attribute value of a kind this encoder does
//!   not know (the API's enums are non-exhaustive) is written as an empty
//!   `AnyValue`.

use std::time::{SystemTime, UNIX_EPOCH};

use opentelemetry::trace::{SpanContext, SpanId, SpanKind, Status};
use opentelemetry::{Array, InstrumentationScope, KeyValue, Value};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SpanData;

/// Wire types of the protobuf encoding.
const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LEN: u32 = 2;
const FIXED32: u32 = 5;

/// `SpanFlags`: the span's context says whether its parent is remote, and
/// whether it is.
const CONTEXT_HAS_IS_REMOTE: u32 = 0x100;
const CONTEXT_IS_REMOTE: u32 = 0x200;

/// The exporter's resource, kept as the API's key-values: written once per
/// batch.
#[derive(Debug, Default, Clone)]
pub(super) struct ResourceFields {
    attributes: Vec<KeyValue>,
    schema_url: String,
}

impl From<&Resource> for ResourceFields {
    fn from(resource: &Resource) -> Self {
        ResourceFields {
            attributes: resource
                .iter()
                .map(|(k, v)| KeyValue::new(k.clone(), v.clone()))
                .collect(),
            schema_url: resource.schema_url().unwrap_or_default().to_owned(),
        }
    }
}

/// The `ExportTraceServiceRequest` carrying `spans` from `resource`.
pub(super) fn request(resource: &ResourceFields, spans: &[SpanData]) -> Vec<u8> {
    // Scopes in the order they first appear; Ferry's spans share one, so the
    // linear search is one comparison per span.
    let mut scopes: Vec<&InstrumentationScope> = Vec::new();
    let scope_of: Vec<usize> = spans
        .iter()
        .map(|span| {
            let scope = &span.instrumentation_scope;
            scopes.iter().position(|s| *s == scope).unwrap_or_else(|| {
                scopes.push(scope);
                scopes.len() - 1
            })
        })
        .collect();
    // About 200 bytes per span of Ferry's, so one allocation is usually enough.
    let mut w = Reversed::with_capacity(256 * spans.len() + 256);
    // ExportTraceServiceRequest.resource_spans = 1
    w.message(1, |w| {
        // ResourceSpans: resource = 1, scope_spans = 2, schema_url = 3
        w.string(3, &resource.schema_url);
        for (index, scope) in scopes.iter().enumerate().rev() {
            w.message(2, |w| {
                // ScopeSpans: scope = 1, spans = 2, schema_url = 3
                w.string(3, scope.schema_url().unwrap_or_default());
                for (span, _) in spans
                    .iter()
                    .zip(&scope_of)
                    .rev()
                    .filter(|(_, s)| **s == index)
                {
                    w.message(2, |w| write_span(w, span));
                }
                w.message(1, |w| write_scope(w, scope));
            });
        }
        // Resource: attributes = 1
        w.message(1, |w| w.key_values(1, &resource.attributes));
    });
    w.finish()
}

/// InstrumentationScope: name = 1, version = 2, attributes = 3.
fn write_scope(w: &mut Reversed, scope: &InstrumentationScope) {
    for kv in scope.attributes().collect::<Vec<_>>().into_iter().rev() {
        w.message(3, |w| write_key_value(w, kv));
    }
    w.string(2, scope.version().unwrap_or_default());
    w.string(1, scope.name());
}

/// Span, fields written from the last to the first.
fn write_span(w: &mut Reversed, span: &SpanData) {
    let context = &span.span_context;
    w.fixed32(16, flags(context, span.parent_span_is_remote));
    // status = 15: message = 2, code = 3 (unset 0, ok 1, error 2)
    w.message(15, |w| match &span.status {
        Status::Unset => {}
        Status::Ok => w.uint(3, 1),
        Status::Error { description } => {
            w.uint(3, 2);
            w.string(2, description);
        }
    });
    w.uint(14, u64::from(span.links.dropped_count));
    for link in span.links.links.iter().rev() {
        // Link: trace_id 1, span_id 2, trace_state 3, attributes 4,
        // dropped_attributes_count 5, flags 6
        w.message(13, |w| {
            let linked = &link.span_context;
            w.fixed32(6, flags(linked, linked.is_remote()));
            w.uint(5, u64::from(link.dropped_attributes_count));
            w.key_values(4, &link.attributes);
            w.string(3, &linked.trace_state().header());
            w.bytes(2, &linked.span_id().to_bytes());
            w.bytes(1, &linked.trace_id().to_bytes());
        });
    }
    w.uint(12, u64::from(span.events.dropped_count));
    for event in span.events.events.iter().rev() {
        // Event: time_unix_nano 1, name 2, attributes 3, dropped 4
        w.message(11, |w| {
            w.uint(4, u64::from(event.dropped_attributes_count));
            w.key_values(3, &event.attributes);
            w.string(2, &event.name);
            w.fixed64(1, nanos(event.timestamp));
        });
    }
    w.uint(10, u64::from(span.dropped_attributes_count));
    w.key_values(9, &span.attributes);
    w.fixed64(8, nanos(span.end_time));
    w.fixed64(7, nanos(span.start_time));
    w.uint(6, kind(&span.span_kind));
    w.string(5, &span.name);
    if span.parent_span_id != SpanId::INVALID {
        w.bytes(4, &span.parent_span_id.to_bytes());
    }
    w.string(3, &context.trace_state().header());
    w.bytes(2, &context.span_id().to_bytes());
    w.bytes(1, &context.trace_id().to_bytes());
}

/// The W3C trace flags and whether the context's parent is remote.
fn flags(context: &SpanContext, remote: bool) -> u32 {
    let remote = if remote { CONTEXT_IS_REMOTE } else { 0 };
    u32::from(context.trace_flags().to_u8()) | CONTEXT_HAS_IS_REMOTE | remote
}

/// OTLP's `SpanKind` numbers (0 is "unspecified", which the API has not).
fn kind(kind: &SpanKind) -> u64 {
    match kind {
        SpanKind::Internal => 1,
        SpanKind::Server => 2,
        SpanKind::Client => 3,
        SpanKind::Producer => 4,
        SpanKind::Consumer => 5,
    }
}

/// Nanoseconds since the epoch; a time before it is 0, as in the SDK.
fn nanos(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// KeyValue: key = 1, value = 2 (always present).
fn write_key_value(w: &mut Reversed, kv: &KeyValue) {
    w.message(2, |w| write_any_value(w, &kv.value));
    w.string(1, kv.key.as_str());
}

/// The body of an AnyValue: one member of its oneof, always written (a
/// oneof member is present even at its default).
fn write_any_value(w: &mut Reversed, value: &Value) {
    match value {
        Value::String(s) => w.bytes(1, s.as_str().as_bytes()),
        Value::Bool(b) => w.varint_field(2, u64::from(*b)),
        // int64: two's complement, as a 64-bit varint.
        Value::I64(i) => w.varint_field(3, u64::from_ne_bytes(i.to_ne_bytes())),
        Value::F64(f) => w.fixed64_field(4, f.to_bits()),
        // ArrayValue: values = 1, each an AnyValue.
        Value::Array(array) => w.message(5, |w| match array {
            Array::Bool(values) => {
                for b in values.iter().rev() {
                    w.message(1, |w| w.varint_field(2, u64::from(*b)));
                }
            }
            Array::I64(values) => {
                for i in values.iter().rev() {
                    w.message(1, |w| {
                        w.varint_field(3, u64::from_ne_bytes(i.to_ne_bytes()))
                    });
                }
            }
            Array::F64(values) => {
                for f in values.iter().rev() {
                    w.message(1, |w| w.fixed64_field(4, f.to_bits()));
                }
            }
            Array::String(values) => {
                for s in values.iter().rev() {
                    w.message(1, |w| w.bytes(1, s.as_str().as_bytes()));
                }
            }
            _ => {}
        }),
        _ => {}
    }
}

/// Protobuf written back to front: every write appends its bytes reversed,
/// and [`Reversed::finish`] turns the whole buffer around. A message's body
/// is therefore written before its header, when its length is known; fields
/// are written last to first (so they come out in field order) and repeated
/// fields in reverse.
struct Reversed {
    buf: Vec<u8>,
}

impl Reversed {
    fn with_capacity(capacity: usize) -> Self {
        Reversed {
            buf: Vec::with_capacity(capacity),
        }
    }

    /// The message, front to back.
    fn finish(mut self) -> Vec<u8> {
        self.buf.reverse();
        self.buf
    }

    /// `bytes`, reversed. A byte loop rather than a copy and a reverse:
    /// nearly every write is a few bytes long.
    fn raw(&mut self, bytes: &[u8]) {
        self.buf.extend(bytes.iter().rev());
    }

    /// A varint, its last byte first.
    fn varint(&mut self, v: u64) {
        if v < 0x80 {
            self.buf.push(v as u8);
            return;
        }
        let n = prost::encoding::encoded_len_varint(v);
        self.buf.push((v >> (7 * (n - 1))) as u8);
        for i in (0..n - 1).rev() {
            self.buf.push((v >> (7 * i)) as u8 | 0x80);
        }
    }

    fn key(&mut self, field: u32, wire_type: u32) {
        self.varint(u64::from(field << 3 | wire_type));
    }

    /// A length-delimited field, written even when empty.
    fn bytes(&mut self, field: u32, bytes: &[u8]) {
        self.raw(bytes);
        self.varint(bytes.len() as u64);
        self.key(field, LEN);
    }

    /// A string field; proto3 leaves out the empty string.
    fn string(&mut self, field: u32, s: &str) {
        if !s.is_empty() {
            self.bytes(field, s.as_bytes());
        }
    }

    /// A varint field, written even when 0.
    fn varint_field(&mut self, field: u32, v: u64) {
        self.varint(v);
        self.key(field, VARINT);
    }

    /// An unsigned or enum field; proto3 leaves out 0.
    fn uint(&mut self, field: u32, v: u64) {
        if v != 0 {
            self.varint_field(field, v);
        }
    }

    /// A fixed64 or double field, written even when 0.
    fn fixed64_field(&mut self, field: u32, v: u64) {
        // Little-endian on the wire, so big-endian back to front.
        self.buf.extend_from_slice(&v.to_be_bytes());
        self.key(field, FIXED64);
    }

    /// A fixed64 field; proto3 leaves out 0.
    fn fixed64(&mut self, field: u32, v: u64) {
        if v != 0 {
            self.fixed64_field(field, v);
        }
    }

    /// A fixed32 field; proto3 leaves out 0.
    fn fixed32(&mut self, field: u32, v: u32) {
        if v != 0 {
            self.buf.extend_from_slice(&v.to_be_bytes());
            self.key(field, FIXED32);
        }
    }

    /// A nested message whose body `body` writes.
    fn message(&mut self, field: u32, body: impl FnOnce(&mut Self)) {
        let start = self.buf.len();
        body(self);
        let len = self.buf.len() - start;
        self.varint(len as u64);
        self.key(field, LEN);
    }

    /// A repeated KeyValue field.
    fn key_values(&mut self, field: u32, kvs: &[KeyValue]) {
        for kv in kvs.iter().rev() {
            self.message(field, |w| write_key_value(w, kv));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;
    use std::time::Duration;

    use opentelemetry::trace::{Event, Link, SpanContext, TraceFlags, TraceId, TraceState};
    use opentelemetry::{Array, StringValue};
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::common::v1::KeyValue as ProtoKeyValue;
    use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span as ProtoSpan};
    use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
    use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
    use opentelemetry_sdk::trace::{SpanEvents, SpanLinks};
    use prost::Message as _;

    use super::*;

    fn context(trace: u128, span: u64, sampled: bool, remote: bool, state: &str) -> SpanContext {
        let flags = if sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        };
        let state = state.parse::<TraceState>().expect("valid trace state");
        SpanContext::new(
            TraceId::from(trace),
            SpanId::from(span),
            flags,
            remote,
            state,
        )
    }

    /// Attribute values of every kind the API has, including the defaults
    /// proto3 would otherwise leave out.
    fn every_value() -> Vec<KeyValue> {
        vec![
            KeyValue::new("ferry.route", "orders"),
            KeyValue::new("empty", ""),
            KeyValue::new("yes", true),
            KeyValue::new("no", false),
            KeyValue::new("count", 3_i64),
            KeyValue::new("zero", 0_i64),
            KeyValue::new("negative", -42_i64),
            KeyValue::new("ratio", 0.25_f64),
            KeyValue::new("nought", 0.0_f64),
            KeyValue::new("bools", Value::Array(Array::Bool(vec![true, false]))),
            KeyValue::new("ints", Value::Array(Array::I64(vec![1, -1, i64::MAX]))),
            KeyValue::new("floats", Value::Array(Array::F64(vec![1.5, -0.0]))),
            KeyValue::new(
                "strings",
                Value::Array(Array::String(vec![
                    StringValue::from("a"),
                    StringValue::from(""),
                ])),
            ),
            KeyValue::new("none", Value::Array(Array::I64(Vec::new()))),
        ]
    }

    fn span(name: &'static str, ctx: SpanContext, parent: u64, remote: bool) -> SpanData {
        let start = UNIX_EPOCH + Duration::from_nanos(1_764_000_000_123_456_789);
        SpanData {
            span_context: ctx,
            parent_span_id: SpanId::from(parent),
            parent_span_is_remote: remote,
            span_kind: SpanKind::Internal,
            name: Cow::Borrowed(name),
            start_time: start,
            end_time: start + Duration::from_micros(35),
            attributes: Vec::new(),
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: Status::Unset,
            instrumentation_scope: InstrumentationScope::builder("ferry").build(),
        }
    }

    /// Spans of every shape the agent makes, and the shapes the SDK allows
    /// beyond them (events, links, dropped counts, other scopes).
    fn batch() -> Vec<SpanData> {
        let trace = 0x4bf9_2f35_77b3_4da6_a3ce_929d_0e0e_4736;
        // `receive`: consumer, child of a publisher's remote context with a
        // trace state.
        let mut receive = span(
            "receive",
            context(trace, 1, true, false, "ferry=1,vendor=x"),
            0xb7ad_6b71_6920_3331,
            true,
        );
        receive.span_kind = SpanKind::Consumer;
        receive.attributes = every_value();
        // `outbox.append`: a local child, no attributes.
        let append = span(
            "outbox.append",
            context(trace, 2, true, false, ""),
            1,
            false,
        );
        // `send`: producer, failed, with an event and a link.
        let mut send = span("send", context(trace, 3, true, false, ""), 1, false);
        send.span_kind = SpanKind::Producer;
        send.attributes = vec![KeyValue::new("ferry.destination", "archive")];
        send.status = Status::error("broker refused: quota");
        send.events = SpanEvents::default();
        send.events.events = vec![
            Event::new(
                "retry",
                UNIX_EPOCH + Duration::from_secs(1_764_000_001),
                vec![KeyValue::new("attempt", 2_i64)],
                1,
            ),
            Event::new("gave up", UNIX_EPOCH, Vec::new(), 0),
        ];
        send.events.dropped_count = 3;
        send.links = SpanLinks::default();
        send.links.links = vec![
            Link::new(
                context(7, 8, true, true, "k=v"),
                vec![KeyValue::new("why", "batch")],
                2,
            ),
            Link::new(context(9, 10, false, false, ""), Vec::new(), 0),
        ];
        send.links.dropped_count = 1;
        send.dropped_attributes_count = 4;
        // A root span (no parent), not sampled flags, status ok, server and
        // client kinds, and a span of another scope in between.
        let mut root = span("expire", context(trace + 1, 4, false, false, ""), 0, false);
        root.status = Status::Ok;
        root.span_kind = SpanKind::Server;
        let mut other = span("grpc", context(trace + 2, 5, true, false, ""), 0, false);
        other.span_kind = SpanKind::Client;
        other.instrumentation_scope = InstrumentationScope::builder("other")
            .with_version("1.2.3")
            .with_schema_url("https://opentelemetry.io/schemas/1.30.0")
            .with_attributes([KeyValue::new("scope.attr", 1_i64)])
            .build();
        let last = span("dlq.write", context(trace, 6, true, false, ""), 1, false);
        vec![receive, append, send, other, root, last]
    }

    fn resource() -> Resource {
        Resource::builder_empty()
            .with_service_name("ferry-agent")
            .with_attributes([
                KeyValue::new("deployment.environment", "test"),
                KeyValue::new("host.cores", 2_i64),
            ])
            .with_schema_url(
                Vec::<KeyValue>::new(),
                "https://opentelemetry.io/schemas/1.29.0",
            )
            .build()
    }

    fn assert_key_values(what: &str, got: &[ProtoKeyValue], want: &[ProtoKeyValue]) {
        assert_eq!(got.len(), want.len(), "{what}: number of attributes");
        for (g, w) in got.iter().zip(want) {
            assert_eq!(g.key, w.key, "{what}: key");
            assert_eq!(g.value, w.value, "{what}: value of {}", w.key);
            assert_eq!(
                g.key_strindex, w.key_strindex,
                "{what}: key_strindex of {}",
                w.key
            );
        }
    }

    fn assert_span(got: &ProtoSpan, want: &ProtoSpan) {
        let n = &want.name;
        assert_eq!(got.trace_id, want.trace_id, "{n}: trace_id");
        assert_eq!(got.span_id, want.span_id, "{n}: span_id");
        assert_eq!(got.trace_state, want.trace_state, "{n}: trace_state");
        assert_eq!(
            got.parent_span_id, want.parent_span_id,
            "{n}: parent_span_id"
        );
        assert_eq!(got.flags, want.flags, "{n}: flags");
        assert_eq!(got.name, want.name, "{n}: name");
        assert_eq!(got.kind, want.kind, "{n}: kind");
        assert_eq!(
            got.start_time_unix_nano, want.start_time_unix_nano,
            "{n}: start"
        );
        assert_eq!(got.end_time_unix_nano, want.end_time_unix_nano, "{n}: end");
        assert_key_values(n, &got.attributes, &want.attributes);
        assert_eq!(
            got.dropped_attributes_count, want.dropped_attributes_count,
            "{n}: dropped attributes"
        );
        assert_eq!(got.events.len(), want.events.len(), "{n}: events");
        for (g, w) in got.events.iter().zip(&want.events) {
            assert_eq!(g.time_unix_nano, w.time_unix_nano, "{n}: event time");
            assert_eq!(g.name, w.name, "{n}: event name");
            assert_key_values(&w.name, &g.attributes, &w.attributes);
            assert_eq!(
                g.dropped_attributes_count, w.dropped_attributes_count,
                "{n}: event dropped"
            );
        }
        assert_eq!(
            got.dropped_events_count, want.dropped_events_count,
            "{n}: dropped events"
        );
        assert_eq!(got.links.len(), want.links.len(), "{n}: links");
        for (g, w) in got.links.iter().zip(&want.links) {
            assert_eq!(g.trace_id, w.trace_id, "{n}: link trace_id");
            assert_eq!(g.span_id, w.span_id, "{n}: link span_id");
            assert_eq!(g.trace_state, w.trace_state, "{n}: link trace_state");
            assert_key_values("link", &g.attributes, &w.attributes);
            assert_eq!(
                g.dropped_attributes_count, w.dropped_attributes_count,
                "{n}: link dropped"
            );
            assert_eq!(g.flags, w.flags, "{n}: link flags");
        }
        assert_eq!(
            got.dropped_links_count, want.dropped_links_count,
            "{n}: dropped links"
        );
        assert_eq!(got.status, want.status, "{n}: status");
        // Whatever a field added to the proto later: the whole span.
        assert_eq!(got, want, "{n}");
    }

    fn assert_scope_spans(got: &ScopeSpans, want: &ScopeSpans) {
        assert_eq!(got.schema_url, want.schema_url, "scope schema_url");
        assert_eq!(got.scope, want.scope, "scope");
        assert_eq!(got.spans.len(), want.spans.len(), "spans of the scope");
        for (g, w) in got.spans.iter().zip(&want.spans) {
            assert_span(g, w);
        }
    }

    fn assert_resource_spans(got: &ResourceSpans, want: &ResourceSpans) {
        assert_eq!(got.schema_url, want.schema_url, "resource schema_url");
        let (g, w) = (got.resource.as_ref(), want.resource.as_ref());
        assert_eq!(g.is_some(), w.is_some(), "resource present");
        if let (Some(g), Some(w)) = (g, w) {
            assert_key_values("resource", &g.attributes, &w.attributes);
            assert_eq!(g.dropped_attributes_count, w.dropped_attributes_count);
            assert_eq!(g.entity_refs, w.entity_refs);
        }
        assert_eq!(got.scope_spans.len(), want.scope_spans.len(), "scopes");
        for (g, w) in got.scope_spans.iter().zip(&want.scope_spans) {
            assert_scope_spans(g, w);
        }
    }

    /// What the SDK's exporter sends for `spans`, and what this encoder
    /// sends, decoded.
    fn both(
        resource: &Resource,
        spans: Vec<SpanData>,
    ) -> (ExportTraceServiceRequest, ExportTraceServiceRequest) {
        let bytes = request(&ResourceFields::from(resource), &spans);
        let got = ExportTraceServiceRequest::decode(bytes.as_slice()).expect("the bytes decode");
        let want = ExportTraceServiceRequest {
            resource_spans: group_spans_by_resource_and_scope(
                spans,
                &ResourceAttributesWithSchema::from(resource),
            ),
        };
        (got, want)
    }

    #[test]
    fn every_span_shape_encodes_as_the_sdk_converts_it() {
        let (got, want) = both(&resource(), batch());
        assert_eq!(want.resource_spans.len(), 1);
        assert_eq!(
            want.resource_spans[0].scope_spans.len(),
            2,
            "two scopes in the batch"
        );
        assert_eq!(got.resource_spans.len(), want.resource_spans.len());
        assert_resource_spans(&got.resource_spans[0], &want.resource_spans[0]);
        assert_eq!(got, want);
    }

    #[test]
    fn an_unset_resource_and_a_single_span_encode_as_the_sdk_converts_them() {
        let (got, want) = both(&Resource::builder_empty().build(), batch().split_off(5));
        assert_resource_spans(&got.resource_spans[0], &want.resource_spans[0]);
        assert_eq!(got, want);
    }

    #[test]
    fn the_bytes_are_those_prost_writes_for_the_sdk_conversion() {
        let spans = batch();
        let resource = resource();
        let ours = request(&ResourceFields::from(&resource), &spans);
        let theirs = ExportTraceServiceRequest {
            resource_spans: group_spans_by_resource_and_scope(
                spans,
                &ResourceAttributesWithSchema::from(&resource),
            ),
        }
        .encode_to_vec();
        assert!(
            ours == theirs,
            "the bytes differ from prost's encoding of the SDK's conversion"
        );
    }

    #[test]
    fn varints_of_every_length_round_trip() {
        for v in [
            0,
            1,
            127,
            128,
            300,
            16_383,
            16_384,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            let mut w = Reversed::with_capacity(16);
            w.varint(v);
            let bytes = w.finish();
            assert_eq!(bytes.len(), prost::encoding::encoded_len_varint(v), "{v}");
            assert_eq!(
                prost::encoding::decode_varint(&mut bytes.as_slice()).ok(),
                Some(v)
            );
        }
    }
}
