//! The report: a table of every run, then the floors of issue 3 as ratios against the
//! Mosquitto bridge measured in the same invocation.
//!
//! Floors: `shared_outbox` fan-out x3 ≥ 0.5× the bridge's throughput per destination (aim ≥ 1×);
//! `direct_hold` ≥ 0.6× a one-connection bridge; at a fixed 1 000 msg/s, `shared_outbox` x3
//! p50 ≤ 3 ms and p99 ≤ 15 ms; agent RSS ≤ 64 MB (MiB here). A floor whose runs are missing or
//! incomplete is `n/a`, never `PASS`. Issue 15's aim for the agent's CPU per message of the
//! fan-out (≤ 35 µs, see [`cpu`](super::cpu)) is reported beside them, not enforced.

use std::fmt::Write as _;
use std::time::Duration;

use super::ferry::{FerryRoute, Store};
use super::publisher::Pace;
use super::scenario::{Contender, RunResult};

/// Throughput ratio floor of `shared_outbox` x3 against the bridge x3, per destination.
pub const FAN_OUT_FLOOR: f64 = 0.5;
/// What `shared_outbox` x3 aims for.
pub const FAN_OUT_AIM: f64 = 1.0;
/// Throughput ratio floor of `direct_hold` against the one-connection bridge.
pub const DIRECT_FLOOR: f64 = 0.6;
/// Latency ceilings at the fixed rate.
pub const P50_CEILING: Duration = Duration::from_millis(3);
pub const P99_CEILING: Duration = Duration::from_millis(15);
/// Agent memory ceiling.
pub const RSS_CEILING_BYTES: u64 = 64 * 1024 * 1024;
/// What the agent's CPU per message of the flat-out fan-out aims for, in microseconds.
pub const FAN_OUT_CPU_AIM_MICROS: f64 = 35.0;

/// A floor's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Fail,
    /// Not measured (runs missing or incomplete).
    NotAvailable,
}

impl Verdict {
    fn label(self) -> &'static str {
        match self {
            Self::Pass => "PASS",
            Self::Fail => "FAIL",
            Self::NotAvailable => "n/a",
        }
    }
}

/// One floor: what is compared, the measured value, the limit, the verdict.
#[derive(Debug, Clone)]
pub struct Floor {
    pub name: &'static str,
    pub measured: String,
    pub limit: String,
    pub verdict: Verdict,
    /// False for an aim, which is reported but is not a floor.
    pub binding: bool,
}

/// The table of runs, one line per run and destination.
pub fn runs_table(runs: &[RunResult]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<34} {:>6} {:<10} {:>13} {:>5} {:>10} {:>8} {:>8} {:>8} {:>9}",
        "run",
        "pace",
        "dest",
        "delivered",
        "dup",
        "msg/s",
        "p50 ms",
        "p99 ms",
        "max ms",
        "pub msg/s"
    );
    for run in runs {
        let pub_rate = run
            .publish_rate()
            .map_or("-".to_owned(), |r| format!("{r:.0}"));
        for d in &run.destinations {
            let latency = |pick: fn(&super::latency::LatencySummary) -> Duration| {
                d.latency
                    .map_or("-".to_owned(), |l| format!("{:.2}", ms(pick(&l))))
            };
            let _ = writeln!(
                out,
                "{:<34} {:>6} {:<10} {:>13} {:>5} {:>10} {:>8} {:>8} {:>8} {:>9}",
                run.spec.label(),
                run.spec.pace_label(),
                d.name,
                format!("{}/{}", d.tally.distinct, d.tally.expected()),
                d.tally.duplicates,
                d.throughput.map_or("-".to_owned(), |t| format!("{t:.0}")),
                latency(|l| l.p50),
                latency(|l| l.p99),
                latency(|l| l.max),
                pub_rate,
            );
        }
        if let Some(rss) = run.rss {
            let _ = writeln!(
                out,
                "{:<34} {:>6} agent RSS peak {:.1} MiB (sampled VmRSS {:.1} MiB, VmHWM {}; \
                 anonymous {:.1} MiB)",
                run.spec.label(),
                run.spec.pace_label(),
                mib(rss.peak_bytes()),
                mib(rss.sampled_peak_kib * 1024),
                rss.hwm_kib
                    .map_or("-".to_owned(), |kib| format!("{:.1} MiB", mib(kib * 1024))),
                mib(rss.anon_peak_kib * 1024),
            );
        }
        if let Some(cpu) = run.cpu {
            let _ = writeln!(
                out,
                "{:<34} {:>6} agent CPU {} µs/msg ({:.2} s user + {:.2} s sys for {} messages)",
                run.spec.label(),
                run.spec.pace_label(),
                micros(cpu.micros_per_message()),
                cpu.used.user.as_secs_f64(),
                cpu.used.system.as_secs_f64(),
                cpu.messages,
            );
        }
        if let Some(machine) = run.machine_cpu {
            // The whole path: the brokers, and the agent where one runs.
            let path = match (run.spec.contender, run.cpu) {
                (Contender::Bridge { .. }, _) => machine.brokers_micros_per_message(),
                (Contender::Ferry(_), Some(agent)) => machine
                    .brokers_micros_per_message()
                    .zip(agent.micros_per_message())
                    .map(|(b, a)| b + a),
                (Contender::Ferry(_), None) => None,
            };
            let _ = writeln!(
                out,
                "{:<34} {:>6} brokers CPU A {} + B {} µs/msg; whole path {} µs/msg; \
                 ferry-bench {} µs/msg",
                run.spec.label(),
                run.spec.pace_label(),
                micros(machine.source.micros_per_message()),
                micros(machine.destination.micros_per_message()),
                micros(path),
                micros(machine.bench.micros_per_message()),
            );
        }
        if let Some(ir) = run.instructions {
            let _ = writeln!(
                out,
                "{:<34} {:>6} agent instructions {:.0} Ir/msg net, {:.0} gross ({} Ir for {} messages \
                 in {:.1} s; idle {:.0} Ir/s; dump part {})",
                run.spec.label(),
                run.spec.pace_label(),
                ir.net_per_message(),
                ir.gross_per_message(),
                ir.window.instructions,
                ir.messages,
                ir.window.elapsed.as_secs_f64(),
                ir.idle_per_second(),
                ir.part,
            );
        }
        if let Some(error) = &run.error {
            let first_line = error.lines().next().unwrap_or_default();
            let _ = writeln!(
                out,
                "{:<34} {:>6} INCOMPLETE: {first_line}",
                run.spec.label(),
                run.spec.pace_label()
            );
        }
    }
    out
}

