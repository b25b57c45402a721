//! The fallback poll: a fixed `drain_interval`, or adaptive backoff
//! (min → ×multiplier → max while the partition is empty, back to min when
//! records appear).

use std::time::Duration;

use ferry_shared::config::DrainPoll;

/// The current fallback interval.
#[derive(Debug)]
pub(super) struct PollTimer {
    poll: DrainPoll,
    current: Duration,
}

impl PollTimer {
    pub(super) fn new(poll: DrainPoll) -> Self {
        let current = match poll {
            DrainPoll::Fixed(d) => d.get(),
            DrainPoll::AdaptiveBackoff { min_interval, .. } => min_interval.get(),
        };
        Self { poll, current }
    }

    pub(super) fn interval(&self) -> Duration {
        self.current
    }

    /// A cycle found records: back to the shortest interval.
    pub(super) fn reset(&mut self) {
        if let DrainPoll::AdaptiveBackoff { min_interval, .. } = self.poll {
            self.current = min_interval.get();
        }
    }

    /// A cycle found nothing: grow (adaptive only).
    pub(super) fn empty(&mut self) {
        if let DrainPoll::AdaptiveBackoff {
            max_interval,
            multiplier,
            ..
        } = self.poll
        {
            self.current = self
                .current
                .mul_f64(multiplier.max(1.0))
                .min(max_interval.get());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_shared::config::Duration as D;

    #[test]
    fn adaptive_grows_to_max_and_resets() {
        let mut p = PollTimer::new(DrainPoll::AdaptiveBackoff {
            min_interval: D::from_millis(100),
            max_interval: D::from_millis(350),
            multiplier: 2.0,
        });
        p.empty();
        assert_eq!(p.interval(), Duration::from_millis(200));
        p.empty();
        p.empty();
        assert_eq!(p.interval(), Duration::from_millis(350));
        p.reset();
        assert_eq!(p.interval(), Duration::from_millis(100));
    }
}
