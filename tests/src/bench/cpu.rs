//! CPU time per message of the agent and of the processes beside it, from `/proc/PID/stat`.
//!
//! **Definition.** The agent's user + system CPU time (`utime` + `stime` of `/proc/PID/stat`,
//! which sum every thread of the process) read just before the first measured publish and again
//! as soon as every destination holds every message; the difference divided by the messages
//! published in the run (= the distinct messages each destination received, since only a
//! complete run is reported). For a fan-out ×3 that is the cost of one source message and its
//! three deliveries. Warm-up, start-up and shutdown are outside the window; the agent's periodic
//! work during the window (statistics, lease renewals) is inside it. The kernel counts in clock
//! ticks of 10 ms, so a window of a few seconds is exact to about 1 %.
//!
//! **Brokers A and B, and `ferry-bench` itself** (its publisher and collectors), are read over
//! the same window in every run not under Callgrind, the bridge's too: a run reports the CPU
//! its whole path spent per message (A + B, plus the agent for Ferry) and the load
//! generator's beside it. When they keep every core busy, the path plus the load generator,
//! not the agent's share alone, bounds the throughput: `direct_hold` adds a process and a TCP
//! hop to what the bridge does inside broker A (`docs/benchmarks.md`, session 42).

use std::time::Duration;

/// Clock ticks per second of `/proc/PID/stat` times (`USER_HZ`, 100 on every Linux
/// architecture Ferry runs on).
const CLOCK_TICKS_PER_SECOND: u64 = 100;

/// CPU time of a process, split as the kernel accounts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuTime {
    /// In user space.
    pub user: Duration,
    /// In the kernel on the process's behalf (system calls: socket I/O, `fsync`).
    pub system: Duration,
}

impl CpuTime {
    /// User + system.
    pub fn total(&self) -> Duration {
        self.user + self.system
    }

    /// The time used since `earlier`.
    pub fn since(&self, earlier: CpuTime) -> CpuTime {
        CpuTime {
            user: self.user.saturating_sub(earlier.user),
            system: self.system.saturating_sub(earlier.system),
        }
    }
}

/// A process's CPU time over the measured window of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuWindow {
    /// CPU used between the first publish and the last delivery.
    pub used: CpuTime,
    /// Messages published in the window.
    pub messages: u64,
}

impl CpuWindow {
    /// The window from `before` to `after`, over `messages`.
    pub fn between(before: CpuTime, after: CpuTime, messages: u64) -> Self {
        CpuWindow {
            used: after.since(before),
            messages,
        }
    }

    /// Microseconds of CPU (user + system) per message.
    pub fn micros_per_message(&self) -> Option<f64> {
        (self.messages > 0).then(|| self.used.total().as_secs_f64() * 1e6 / self.messages as f64)
    }
}

/// The other processes on the machine over a run's measured window: brokers A (source) and B
/// (destination), and `ferry-bench` itself (its publisher and collectors).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MachineCpu {
    pub source: CpuWindow,
    pub destination: CpuWindow,
    pub bench: CpuWindow,
}

impl MachineCpu {
    /// Microseconds of CPU per message of A and B together: the path without the agent.
    pub fn brokers_micros_per_message(&self) -> Option<f64> {
        Some(self.source.micros_per_message()? + self.destination.micros_per_message()?)
    }
}

/// [`MachineCpu`] being measured: the processes' times at the window's start.
pub struct MachineReading {
    pids: [u32; 3],
    before: [CpuTime; 3],
}

impl MachineReading {
    /// Reads brokers `source` and `destination` and this process now; `None` if one is gone.
    pub fn start(source: u32, destination: u32) -> Option<Self> {
        let pids = [source, destination, std::process::id()];
        let before = read_all(pids)?;
        Some(MachineReading { pids, before })
    }

    /// The window from [`Self::start`] to now, over `messages`.
    pub fn finish(self, messages: u64) -> Option<MachineCpu> {
        let [a, b, bench] = read_all(self.pids)?;
        let [a0, b0, bench0] = self.before;
        Some(MachineCpu {
            source: CpuWindow::between(a0, a, messages),
            destination: CpuWindow::between(b0, b, messages),
            bench: CpuWindow::between(bench0, bench, messages),
        })
    }
}

fn read_all(pids: [u32; 3]) -> Option<[CpuTime; 3]> {
    let [a, b, c] = pids.map(cpu_time);
    Some([a?, b?, c?])
}

/// The CPU time `pid` has used so far.
pub fn cpu_time(pid: u32) -> Option<CpuTime> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (user, system) = parse_stat_ticks(&stat)?;
    let time = |ticks: u64| Duration::from_millis(ticks * 1000 / CLOCK_TICKS_PER_SECOND);
    Some(CpuTime {
        user: time(user),
        system: time(system),
    })
}

/// `utime` and `stime` (fields 14 and 15) of a `/proc/PID/stat` line; the command name
/// (field 2) is in parentheses and may contain spaces, so fields are counted after its `)`.
fn parse_stat_ticks(stat: &str) -> Option<(u64, u64)> {
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace().skip(11);
    let utime = fields.next()?.parse().ok()?;
    let stime = fields.next()?.parse().ok()?;
    Some((utime, stime))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_times_parse_after_the_command_name() {
        let stat = "42 (ferry agent) S 1 42 42 0 -1 4194560 100 0 0 0 250 30 0 0 20 0 4";
        assert_eq!(parse_stat_ticks(stat), Some((250, 30)));
    }

    #[test]
    fn a_window_is_divided_by_its_messages() {
        let before = CpuTime {
            user: Duration::from_millis(500),
            system: Duration::from_millis(100),
        };
        let after = CpuTime {
            user: Duration::from_millis(1500),
            system: Duration::from_millis(1100),
        };
        let window = CpuWindow::between(before, after, 20_000);
        assert_eq!(window.used.total(), Duration::from_secs(2));
        assert_eq!(window.micros_per_message(), Some(100.0));
        let empty = CpuWindow {
            messages: 0,
            ..window
        };
        assert_eq!(empty.micros_per_message(), None);
    }

    #[test]
    fn the_brokers_add_up_and_need_both_windows() {
        let window = |millis, messages| CpuWindow {
            used: CpuTime {
                user: Duration::from_millis(millis),
                system: Duration::ZERO,
            },
            messages,
        };
        let machine = MachineCpu {
            source: window(300, 20_000),
            destination: window(280, 20_000),
            bench: window(240, 20_000),
        };
        assert_eq!(machine.brokers_micros_per_message(), Some(29.0));
        let unmeasured = MachineCpu {
            destination: window(280, 0),
            ..machine
        };
        assert_eq!(unmeasured.brokers_micros_per_message(), None);
    }

    #[test]
    fn this_process_has_used_cpu() {
        let me = std::process::id();
        assert!(cpu_time(me).is_some());
        let reading = MachineReading::start(me, me).expect("this process");
        assert_eq!(reading.finish(10).map(|m| m.bench.messages), Some(10));
    }
}
