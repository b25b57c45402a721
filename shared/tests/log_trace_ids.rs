//! Log lines inside a traced span name its trace and span ids, and the
//! per-message spans are not formatted into log lines (issue 17).
//!
//! A test binary of its own: `telemetry::init` installs the process's global
//! subscriber, as every Ferry binary does.

use std::io::Write;
use std::sync::{Arc, Mutex};

use ferry_shared::telemetry::{self, MESSAGE_TARGET, Settings};
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

#[tokio::test]
async fn a_line_inside_a_message_span_names_its_trace_but_not_its_fields() {
    let lines = Lines::default();
    let writer = lines.clone();
    let mut settings = Settings::new("ferry-test");
    settings.log_writer = BoxMakeWriter::new(move || writer.clone());
    settings.ansi = false;
    // Nothing listens there: spans are made and their export fails quietly.
    settings.otlp_endpoint = Some("http://127.0.0.1:9".into());
    let telemetry = telemetry::init(settings).expect("telemetry");

    let span = tracing::info_span!(target: MESSAGE_TARGET, "receive", route = "secret-route");
    span.in_scope(|| tracing::warn!("inside the message"));
    tracing::warn!("outside any span");
    telemetry.shutdown().await;

    let text = String::from_utf8(lines.0.lock().expect("lines").clone()).expect("utf-8");
    let inside = text
        .lines()
        .find(|l| l.contains("inside the message"))
        .expect("the line inside");
    let outside = text
        .lines()
        .find(|l| l.contains("outside any span"))
        .expect("the line outside");
    let trace_id = inside
        .split_once(" trace_id=")
        .map(|(_, rest)| rest.split(' ').next().unwrap_or_default())
        .expect("a trace id on the line inside");
    assert_eq!(trace_id.len(), 32, "{inside}");
    assert!(inside.contains(" span_id="), "{inside}");
    assert!(
        !inside.contains("secret-route"),
        "span fields formatted: {inside}"
    );
    assert!(!outside.contains("trace_id="), "{outside}");
}
