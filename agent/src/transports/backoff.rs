//! Reconnect backoff shared by the sessions that reconnect themselves (MQTT, RabbitMQ).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Exponential backoff with "equal jitter": each delay is between half and all
/// of `initial × 2^attempt`, capped at `max`.
#[derive(Debug)]
pub(crate) struct Backoff {
    initial: Duration,
    /// The longest delay.
    pub max: Duration,
    attempt: u32,
    rng: u64,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0x9e37_79b9_7f4a_7c15, |d| d.as_nanos() as u64);
        Self {
            initial,
            max,
            attempt: 0,
            rng: seed | 1,
        }
    }

    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self
            .initial
            .checked_mul(1u32 << self.attempt.min(20))
            .map_or(self.max, |d| d.min(self.max));
        self.attempt = self.attempt.saturating_add(1);
        // xorshift64: jitter needs no cryptographic quality.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let half = ceiling / 2;
        let nanos = u64::try_from(half.as_nanos()).unwrap_or(u64::MAX);
        half + Duration::from_nanos(if nanos == 0 {
            0
        } else {
            self.rng % (nanos + 1)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_the_cap_with_jitter_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
        let first = b.next_delay();
        assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100));
        for _ in 0..20 {
            let d = b.next_delay();
            assert!(d <= Duration::from_secs(10));
        }
        let late = b.next_delay();
        assert!(late >= Duration::from_secs(5), "{late:?}");
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
