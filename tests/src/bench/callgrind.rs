//! Instructions per message: the agent under `valgrind --tool=callgrind`.
//!
//! Wall-clock and CPU figures move with the machine's load; the number of instructions the
//! agent executes per message does not (much), so it is what a change to the agent's code is
//! judged by on a shared machine. Callgrind slows the agent down about fifty-fold, so such a run
//! moves a small number of messages and its throughput means nothing.
//!
//! **How a run is counted.** The agent starts under Callgrind, collecting from the start. After
//! the warm-up (every connection up, one probe delivered to every destination):
//!
//! 1. *Idle baseline*: `callgrind_control --zero`, [`IDLE_BASELINE`] of nothing, then
//!    `callgrind_control --dump`: the instructions the agent spends per second with no message
//!    (timers, statistics, lease renewals).
//! 2. *Window*: `--zero` just before the first measured publish, `--dump` as soon as every
//!    destination holds every message.
//!
//! Each dump is a file `callgrind.out.PID.N` holding only the costs since the last zero; its
//! `summary:` line is the instruction count (`Ir`). Reported: the window's `Ir` per message
//! (gross), and the same minus the idle rate times the window's length (net: what the messages
//! themselves cost). The dump files stay in the run's directory for `callgrind_annotate`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::time::Instant;

/// How long the idle baseline is measured.
pub const IDLE_BASELINE: Duration = Duration::from_secs(5);
/// How long a dump file may take to appear after `callgrind_control --dump` returned.
const DUMP_TIMEOUT: Duration = Duration::from_secs(30);

/// The options the agent runs under.
const VALGRIND_ARGS: [&str; 4] = [
    "--tool=callgrind",
    // Threads take turns fairly (the agent's Tokio workers and its SQLite thread).
    "--fair-sched=yes",
    "--dump-instr=no",
    // Each dump names its functions itself, so `callgrind_annotate` reads one on its own.
    "--compress-strings=no",
];

/// Fails with the fix when Valgrind's tools are not installed.
pub fn check_installed() -> anyhow::Result<()> {
    for tool in ["valgrind", "callgrind_control"] {
        let found = Command::new(tool)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            bail!(
                "{tool} not found: install Valgrind (`apt-get install valgrind`) for --callgrind"
            );
        }
    }
    Ok(())
}

/// `valgrind --tool=callgrind … -- {agent}`, writing its dumps into `dir`.
pub fn command(agent: &Path, dir: &Path) -> Command {
    let mut command = Command::new("valgrind");
    command
        .args(VALGRIND_ARGS)
        .arg(format!(
            "--callgrind-out-file={}",
            dir.join("callgrind.out.%p").display()
        ))
        .arg("--")
        .arg(agent);
    command
}

/// Instructions counted over one stretch of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counted {
    /// Instructions executed (`Ir`).
    pub instructions: u64,
    /// Wall-clock length of the stretch.
    pub elapsed: Duration,
}

/// The instruction counts of a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Instructions {
    /// With no message moving.
    pub idle: Counted,
    /// From the first publish to the last delivery.
    pub window: Counted,
    /// Messages published in the window.
    pub messages: u64,
    /// The dump of the window, for `callgrind_annotate`.
    pub part: u32,
}

impl Instructions {
    /// Window instructions per message.
    pub fn gross_per_message(&self) -> f64 {
        self.window.instructions as f64 / self.messages.max(1) as f64
    }

    /// Instructions per second with nothing to do.
    pub fn idle_per_second(&self) -> f64 {
        self.idle.instructions as f64 / self.idle.elapsed.as_secs_f64().max(1e-9)
    }

    /// Window instructions less the idle rate over the window's length, per message.
    pub fn net_per_message(&self) -> f64 {
        let idle = self.idle_per_second() * self.window.elapsed.as_secs_f64();
        (self.window.instructions as f64 - idle).max(0.0) / self.messages.max(1) as f64
    }
}

/// The agent process under Callgrind, counted through `callgrind_control`.
pub struct Counter {
    pid: u32,
    dir: PathBuf,
    zeroed_at: Option<Instant>,
}

impl Counter {
    /// Counts the Callgrind process `pid` whose dumps go to `dir`.
    pub fn new(pid: u32, dir: &Path) -> Self {
        Self {
            pid,
            dir: dir.to_path_buf(),
            zeroed_at: None,
        }
    }

    /// Starts a stretch: every cost so far is forgotten.
    pub async fn zero(&mut self) -> anyhow::Result<()> {
        self.control("--zero").await?;
        self.zeroed_at = Some(Instant::now());
        Ok(())
    }

