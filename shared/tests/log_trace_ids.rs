//! Log lines inside a traced span, a `tracing` span or a message span, name
//! its trace and span ids, without the span's fields (issue 17).
//!
//! A test binary of its own: `telemetry::init` installs the process's global
//! subscriber, as every Ferry binary does.

use std::io::Write;
use std::sync::{Arc, Mutex};

use ferry_shared::envelope::TraceContext;
use ferry_shared::telemetry::message::{MessageSpan, Parent};
use ferry_shared::telemetry::{self, Settings};
use opentelemetry::KeyValue;
use opentelemetry::trace::SpanKind;
use tracing_subscriber::fmt::writer::BoxMakeWriter;

#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lines").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

const PUBLISHER_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";

/// The `(trace_id, span_id)` a text line ends with.
fn ids(line: &str) -> Option<(&str, &str)> {
    let (_, rest) = line.split_once(" trace_id=")?;
    let (trace_id, rest) = rest.split_once(" span_id=")?;
    Some((trace_id, rest.split(' ').next().unwrap_or_default()))
}

#[tokio::test]
async fn a_line_inside_a_traced_span_names_its_trace_but_not_its_fields() {
    let lines = Lines::default();
    let writer = lines.clone();
    let mut settings = Settings::new("ferry-test");
    settings.log_writer = BoxMakeWriter::new(move || writer.clone());
    settings.ansi = false;
    // Nothing listens there: spans are made and their export fails quietly.
    settings.otlp_endpoint = Some("http://127.0.0.1:9".into());
    let telemetry = telemetry::init(settings).expect("telemetry");

    let publisher = TraceContext {
        traceparent: Some(format!("00-{PUBLISHER_TRACE}-b7ad6b7169203331-01")),
        tracestate: None,
    };
    let message = MessageSpan::start(
        "receive",
        SpanKind::Consumer,
        Parent::Carried(&publisher),
        || vec![KeyValue::new("route", "secret-route")],
    );
    let ours = message.context().expect("a traced message span");
    message
        .scope(async { tracing::warn!("inside the message") })
        .await;
    let rpc = tracing::info_span!(target: "ferry_test", "rpc", method = "secret-method");
    rpc.in_scope(|| tracing::warn!("inside the rpc"));
    tracing::warn!("outside any span");
    telemetry.shutdown().await;

    let text = String::from_utf8(lines.0.lock().expect("lines").clone()).expect("utf-8");
    let line = |needle: &str| {
        text.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line {needle:?} in {text}"))
            .to_owned()
    };
    let inside = line("inside the message");
    let (trace_id, span_id) = ids(&inside).expect("ids on the line inside the message");
    assert_eq!(trace_id, PUBLISHER_TRACE, "{inside}");
    let traceparent = ours.traceparent.unwrap_or_default();
    assert!(
        traceparent.contains(&format!("-{span_id}-")),
        "{inside} vs {traceparent}"
    );
    assert!(
        !inside.contains("secret-route"),
        "span fields formatted: {inside}"
    );

    let in_rpc = line("inside the rpc");
    let (trace_id, _) = ids(&in_rpc).expect("ids on the line inside the rpc");
    assert_eq!(trace_id.len(), 32, "{in_rpc}");
    assert_ne!(trace_id, PUBLISHER_TRACE, "{in_rpc}");

    let outside = line("outside any span");
    assert!(!outside.contains("trace_id="), "{outside}");
}