/// Issue 19's comparison of the stores: for each store a `shared_outbox` x3 run used, its
/// flat-out messages per second (worst destination, and as a ratio of the SQLite run of the same
/// invocation) beside its p50 / p99 at the fixed rate (worst destination). Empty when every run
/// used SQLite.
pub fn stores_table(runs: &[RunResult]) -> String {
    let shared: Vec<&RunResult> = runs
        .iter()
        .filter(|r| r.spec.contender == Contender::Ferry(FerryRoute::SharedOutbox))
        .collect();
    let mut stores: Vec<Store> = Vec::new();
    for run in &shared {
        if !stores.contains(&run.spec.store) {
            stores.push(run.spec.store);
        }
    }
    if stores.iter().all(|&store| store == Store::Sqlite) {
        return String::new();
    }
    let find = |store: Store, flat_out: bool| {
        shared
            .iter()
            .copied()
            .find(|r| r.spec.store == store && (r.spec.pace == Pace::FlatOut) == flat_out)
            .filter(|r| r.complete())
    };
    let worst_throughput = |run: &RunResult| {
        run.destinations
            .iter()
            .map(|d| d.throughput)
            .collect::<Option<Vec<f64>>>()?
            .into_iter()
            .min_by(f64::total_cmp)
    };
    let worst_latency = |run: &RunResult, pick: fn(&super::latency::LatencySummary) -> Duration| {
        run.destinations
            .iter()
            .map(|d| d.latency.map(|l| pick(&l)))
            .collect::<Option<Vec<_>>>()?
            .into_iter()
            .max()
    };
    let sqlite = find(Store::Sqlite, true).and_then(worst_throughput);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<10} {:>18} {:>10} {:>12} {:>14} {:>14}",
        "store", "msg/s (worst dest)", "vs sqlite", "CPU µs/msg", "p50 ms (rate)", "p99 ms (rate)"
    );
    for store in stores {
        let flat_out = find(store, true);
        let throughput = flat_out.and_then(worst_throughput);
        let paced = find(store, false);
        let latency = |pick| {
            paced
                .and_then(|run| worst_latency(run, pick))
                .map_or("-".to_owned(), |d| format!("{:.2}", ms(d)))
        };
        let _ = writeln!(
            out,
            "{:<10} {:>18} {:>10} {:>12} {:>14} {:>14}",
            store.name(),
            throughput.map_or("-".to_owned(), |t| format!("{t:.0}")),
            throughput
                .zip(sqlite)
                .map_or("-".to_owned(), |(t, base)| format!("{:.2}x", t / base)),
            micros(flat_out.and_then(|r| r.cpu?.micros_per_message())),
            latency(|l| l.p50),
            latency(|l| l.p99),
        );
    }
    out
}