    /// Ends a stretch: dumps the costs since [`Counter::zero`]; returns them and the dump's
    /// part number.
    pub async fn dump(&mut self) -> anyhow::Result<(Counted, u32)> {
        let zeroed_at = self
            .zeroed_at
            .take()
            .context("a callgrind dump without a zero before it")?;
        let before = self.last_part()?;
        self.control("--dump").await?;
        let elapsed = zeroed_at.elapsed();
        let deadline = Instant::now() + DUMP_TIMEOUT;
        let part = loop {
            match self.last_part()? {
                Some(part) if Some(part) > before => break part,
                _ if Instant::now() >= deadline => bail!(
                    "callgrind wrote no dump into {} within {DUMP_TIMEOUT:?}",
                    self.dir.display()
                ),
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        };
        let path = self.part_path(part);
        // The dump is written by another process: wait until its summary is there.
        let instructions = loop {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            if let Some(ir) = summary_instructions(&text) {
                break ir;
            }
            if Instant::now() >= deadline {
                bail!("{} has no `summary:` line", path.display());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        Ok((
            Counted {
                instructions,
                elapsed,
            },
            part,
        ))
    }

    /// The path of dump `part`.
    pub fn part_path(&self, part: u32) -> PathBuf {
        self.dir.join(format!("callgrind.out.{}.{part}", self.pid))
    }

    async fn control(&self, action: &'static str) -> anyhow::Result<()> {
        let pid = self.pid.to_string();
        let output = tokio::task::spawn_blocking(move || {
            Command::new("callgrind_control")
                .arg(action)
                .arg(pid)
                .output()
        })
        .await
        .context("running callgrind_control")?
        .context("running callgrind_control")?;
        // It exits 0 also when it found no such Callgrind process; each process it reached
        // answers `OK`.
        let stdout = String::from_utf8_lossy(&output.stdout);
        if !output.status.success() || !stdout.contains("OK") {
            bail!(
                "callgrind_control {action} {} failed: {} {}",
                self.pid,
                stdout.trim(),
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Ok(())
    }

    /// The highest part number among the dumps so far.
    fn last_part(&self) -> anyhow::Result<Option<u32>> {
        let prefix = format!("callgrind.out.{}.", self.pid);
        let entries = std::fs::read_dir(&self.dir)
            .with_context(|| format!("listing {}", self.dir.display()))?;
        Ok(entries
            .filter_map(Result::ok)
            .filter_map(|e| e.file_name().to_str()?.strip_prefix(&prefix)?.parse().ok())
            .max())
    }
}

/// The `Ir` of a dump: its `summary:` line (`totals:` in older formats), whose first number
/// is the first event, `Ir`.
fn summary_instructions(dump: &str) -> Option<u64> {
    let events_first_is_ir = dump
        .lines()
        .find_map(|l| l.strip_prefix("events:"))
        .is_some_and(|events| events.split_whitespace().next() == Some("Ir"));
    if !events_first_is_ir {
        return None;
    }
    dump.lines()
        .find_map(|l| {
            l.strip_prefix("summary:")
                .or_else(|| l.strip_prefix("totals:"))
        })
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_line_holds_the_instructions() {
        let dump = "version: 1\ncreator: callgrind-3.19.0\npid: 12\ncmd: ferry-agent run\n\
                    part: 2\n\nevents: Ir\n\nfl=(1) a.rs\nfn=(1) main\n3 100\n\nsummary: 123456\n\n\
                    totals: 123456\n";
        assert_eq!(summary_instructions(dump), Some(123_456));
        assert_eq!(
            summary_instructions("events: Ir\n"),
            None,
            "not written yet"
        );
        assert_eq!(
            summary_instructions("events: Dr Ir\nsummary: 5 6\n"),
            None,
            "not an instruction count first"
        );
    }

    #[test]
    fn idle_instructions_are_taken_off_the_window() {
        let counts = Instructions {
            idle: Counted {
                instructions: 1_000_000,
                elapsed: Duration::from_secs(5),
            },
            window: Counted {
                instructions: 10_400_000,
                elapsed: Duration::from_secs(2),
            },
            messages: 100,
            part: 2,
        };
        assert_eq!(counts.idle_per_second(), 200_000.0);
        assert_eq!(counts.gross_per_message(), 104_000.0);
        assert_eq!(counts.net_per_message(), 100_000.0);
    }
}
