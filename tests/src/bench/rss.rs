//! Resident memory of a process, from `/proc/PID/status`.
//!
//! An [`RssSampler`] reads `VmRSS` every [`SAMPLE_INTERVAL`] while a run lasts and keeps the
//! largest value; [`RssSampler::finish`] adds the kernel's own peak, `VmHWM`, read while the
//! process still runs. `VmHWM` covers the whole life of the process, so it also catches a peak
//! between two samples.
//!
//! It keeps the largest `RssAnon` too: the part of the resident set that is the process's own
//! memory (heap, stacks, SQLite's cache). The rest is mostly the pages of the agent's binary
//! that the kernel mapped around the code it ran (clean, shared, given back under pressure):
//! about as large again for the agent, and it moves between builds and runs of one build
//! (`docs/benchmarks.md`, issue 15).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::task::JoinHandle;

/// How often `VmRSS` is sampled.
const SAMPLE_INTERVAL: Duration = Duration::from_millis(100);

/// Peak memory of a process, in kibibytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Rss {
    /// The largest `VmRSS` sampled.
    pub sampled_peak_kib: u64,
    /// `VmHWM` at the end of the run (peak resident set over the process's life).
    pub hwm_kib: Option<u64>,
    /// The largest `RssAnon` sampled.
    pub anon_peak_kib: u64,
}

impl Rss {
    /// The larger of the two peaks, in bytes.
    pub fn peak_bytes(&self) -> u64 {
        self.sampled_peak_kib.max(self.hwm_kib.unwrap_or(0)) * 1024
    }
}

/// Samples the resident set of one process in the background.
pub struct RssSampler {
    pid: u32,
    peak_kib: Arc<AtomicU64>,
    anon_peak_kib: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl RssSampler {
    /// Starts sampling `pid`; sampling stops by itself when the process is gone.
    pub fn start(pid: u32) -> Self {
        let peak_kib = Arc::new(AtomicU64::new(0));
        let anon_peak_kib = Arc::new(AtomicU64::new(0));
        let (peak, anon_peak) = (Arc::clone(&peak_kib), Arc::clone(&anon_peak_kib));
        let task = tokio::spawn(async move {
            let mut ticks = tokio::time::interval(SAMPLE_INTERVAL);
            loop {
                ticks.tick().await;
                if !sample(pid, &peak, &anon_peak) {
                    return;
                }
            }
        });
        Self {
            pid,
            peak_kib,
            anon_peak_kib,
            task,
        }
    }

    /// Stops sampling and returns the peaks; call it while the process still runs.
    pub fn finish(self) -> Rss {
        sample(self.pid, &self.peak_kib, &self.anon_peak_kib);
        let hwm_kib = status_kib(self.pid, "VmHWM");
        self.task.abort();
        Rss {
            sampled_peak_kib: self.peak_kib.load(Ordering::Relaxed),
            hwm_kib,
            anon_peak_kib: self.anon_peak_kib.load(Ordering::Relaxed),
        }
    }
}

/// Raises the peaks by one reading of `/proc/{pid}/status`; false once the process is gone.
fn sample(pid: u32, peak_kib: &AtomicU64, anon_peak_kib: &AtomicU64) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    for (field, peak) in [("VmRSS", peak_kib), ("RssAnon", anon_peak_kib)] {
        if let Some(kib) = parse_status_kib(&status, field) {
            peak.fetch_max(kib, Ordering::Relaxed);
        }
    }
    true
}

impl Drop for RssSampler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The value of `field` (a `kB` line such as `VmRSS`) in `/proc/{pid}/status`.
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_status_kib(&status, field)
}

fn parse_status_kib(status: &str, field: &str) -> Option<u64> {
    status.lines().find_map(|line| {
        let value = line.strip_prefix(field)?.strip_prefix(':')?;
        value.trim().strip_suffix("kB")?.trim().parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields_parse() {
        let status =
            "Name:\tferry-agent\nVmHWM:\t   23456 kB\nVmRSS:\t   12345 kB\nRssAnon:\t    6789 kB\n";
        assert_eq!(parse_status_kib(status, "VmRSS"), Some(12345));
        assert_eq!(parse_status_kib(status, "RssAnon"), Some(6789));
        assert_eq!(parse_status_kib(status, "VmHWM"), Some(23456));
        assert_eq!(parse_status_kib(status, "VmSwap"), None);
    }

    #[test]
    fn this_process_has_a_resident_set() {
        assert!(status_kib(std::process::id(), "VmRSS").is_some_and(|kib| kib > 0));
    }
}
