//! Exponential backoff with full jitter for in-process send retries
//! (`policy.retry_backoff`: 100ms initial, 30s max, ×2 by default).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Delays `random(0, min(max, initial × multiplier^attempt))`.
#[derive(Clone, Debug)]
pub struct RetryBackoff {
    initial: Duration,
    max: Duration,
    multiplier: f64,
    attempt: i32,
    rng: u64,
}

impl RetryBackoff {
    /// A backoff starting at its first attempt.
    pub fn new(initial: Duration, max: Duration, multiplier: f64) -> Self {
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0x9e37_79b9_7f4a_7c15, |d| d.as_nanos() as u64);
        Self {
            initial,
            max,
            multiplier: multiplier.max(1.0),
            attempt: 0,
            rng: seed | 1,
        }
    }

    /// The ceiling of the next delay (before jitter).
    fn ceiling(&self) -> Duration {
        let factor = self.multiplier.powi(self.attempt.min(64));
        let secs = (self.initial.as_secs_f64() * factor).min(self.max.as_secs_f64());
        Duration::try_from_secs_f64(secs).unwrap_or(self.max)
    }

    /// The next delay, full jitter.
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self.ceiling();
        self.attempt = self.attempt.saturating_add(1);
        // xorshift64: jitter needs no cryptographic quality.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let unit = (self.rng >> 11) as f64 / (1u64 << 53) as f64;
        ceiling.mul_f64(unit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_stay_under_a_growing_capped_ceiling() {
        let mut b = RetryBackoff::new(Duration::from_millis(100), Duration::from_secs(30), 2.0);
        for attempt in 0..20 {
            let ceiling = Duration::from_millis(100)
                .mul_f64(2f64.powi(attempt))
                .min(Duration::from_secs(30));
            assert!(b.next_delay() <= ceiling);
        }
        assert_eq!(b.ceiling(), Duration::from_secs(30));
    }
}
