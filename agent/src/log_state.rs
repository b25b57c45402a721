//! One log line per change of state for an operation that fails repeatedly.
//!
//! A failing store is retried many times a second; logging each attempt
//! buried everything else (about 1 100 identical warnings in 40 s). A
//! [`FailureLog`] logs a warning when the operation starts failing (with the
//! error and its kind), at most one reminder every [`REMIND_EVERY`] while it
//! keeps failing (with how many attempts failed so far), and one line when it
//! succeeds again (with how many attempts failed meanwhile and for how long).
//!
//! Invariant: between two "recovered" lines there is exactly one "failing"
//! line, so a reader can pair them; the state lock is never held across an
//! `.await` (the methods are synchronous).

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::stores::StoreError;

/// How often at most a failure that lasts is logged again.
pub const REMIND_EVERY: Duration = Duration::from_secs(30);

#[derive(Debug)]
struct Failing {
    since: Instant,
    failed: u64,
    reminded: Instant,
}

/// The failing/healthy state of one operation of one scope (a route, a
/// partition).
#[derive(Debug)]
pub struct FailureLog {
    /// What fails, for the log lines: "outbox append", "drain cycle", ...
    operation: &'static str,
    state: Mutex<Option<Failing>>,
}

impl FailureLog {
    /// A healthy state for `operation`.
    pub fn new(operation: &'static str) -> Self {
        Self {
            operation,
            state: Mutex::new(None),
        }
    }

    /// One attempt failed with `error`; `scope` names the route or partition.
    /// Logs only on the change of state or as a reminder.
    pub fn failed(&self, scope: &str, error: &StoreError) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        match state.as_mut() {
            None => {
                tracing::warn!(
                    scope,
                    operation = self.operation,
                    kind = kind(error),
                    %error,
                    "store operation failing; logged again when it recovers (or every 30s)"
                );
                *state = Some(Failing {
                    since: now,
                    failed: 1,
                    reminded: now,
                });
            }
            Some(f) => {
                f.failed += 1;
                if now.duration_since(f.reminded) >= REMIND_EVERY {
                    f.reminded = now;
                    tracing::warn!(
                        scope,
                        operation = self.operation,
                        kind = kind(error),
                        %error,
                        failed = f.failed,
                        for_secs = now.duration_since(f.since).as_secs(),
                        "store operation still failing"
                    );
                }
            }
        }
    }

    /// One attempt succeeded: logs the recovery if it was failing.
    pub fn succeeded(&self, scope: &str) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(f) = state.take() {
            tracing::info!(
                scope,
                operation = self.operation,
                failed = f.failed,
                for_ms = u64::try_from(f.since.elapsed().as_millis()).unwrap_or(u64::MAX),
                "store operation recovered"
            );
        }
    }

    /// True while the last attempt failed.
    pub fn is_failing(&self) -> bool {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }
}

/// The error's kind, as a log field.
fn kind(error: &StoreError) -> &'static str {
    match error {
        StoreError::Stale(_) => "stale",
        StoreError::Conflict(_) => "conflict",
        StoreError::NotFound(_) => "not_found",
        StoreError::Invalid(_) => "invalid",
        StoreError::Corrupt(_) => "corrupt",
        StoreError::Full(_) => "full",
        StoreError::Unavailable(_) => "unavailable",
        StoreError::Timeout(_) => "timeout",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failing_then_recovered_toggles_the_state() {
        let log = FailureLog::new("outbox append");
        assert!(!log.is_failing());
        for _ in 0..100 {
            log.failed("r", &StoreError::Full("disk".into()));
        }
        assert!(log.is_failing());
        log.succeeded("r");
        assert!(!log.is_failing());
        // A success while healthy changes nothing.
        log.succeeded("r");
        assert!(!log.is_failing());
    }
}
