//! One log line per change of state for an operation that fails repeatedly.
//!
//! A failing store is retried many times a second; logging each attempt
//! buried everything else (about 1 100 identical warnings in 40 s). A
//! [`FailureLog`] logs a warning when the operation starts failing (with the
//! error and its kind), at most one reminder every [`REMIND_EVERY`] while it
//! keeps failing (with how many attempts failed so far), and one line when it
//! succeeds again (with how many attempts failed meanwhile and for how long).
//! An operation that flaps (fails again within [`REMIND_EVERY`] of its last
//! logged recovery, e.g. a nearly full store taking one append in a few)
//! is not logged again until that time has passed: its failures are counted
//! into the next line.
//!
//! Invariants: every "failing" line is followed by exactly one "recovered"
//! line before the next "failing" one, so a reader can pair them; at most
//! about two lines per operation and scope every [`REMIND_EVERY`]; the state
//! lock is never held across an `.await` (the methods are synchronous).

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::stores::StoreError;

/// How often at most a failure that lasts, or flaps, is logged again.
pub const REMIND_EVERY: Duration = Duration::from_secs(30);

#[derive(Debug, Default)]
struct State {
    /// Set while the last attempt failed.
    failing: Option<Failing>,
    /// When the last "recovered" line was logged.
    recovered_at: Option<Instant>,
    /// Failures not logged yet (a flap within `REMIND_EVERY`).
    unlogged: u64,
}

#[derive(Debug)]
struct Failing {
    since: Instant,
    failed: u64,
    /// When a line about this failure was last logged; `None` while it is
    /// not logged (a flap).
    logged_at: Option<Instant>,
}

/// The failing/healthy state of one operation of one scope (a route, a
/// partition).
#[derive(Debug)]
pub struct FailureLog {
    /// What fails, for the log lines: "outbox append", "drain cycle", ...
    operation: &'static str,
    state: Mutex<State>,
}

impl FailureLog {
    /// A healthy state for `operation`.
    pub fn new(operation: &'static str) -> Self {
        Self {
            operation,
            state: Mutex::new(State::default()),
        }
    }

    /// One attempt failed with `error`; `scope` names the route or partition.
    /// Logs only on the change of state or as a reminder.
    pub fn failed(&self, scope: &str, error: &StoreError) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        let recent = |t: Option<Instant>| t.is_some_and(|t| now.duration_since(t) < REMIND_EVERY);
        let flap = recent(state.recovered_at);
        let unlogged = std::mem::take(&mut state.unlogged);
        let f = state.failing.get_or_insert(Failing {
            since: now,
            failed: unlogged,
            logged_at: None,
        });
        f.failed += 1;
        match f.logged_at {
            None if !flap => {
                f.logged_at = Some(now);
                tracing::warn!(
                    scope,
                    operation = self.operation,
                    kind = error.kind(),
                    %error,
                    failed = f.failed,
                    "store operation failing; logged again when it recovers (or every 30s)"
                );
            }
            Some(at) if !recent(Some(at)) => {
                f.logged_at = Some(now);
                tracing::warn!(
                    scope,
                    operation = self.operation,
                    kind = error.kind(),
                    %error,
                    failed = f.failed,
                    for_secs = now.duration_since(f.since).as_secs(),
                    "store operation still failing"
                );
            }
            _ => {}
        }
    }

    /// One attempt succeeded: logs the recovery if its failure was logged.
    pub fn succeeded(&self, scope: &str) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(f) = state.failing.take() else {
            return;
        };
        if f.logged_at.is_some() {
            state.recovered_at = Some(Instant::now());
            tracing::info!(
                scope,
                operation = self.operation,
                failed = f.failed,
                for_ms = u64::try_from(f.since.elapsed().as_millis()).unwrap_or(u64::MAX),
                "store operation recovered"
            );
        } else {
            // A flap: counted into the next line.
            state.unlogged = f.failed;
        }
    }

    /// True while the last attempt failed.
    pub fn is_failing(&self) -> bool {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .failing
            .is_some()
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

    #[test]
    fn a_flap_is_not_logged_but_counted_into_the_next_line() {
        let log = FailureLog::new("outbox append");
        log.failed("r", &StoreError::Full("disk".into()));
        log.succeeded("r");
        // Fails again right after its logged recovery: not logged.
        for _ in 0..3 {
            log.failed("r", &StoreError::Full("disk".into()));
        }
        {
            let state = log.state.lock().expect("lock");
            let f = state.failing.as_ref().expect("failing");
            assert_eq!((f.failed, f.logged_at), (3, None));
        }
        log.succeeded("r");
        log.failed("r", &StoreError::Full("disk".into()));
        let state = log.state.lock().expect("lock");
        assert_eq!(state.failing.as_ref().map(|f| f.failed), Some(4));
    }
}
