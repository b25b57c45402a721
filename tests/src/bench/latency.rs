//! Latency percentiles from exact samples.
//!
//! A run records one sample per message (its first arrival on a destination), so the number of
//! samples is bounded by the run's message count; percentiles are read from the sorted samples
//! (nearest rank), without the bucketing error of a histogram.

use std::time::Duration;

/// The distribution of one destination's end-to-end latencies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LatencySummary {
    /// Samples taken.
    pub count: usize,
    /// Median.
    pub p50: Duration,
    /// 99th percentile.
    pub p99: Duration,
    /// Largest sample.
    pub max: Duration,
}

impl LatencySummary {
    /// Summarises `samples_ns` (sorted in place); `None` without samples.
    pub fn from_samples(samples_ns: &mut [u64]) -> Option<Self> {
        samples_ns.sort_unstable();
        let max = *samples_ns.last()?;
        Some(Self {
            count: samples_ns.len(),
            p50: Duration::from_nanos(nearest_rank(samples_ns, 50)),
            p99: Duration::from_nanos(nearest_rank(samples_ns, 99)),
            max: Duration::from_nanos(max),
        })
    }
}

/// The `percent`-th percentile of non-empty sorted `samples` by the nearest-rank method.
fn nearest_rank(sorted: &[u64], percent: usize) -> u64 {
    let rank = (sorted.len() * percent).div_ceil(100).max(1);
    sorted[rank.min(sorted.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() -> anyhow::Result<()> {
        let mut samples: Vec<u64> = (1..=100).rev().map(|ms| ms * 1_000_000).collect();
        let summary = LatencySummary::from_samples(&mut samples).ok_or(anyhow::anyhow!("empty"))?;
        assert_eq!(summary.count, 100);
        assert_eq!(summary.p50, Duration::from_millis(50));
        assert_eq!(summary.p99, Duration::from_millis(99));
        assert_eq!(summary.max, Duration::from_millis(100));
        Ok(())
    }

    #[test]
    fn one_sample_is_every_percentile() -> anyhow::Result<()> {
        let summary = LatencySummary::from_samples(&mut [7]).ok_or(anyhow::anyhow!("empty"))?;
        assert_eq!(
            (summary.p50, summary.p99),
            (Duration::from_nanos(7), Duration::from_nanos(7))
        );
        assert!(LatencySummary::from_samples(&mut []).is_none());
        Ok(())
    }
}
