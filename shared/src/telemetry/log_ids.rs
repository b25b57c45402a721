//! Trace and span ids on log lines, without formatting them into every span.
//!
//! A log line written inside a traced span names that span's `trace_id` and
//! `span_id`, so the line leads to its trace (a message span's, inside
//! [`super::message::MessageSpan::scope`]). The ids are read from the span's
//! OpenTelemetry context when the line is written, not recorded as span
//! fields: the log layer would format every field of every span into a string
//! when the span is created (whether or not a line is ever written inside
//! it), which measured about a sixth of tracing's cost per message
//! (`docs/benchmarks.md`, tracing overhead).
//!
//! Text lines end with ` trace_id=… span_id=…`; JSON lines start with
//! `"trace_id":"…","span_id":"…"`. Without a traced current span, or with
//! tracing off, the line is the inner format's, untouched.

use std::fmt::{self, Write as _};

use opentelemetry::trace::TraceContextExt as _;
use tracing::Subscriber;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// An event format that adds the current span's trace and span ids to the
/// line `F` writes.
pub struct WithTraceIds<F>(pub F);

impl<S, N, F> FormatEvent<S, N> for WithTraceIds<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> fmt::Result {
        let Some((trace_id, span_id)) = current_ids() else {
            return self.0.format_event(ctx, writer, event);
        };
        let mut line = String::new();
        self.0.format_event(ctx, Writer::new(&mut line), event)?;
        writer.write_str(&with_ids(&line, &trace_id, &span_id))
    }
}

/// The ids of the message span the line is written in (the innermost span
/// of the data path, see [`super::message`]), else of the current span when it
/// is traced. The log layer is installed as the global default, so
/// `Span::current` inside its callback reaches the registry (a scoped
/// dispatcher would see none while dispatching).
fn current_ids() -> Option<(String, String)> {
    if !super::is_tracing() {
        return None;
    }
    if let Some((trace_id, span_id)) = super::message::current_ids() {
        return Some((trace_id.to_string(), span_id.to_string()));
    }
    let span = tracing::Span::current();
    if span.is_disabled() {
        return None;
    }
    let cx = span.context();
    let otel = cx.span();
    let sc = otel.span_context();
    sc.is_valid()
        .then(|| (sc.trace_id().to_string(), sc.span_id().to_string()))
}

/// `line` (one formatted event, text or JSON) with the ids added: as the
/// first members of a JSON object, else at the end of the text line.
fn with_ids(line: &str, trace_id: &str, span_id: &str) -> String {
    if let Some(members) = line.strip_prefix('{') {
        let sep = if members.trim_start().starts_with('}') {
            ""
        } else {
            ","
        };
        return format!("{{\"trace_id\":\"{trace_id}\",\"span_id\":\"{span_id}\"{sep}{members}");
    }
    let (text, newline) = match line.strip_suffix('\n') {
        Some(text) => (text, "\n"),
        None => (line, ""),
    };
    let mut out = String::with_capacity(line.len() + 64);
    let _ = write!(out, "{text} trace_id={trace_id} span_id={span_id}{newline}");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: &str = "0af7651916cd43dd8448eb211c80319c";
    const S: &str = "b7ad6b7169203331";

    #[test]
    fn text_lines_end_with_the_ids() {
        assert_eq!(
            with_ids("2026-12-02 WARN ferry: send failed\n", T, S),
            format!("2026-12-02 WARN ferry: send failed trace_id={T} span_id={S}\n")
        );
        assert_eq!(
            with_ids("no newline", T, S),
            format!("no newline trace_id={T} span_id={S}")
        );
    }

    #[test]
    fn json_lines_start_with_the_ids() {
        assert_eq!(
            with_ids("{\"level\":\"WARN\"}\n", T, S),
            format!("{{\"trace_id\":\"{T}\",\"span_id\":\"{S}\",\"level\":\"WARN\"}}\n")
        );
        assert_eq!(
            with_ids("{}\n", T, S),
            format!("{{\"trace_id\":\"{T}\",\"span_id\":\"{S}\"}}\n")
        );
    }
}
