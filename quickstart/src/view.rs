//! The live view and the final summary, as text.
//!
//! On a terminal the view is a small table redrawn in place about once a
//! second, below the lines that stay (events such as the outage). Anywhere
//! else (a pipe, a file, a test) each refresh is one line, `key=value`
//! fields, so it can be read by a program.
//!
//! Every figure comes from one of two counters, named in the header: the
//! quickstart's own subscriber on the upstream broker (`arrived`, `dups`,
//! latency) and the agent's metrics as the control plane has them, the
//! figures of `ferryctl metrics` (`received`, `sent`, `depth`).

use std::fmt::Write as _;
use std::io::Write as _;
use std::time::Duration;

use crate::fleet::{BindingFigures, LeaseHolder};
use crate::tally::Latency;

/// One refresh of the view.
#[derive(Debug, Clone)]
pub struct Frame {
    /// Time since the run started.
    pub elapsed: Duration,
    /// Readings the plant broker acknowledged.
    pub published: u64,
    /// Readings per second asked for.
    pub rate: f64,
    /// Whether the upstream listener accepts connections.
    pub upstream_up: bool,
    /// One row per destination.
    pub rows: Vec<Row>,
    /// The route's lease, when known.
    pub lease: Option<LeaseHolder>,
}

/// One destination in a [`Frame`].
#[derive(Debug, Clone)]
pub struct Row {
    /// The binding id.
    pub binding: String,
    /// Distinct readings the subscriber received.
    pub arrived: u64,
    /// Further copies of readings it had already received.
    pub duplicates: u64,
    /// The agent's figures, once it reported them.
    pub agent: Option<BindingFigures>,
    /// Publish → arrival over the last window; `None` when nothing arrived.
    pub latency: Option<Latency>,
}

/// Prints frames and events to stdout, redrawing on a terminal.
#[derive(Debug)]
pub struct Screen {
    terminal: bool,
    /// Lines of the last frame drawn on the terminal.
    drawn: usize,
}

impl Screen {
    /// A screen for stdout: redraws only when it is a terminal.
    pub fn stdout() -> Self {
        Self {
            terminal: std::io::IsTerminal::is_terminal(&std::io::stdout()),
            drawn: 0,
        }
    }

    /// Prints a line that stays (above the live view on a terminal).
    pub fn event(&mut self, line: &str) {
        self.write(&format!("{}{line}\n", self.erase()));
        self.drawn = 0;
    }

    /// Shows `frame`: redrawn in place on a terminal, one line otherwise.
    pub fn frame(&mut self, frame: &Frame) {
        if self.terminal {
            let table = table(frame);
            self.write(&format!("{}{table}", self.erase()));
            self.drawn = table.lines().count();
        } else {
            self.write(&format!("{}\n", line(frame)));
        }
    }

    /// Leaves the last frame on the screen: what follows goes below it.
    pub fn keep(&mut self) {
        self.drawn = 0;
    }

    /// Moves the cursor to the start of the last frame and clears from
    /// there (nothing when no frame is on the screen).
    fn erase(&self) -> String {
        if self.drawn == 0 {
            String::new()
        } else {
            format!("\x1b[{}F\x1b[J", self.drawn)
        }
    }

    fn write(&self, text: &str) {
        let mut out = std::io::stdout().lock();
        // A closed stdout (the reader went away) must not stop the run.
        if out
            .write_all(text.as_bytes())
            .and_then(|()| out.flush())
            .is_err()
        {
            tracing::debug!("stdout is closed");
        }
    }
}

/// The terminal table.
pub fn table(frame: &Frame) -> String {
    let mut out = String::new();
    let upstream = if frame.upstream_up { "up" } else { "DOWN" };
    let _ = writeln!(
        out,
        "{:>5.1} s  published {} readings ({}/s) on the plant broker   upstream listener: {upstream}",
        frame.elapsed.as_secs_f64(),
        frame.published,
        frame.rate,
    );
    let _ = writeln!(
        out,
        "  {:<14} {:>8} {:>5} │ agent {:>8} {:>8} {:>6} │ latency {:>7} {:>7}",
        "destination", "arrived", "dups", "received", "sent", "depth", "p50", "p99"
    );
    for row in &frame.rows {
        let (received, sent, depth) = agent_cells(row.agent.as_ref());
        let (p50, p99) = latency_cells(row.latency);
        let _ = writeln!(
            out,
            "  {:<14} {:>8} {:>5} │       {received:>8} {sent:>8} {depth:>6} │         {p50:>7} {p99:>7}",
            row.binding, row.arrived, row.duplicates,
        );
    }
    let _ = writeln!(out, "  {}", lease_text(frame.lease.as_ref()));
    out
}

/// The one-line form.
pub fn line(frame: &Frame) -> String {
    let upstream = if frame.upstream_up { "up" } else { "down" };
    let mut out = format!(
        "view t={:.1}s published={} upstream={upstream}",
        frame.elapsed.as_secs_f64(),
        frame.published,
    );
    for row in &frame.rows {
        let (received, sent, depth) = agent_cells(row.agent.as_ref());
        let (p50, p99) = latency_cells(row.latency);
        let _ = write!(
            out,
            " | {} arrived={} dups={} received={received} sent={sent} depth={depth} p50={p50} p99={p99}",
            row.binding, row.arrived, row.duplicates,
        );
    }
    let lease = match &frame.lease {
        Some(l) if !l.holder.is_empty() => format!("{}@{}", l.holder, l.version),
        _ => "-".to_owned(),
    };
    let _ = write!(out, " | lease={lease}");
    out
}

