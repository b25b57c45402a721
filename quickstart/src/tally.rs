//! What one destination received, counted by sequence number: distinct
//! readings, duplicates, what is missing, and the latency of each arrival
//! (publish → arrival) over the current window.
//!
//! Every figure the quickstart prints about a destination comes from here;
//! nothing is inferred from what was published.

use std::time::Duration;

/// At most this many latencies are kept per window; later arrivals in the
/// same window are counted but not timed (at the default 20 readings/s a
/// one-second window holds 20).
const WINDOW_CAPACITY: usize = 65_536;

/// The arrivals at one destination.
#[derive(Debug, Default)]
pub struct Tally {
    /// How often each sequence number arrived, indexed by it.
    counts: Vec<u32>,
    distinct: u64,
    duplicates: u64,
    /// Messages that were not a reading of this run (unparsable, or a
    /// sequence number never published).
    foreign: u64,
    /// Every sequence number below this one has arrived.
    contiguous: u64,
    /// Latencies of the arrivals since the last [`Tally::take_window`].
    window: Vec<Duration>,
}

/// Latency percentiles of one window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Latency {
    /// Median.
    pub p50: Duration,
    /// 99th percentile.
    pub p99: Duration,
}

impl Tally {
    /// Counts an arrival of reading `seq`, `latency` after it was published;
    /// `published` is how many readings were handed to the publisher so far
    /// (a larger `seq` is not one of ours). Returns whether it was a
    /// duplicate.
    pub fn record(&mut self, seq: u64, latency: Duration, published: u64) -> bool {
        let Some(index) = usize::try_from(seq).ok().filter(|_| seq < published) else {
            self.foreign += 1;
            return false;
        };
        if index >= self.counts.len() {
            self.counts.resize(index + 1, 0);
        }
        self.counts[index] = self.counts[index].saturating_add(1);
        let duplicate = self.counts[index] > 1;
        if !duplicate {
            self.distinct += 1;
            while self
                .counts
                .get(self.contiguous as usize)
                .is_some_and(|c| *c > 0)
            {
                self.contiguous += 1;
            }
        } else {
            self.duplicates += 1;
        }
        if self.window.len() < WINDOW_CAPACITY {
            self.window.push(latency);
        }
        duplicate
    }

    /// Counts a message that is not a reading of this run.
    pub fn record_foreign(&mut self) {
        self.foreign += 1;
    }

    /// Distinct readings received.
    pub fn distinct(&self) -> u64 {
        self.distinct
    }

    /// Arrivals beyond the first of each reading.
    pub fn duplicates(&self) -> u64 {
        self.duplicates
    }

    /// Messages that were not readings of this run.
    pub fn foreign(&self) -> u64 {
        self.foreign
    }

    /// Whether every reading below `seq` has arrived.
    pub fn has_all_below(&self, seq: u64) -> bool {
        self.contiguous >= seq
    }

    /// How many of the readings `0..published` never arrived.
    pub fn missing(&self, published: u64) -> u64 {
        let limit = usize::try_from(published).unwrap_or(usize::MAX);
        let arrived = self.counts.iter().take(limit).filter(|c| **c > 0).count();
        published.saturating_sub(arrived as u64)
    }

    /// The latency percentiles of the arrivals since the previous call
    /// (`None` when nothing arrived), and a new window.
    pub fn take_window(&mut self) -> Option<Latency> {
        let mut window = std::mem::take(&mut self.window);
        window.sort_unstable();
        let at = |q: f64| window[((window.len() - 1) as f64 * q).round() as usize];
        (!window.is_empty()).then(|| Latency {
            p50: at(0.50),
            p99: at(0.99),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn counts_distinct_duplicates_and_missing_by_sequence_number() {
        let mut t = Tally::default();
        let duplicate = [0, 1, 3, 1, 4, 4, 4].map(|seq| t.record(seq, ms(1), 6));
        assert_eq!(duplicate, [false, false, false, true, false, true, true]);
        assert_eq!((t.distinct(), t.duplicates()), (4, 3));
        assert_eq!(t.missing(6), 2, "2 and 5");
        assert_eq!(t.missing(2), 0);
        assert!(t.has_all_below(2));
        assert!(!t.has_all_below(3));
        t.record(2, ms(1), 6);
        assert!(t.has_all_below(5), "the gap closed: 0..5 arrived");
        assert_eq!(t.missing(6), 1);
    }

    #[test]
    fn a_number_never_published_is_foreign_and_not_counted() {
        let mut t = Tally::default();
        t.record(10, ms(1), 10);
        t.record(u64::MAX, ms(1), 10);
        t.record_foreign();
        assert_eq!((t.distinct(), t.foreign()), (0, 3));
        assert_eq!(t.missing(10), 10);
    }

    #[test]
    fn latency_percentiles_cover_one_window_at_a_time() {
        let mut t = Tally::default();
        assert_eq!(t.take_window(), None);
        for (seq, latency) in (1..=100).enumerate() {
            t.record(seq as u64, ms(latency), 1000);
        }
        let w = t.take_window().expect("arrivals");
        assert_eq!((w.p50, w.p99), (ms(51), ms(99)));
        assert_eq!(t.take_window(), None, "a new window starts empty");
        t.record(100, ms(7), 1000);
        assert_eq!(t.take_window().map(|w| w.p99), Some(ms(7)));
    }
}
