//! The per-message spans (issue 17): one `receive` span per message from
//! receive to settle, with children for the outbox append, each `send`, each
//! DLQ write and each expiry.
//!
//! Invariants:
//!
//! - **Exported, not logged**: they are [`MessageSpan`]s, made on the
//!   OpenTelemetry SDK's tracer without `tracing`'s registry (which cost about
//!   half of tracing's overhead per message); a log line inside one (run in
//!   [`MessageSpan::scope`]) still names its trace and span ids.
//! - **Tracing off costs one atomic load per message**: every constructor
//!   returns the disabled span unless tracing is on, and a child of a
//!   disabled span is disabled, so no attribute is built and nothing is
//!   allocated.
//! - **The trace survives the outbox.** A `shared_outbox` message is stored
//!   with the trace context of its `receive` span ([`stamp`]), so the
//!   drainer's `send` span, in this run or after a restart, is a child of it;
//!   the send carries the `send` span's own context to the destination
//!   ([`outgoing`]), so the consumer continues the trace.

use std::borrow::Cow;

use ferry_shared::dlq::DlqReason;
use ferry_shared::envelope::{Envelope, TraceContext};
pub use ferry_shared::telemetry::message::MessageSpan;
use ferry_shared::telemetry::message::Parent;
use opentelemetry::KeyValue;
use opentelemetry::trace::SpanKind;

use crate::transports::{Address, SendError, Sender};

/// The span of one message from receive to settle, a child of the
/// publisher's span when the message carries a `traceparent`.
pub fn receive(route: &str, envelope: &Envelope) -> MessageSpan {
    MessageSpan::start(
        "receive",
        SpanKind::Consumer,
        Parent::Carried(&envelope.trace),
        || {
            vec![
                KeyValue::new("route", route.to_owned()),
                KeyValue::new("messaging.source", envelope.source.address.clone()),
                KeyValue::new("messaging.message.id", envelope.id.to_string()),
            ]
        },
    )
}

/// Stores the `receive` span's context in the envelope (before the append),
/// so the sends join this trace. Nothing changes when tracing is off.
pub fn stamp(receive: &MessageSpan, envelope: &mut Envelope) {
    if let Some(cx) = receive.context() {
        envelope.trace = cx;
    }
}

/// The outbox append of a message's records, a child of its `receive` span.
pub fn append(receive: &MessageSpan, partition: &str, records: usize) -> MessageSpan {
    MessageSpan::start(
        "outbox.append",
        SpanKind::Internal,
        Parent::Span(receive),
        || {
            vec![
                KeyValue::new("partition", partition.to_owned()),
                KeyValue::new("records", i64::try_from(records).unwrap_or(i64::MAX)),
            ]
        },
    )
}

/// Sends `envelope` to `binding`'s `address` in a `send` span (attempt
/// `attempt`, a child of the span the envelope's trace context names),
/// carrying that span's context to the destination; records the outcome.
pub async fn send(
    sender: &dyn Sender,
    envelope: &Envelope,
    binding: &str,
    address: &Address,
    attempt: u32,
) -> Result<(), SendError> {
    let mut span = send_span(binding, address.as_str(), attempt, &envelope.trace);
    let outgoing = outgoing(&span, envelope);
    let result = span.scope(sender.send(&outgoing, address)).await;
    sent(&mut span, &result);
    result
}
/// The span of one send of a message to a binding, a child of the span
/// stored with the message (or of the publisher's, for a message that never
/// went through an outbox).
fn send_span(binding: &str, address: &str, attempt: u32, trace: &TraceContext) -> MessageSpan {
    MessageSpan::start("send", SpanKind::Producer, Parent::Carried(trace), || {
        vec![
            KeyValue::new("binding", binding.to_owned()),
            KeyValue::new("messaging.destination", address.to_owned()),
            KeyValue::new("attempt", i64::from(attempt)),
        ]
    })
}

/// Records how a send ended on its span.
fn sent(span: &mut MessageSpan, result: &Result<(), SendError>) {
    if span.is_disabled() {
        return;
    }
    match result {
        Ok(()) => span.set_attribute(KeyValue::new("outcome", "accepted")),
        Err(e) => {
            let outcome = if e.is_permanent() {
                "permanent_error"
            } else {
                "transient_error"
            };
            span.set_attribute(KeyValue::new("outcome", outcome));
            let error = e.to_string();
            span.set_attribute(KeyValue::new("error", error.clone()));
            span.set_error(error);
        }
    }
}

/// A DLQ write or an expiry of a message for a binding (`reason`), a child
/// of the span stored with the message.
pub fn dispose(
    operation: &'static str,
    binding: &str,
    reason: &str,
    trace: &TraceContext,
) -> MessageSpan {
    MessageSpan::start(
        operation,
        SpanKind::Internal,
        Parent::Carried(trace),
        || {
            vec![
                KeyValue::new("binding", binding.to_owned()),
                KeyValue::new("reason", reason.to_owned()),
            ]
        },
    )
}

/// The span name of a disposal: an expiry (dropped or dead-lettered per
/// `on_expired`) or a DLQ write.
pub fn disposal_name(reason: DlqReason) -> &'static str {
    match reason {
        DlqReason::Expired => "expire",
        _ => "dlq.write",
    }
}

/// The envelope as it leaves for a destination: a copy carrying the `send`
/// span's context when tracing is on (the stored envelope keeps the context
/// it was stored with, for the next attempt), else the envelope itself.
fn outgoing<'a>(send: &MessageSpan, envelope: &'a Envelope) -> Cow<'a, Envelope> {
    match send.context() {
        Some(cx) => {
            let mut copy = envelope.clone();
            copy.trace = cx;
            Cow::Owned(copy)
        }
        None => Cow::Borrowed(envelope),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stores::conformance::envelope;

    // Tracing is never switched on in the agent's unit tests (no OTLP
    // set-up): every span is the disabled one and the envelope is untouched.
    #[test]
    fn tracing_off_makes_no_span_and_leaves_the_envelope_alone() {
        let mut e = envelope("a");
        e.trace.traceparent =
            Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into());
        let before = e.clone();
        let receive = receive("r", &e);
        assert!(receive.is_disabled());
        stamp(&receive, &mut e);
        assert_eq!(e, before);
        assert!(append(&receive, "b/r", 3).is_disabled());
        let send = send_span("x", "out/x", 1, &e.trace);
        assert!(send.is_disabled());
        assert!(matches!(outgoing(&send, &e), Cow::Borrowed(_)));
        assert!(dispose("expire", "x", "expired", &e.trace).is_disabled());
    }
}