fn agent_cells(figures: Option<&BindingFigures>) -> (String, String, String) {
    match figures {
        Some(f) => (
            f.counters.received.to_string(),
            f.counters.sent.to_string(),
            f.depth.to_string(),
        ),
        None => ("-".into(), "-".into(), "-".into()),
    }
}

fn latency_cells(latency: Option<Latency>) -> (String, String) {
    match latency {
        Some(l) => (duration_text(l.p50), duration_text(l.p99)),
        None => ("-".into(), "-".into()),
    }
}

fn lease_text(lease: Option<&LeaseHolder>) -> String {
    match lease {
        Some(l) if !l.holder.is_empty() => format!(
            "lease {}: held by {} (fencing version {})",
            l.key, l.holder, l.version
        ),
        Some(l) => format!("lease {}: free", l.key),
        None => "lease: not taken yet".to_owned(),
    }
}

/// `850µs`, `12ms`, `1.4s`.
pub fn duration_text(d: Duration) -> String {
    if d < Duration::from_millis(1) {
        format!("{}µs", d.as_micros())
    } else if d < Duration::from_secs(1) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

/// One destination in the final summary.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The binding id.
    pub binding: String,
    /// Distinct readings received.
    pub distinct: u64,
    /// Further copies.
    pub duplicates: u64,
    /// Readings published and never received.
    pub missing: u64,
    /// Messages that were not readings of this run.
    pub foreign: u64,
    /// The agent's final figures, when it reported them.
    pub agent: Option<BindingFigures>,
}

/// The summary lines of a destination.
pub fn outcome_line(o: &Outcome) -> String {
    let mut out = format!(
        "summary {}: arrived {} distinct + {} duplicates, {} missing",
        o.binding, o.distinct, o.duplicates, o.missing
    );
    if o.foreign > 0 {
        let _ = write!(
            out,
            " (and {} messages that are not readings of this run)",
            o.foreign
        );
    }
    match &o.agent {
        Some(f) => {
            let c = &f.counters;
            let _ = write!(
                out,
                "; agent: received {}, sent {}, in flight {}, dead-lettered {}, dropped {}, expired {}, filtered {} ({}); sent {} what arrived",
                c.received,
                c.sent,
                c.in_flight,
                c.dead_lettered,
                c.dropped,
                c.expired,
                c.filtered,
                if f.conserved() {
                    "conservation law holds"
                } else {
                    "CONSERVATION LAW BROKEN"
                },
                if c.sent == o.distinct + o.duplicates {
                    "matches"
                } else {
                    "DOES NOT MATCH"
                },
            );
        }
        None => out.push_str("; agent: no figures reported"),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_shared::api::v1::DeliveryCounters;

    fn frame() -> Frame {
        Frame {
            elapsed: Duration::from_millis(12_340),
            published: 240,
            rate: 20.0,
            upstream_up: false,
            rows: vec![
                Row {
                    binding: "to-events".into(),
                    arrived: 230,
                    duplicates: 1,
                    agent: Some(BindingFigures {
                        counters: DeliveryCounters {
                            received: 240,
                            sent: 231,
                            in_flight: 9,
                            ..Default::default()
                        },
                        depth: 9,
                    }),
                    latency: Some(Latency {
                        p50: Duration::from_micros(2500),
                        p99: Duration::from_millis(1400),
                    }),
                },
                Row {
                    binding: "to-audit".into(),
                    arrived: 0,
                    duplicates: 0,
                    agent: None,
                    latency: None,
                },
            ],
            lease: Some(LeaseHolder {
                key: "quickstart/fan-out".into(),
                holder: "quickstart-agent/1a2b".into(),
                version: 3,
            }),
        }
    }

    #[test]
    fn a_line_carries_every_figure_as_key_value() {
        assert_eq!(
            line(&frame()),
            "view t=12.3s published=240 upstream=down \
             | to-events arrived=230 dups=1 received=240 sent=231 depth=9 p50=2ms p99=1.4s \
             | to-audit arrived=0 dups=0 received=- sent=- depth=- p50=- p99=- \
             | lease=quickstart-agent/1a2b@3"
        );
    }

    #[test]
    fn the_table_has_a_row_per_destination_and_the_lease() {
        let table = table(&frame());
        assert_eq!(table.lines().count(), 5, "{table}");
        assert!(table.contains("upstream listener: DOWN"), "{table}");
        assert!(
            table.contains("held by quickstart-agent/1a2b (fencing version 3)"),
            "{table}"
        );
    }

    #[test]
    fn the_summary_says_whether_the_agent_and_the_subscriber_agree() {
        let mut o = Outcome {
            binding: "to-events".into(),
            distinct: 10,
            duplicates: 1,
            missing: 0,
            foreign: 0,
            agent: Some(BindingFigures {
                counters: DeliveryCounters {
                    received: 10,
                    sent: 11,
                    ..Default::default()
                },
                depth: 0,
            }),
        };
        let text = outcome_line(&o);
        assert!(text.starts_with("summary to-events: arrived 10 distinct + 1 duplicates, 0 missing; agent: received 10, sent 11"), "{text}");
        assert!(text.contains("CONSERVATION LAW BROKEN"), "{text}");
        assert!(text.ends_with("sent matches what arrived"), "{text}");
        o.duplicates = 0;
        assert!(outcome_line(&o).ends_with("sent DOES NOT MATCH what arrived"));
        o.agent = None;
        assert!(outcome_line(&o).ends_with("no figures reported"));
    }
}