/// Evaluates every floor over the runs of one invocation. Issue 3's floors are the edge agent's,
/// so they read the SQLite runs (issue 19's stores are compared by [`stores_table`]).
pub fn floors(runs: &[RunResult]) -> Vec<Floor> {
    let find = |contender: Contender, flat_out: bool| {
        runs.iter().find(|r| {
            r.spec.contender == contender
                && r.spec.store_used() == Store::Sqlite
                && (r.spec.pace == Pace::FlatOut) == flat_out
        })
    };
    let mut floors = Vec::new();

    let bridge3 = find(Contender::Bridge { connections: 3 }, true);
    let fan_out = find(Contender::Ferry(FerryRoute::SharedOutbox), true);
    let ratio = worst_ratio(fan_out, bridge3);
    floors.push(ratio_floor(
        "shared_outbox x3 / bridge x3 throughput (worst destination)",
        ratio,
        FAN_OUT_FLOOR,
    ));
    floors.push(Floor {
        binding: false,
        ..ratio_floor("  (aim, not a floor)", ratio, FAN_OUT_AIM)
    });
    let cpu = fan_out
        .filter(|r| r.complete())
        .and_then(|r| r.cpu?.micros_per_message());
    floors.push(Floor {
        name: "  shared_outbox x3 agent CPU per message (aim)",
        measured: cpu.map_or("-".to_owned(), |us| format!("{us:.1} µs")),
        limit: format!("<= {FAN_OUT_CPU_AIM_MICROS} µs"),
        verdict: match cpu {
            None => Verdict::NotAvailable,
            Some(us) if us <= FAN_OUT_CPU_AIM_MICROS => Verdict::Pass,
            Some(_) => Verdict::Fail,
        },
        binding: false,
    });

    let bridge1 = find(Contender::Bridge { connections: 1 }, true);
    let direct = find(Contender::Ferry(FerryRoute::DirectHold), true);
    floors.push(ratio_floor(
        "direct_hold / bridge x1 throughput",
        worst_ratio(direct, bridge1),
        DIRECT_FLOOR,
    ));

    let paced = find(Contender::Ferry(FerryRoute::SharedOutbox), false);
    let worst_latency = |pick: fn(&super::latency::LatencySummary) -> Duration| {
        let run = paced.filter(|r| r.complete())?;
        run.destinations
            .iter()
            .map(|d| d.latency.map(|l| pick(&l)))
            .collect::<Option<Vec<_>>>()?
            .into_iter()
            .max()
    };
    let rate = paced.map_or(String::new(), |r| r.spec.pace_label());
    for (name, pick, ceiling) in [
        (
            "shared_outbox x3 p50 at fixed rate (worst destination)",
            (|l| l.p50) as fn(&super::latency::LatencySummary) -> Duration,
            P50_CEILING,
        ),
        (
            "shared_outbox x3 p99 at fixed rate (worst destination)",
            |l| l.p99,
            P99_CEILING,
        ),
    ] {
        let measured = worst_latency(pick);
        floors.push(Floor {
            name,
            measured: measured.map_or("-".to_owned(), |d| format!("{:.2} ms @ {rate}", ms(d))),
            limit: format!("<= {} ms", ceiling.as_millis()),
            verdict: match measured {
                None => Verdict::NotAvailable,
                Some(d) if d <= ceiling => Verdict::Pass,
                Some(_) => Verdict::Fail,
            },
            binding: true,
        });
    }

    let peak = runs
        .iter()
        .filter_map(|r| r.rss.map(|rss| rss.peak_bytes()))
        .max();
    floors.push(Floor {
        name: "agent RSS peak (all Ferry runs)",
        measured: peak.map_or("-".to_owned(), |b| format!("{:.1} MiB", mib(b))),
        limit: "<= 64 MiB".to_owned(),
        verdict: match peak {
            None => Verdict::NotAvailable,
            Some(b) if b <= RSS_CEILING_BYTES => Verdict::Pass,
            Some(_) => Verdict::Fail,
        },
        binding: true,
    });
    floors
}

/// The floors as a table.
pub fn floors_table(floors: &[Floor]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<58} {:>22} {:>10}  result",
        "floor", "measured", "limit"
    );
    for floor in floors {
        let _ = writeln!(
            out,
            "{:<58} {:>22} {:>10}  {}",
            floor.name,
            floor.measured,
            floor.limit,
            match (floor.binding, floor.verdict) {
                (false, Verdict::Pass) => "met",
                (false, Verdict::Fail) => "not met",
                (_, verdict) => verdict.label(),
            }
        );
    }
    out
}

/// The smallest per-destination throughput ratio of `ferry` over `bridge`, with the
/// destination it was measured on; `None` unless both runs are complete.
fn worst_ratio(
    ferry: Option<&RunResult>,
    bridge: Option<&RunResult>,
) -> Option<(f64, &'static str)> {
    let ferry = ferry.filter(|r| r.complete())?;
    let bridge = bridge.filter(|r| r.complete())?;
    ferry
        .destinations
        .iter()
        .map(|d| {
            let base = bridge.destination(d.name)?.throughput?;
            Some((d.throughput? / base, d.name))
        })
        .collect::<Option<Vec<_>>>()?
        .into_iter()
        .min_by(|a, b| a.0.total_cmp(&b.0))
}

fn ratio_floor(name: &'static str, ratio: Option<(f64, &'static str)>, floor: f64) -> Floor {
    Floor {
        name,
        measured: ratio.map_or("-".to_owned(), |(r, dest)| format!("{r:.2}x ({dest})")),
        limit: format!(">= {floor}x"),
        verdict: match ratio {
            None => Verdict::NotAvailable,
            Some((r, _)) if r >= floor => Verdict::Pass,
            Some(_) => Verdict::Fail,
        },
        binding: true,
    }
}

/// µs per message to one decimal, `-` when unknown.
fn micros(per_message: Option<f64>) -> String {
    per_message.map_or("-".to_owned(), |us| format!("{us:.1}"))
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}
