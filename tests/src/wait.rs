//! Waiting for a condition with a deadline.
//!
//! Tests never sleep to let something happen: they state what they wait for and how long it may
//! take. The condition is polled, first every 5 ms and then less often (up to every 100 ms), and
//! a timeout fails with the name of what was awaited.

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use tokio::time::{Instant, sleep};

const FIRST_INTERVAL: Duration = Duration::from_millis(5);
const MAX_INTERVAL: Duration = Duration::from_millis(100);

/// Polls `condition` until it returns true; fails after `timeout` with
/// `timed out after {timeout} waiting for {what}`.
pub async fn until<F, Fut>(
    timeout: Duration,
    what: impl Display,
    mut condition: F,
) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    poll(timeout, what, || {
        let check = condition();
        async move { Ok(check.await.then_some(())) }
    })
    .await
}

/// Polls `attempt` until it returns `Ok`, and returns that value; fails after `timeout` with
/// what was awaited and the last error.
pub async fn until_ok<T, F, Fut>(
    timeout: Duration,
    what: impl Display,
    mut attempt: F,
) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let mut pacer = Pacer::new(timeout);
    loop {
        match attempt().await {
            Ok(value) => return Ok(value),
            Err(error) if !pacer.pause().await => {
                return Err(
                    error.context(format!("timed out after {timeout:?} waiting for {what}"))
                );
            }
            Err(_) => {}
        }
    }
}

/// The general form: polls `step` until it returns `Ok(Some(value))` and returns the value;
/// `Ok(None)` means "not yet", and an error ends the wait at once (for example: the process
/// that should open the port has exited). Fails after `timeout` naming `what`.
pub async fn poll<T, F, Fut>(
    timeout: Duration,
    what: impl Display,
    mut step: F,
) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<Option<T>>>,
{
    let mut pacer = Pacer::new(timeout);
    loop {
        let outcome = step()
            .await
            .map_err(|error| error.context(format!("while waiting for {what}")))?;
        if let Some(value) = outcome {
            return Ok(value);
        }
        if !pacer.pause().await {
            anyhow::bail!("timed out after {timeout:?} waiting for {what}");
        }
    }
}

/// The time between two polls, growing from [`FIRST_INTERVAL`] to [`MAX_INTERVAL`], and the
/// deadline.
struct Pacer {
    deadline: Instant,
    interval: Duration,
}

impl Pacer {
    fn new(timeout: Duration) -> Self {
        Self {
            deadline: Instant::now() + timeout,
            interval: FIRST_INTERVAL,
        }
    }

    /// Sleeps until the next poll; false when the deadline has passed (no more polls).
    async fn pause(&mut self) -> bool {
        let now = Instant::now();
        if now >= self.deadline {
            return false;
        }
        sleep(self.interval.min(self.deadline - now)).await;
        self.interval = (self.interval * 2).min(MAX_INTERVAL);
        true
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    #[tokio::test]
    async fn until_returns_once_the_condition_holds() -> anyhow::Result<()> {
        let calls = AtomicU32::new(0);
        until(Duration::from_secs(5), "the third call", || async {
            calls.fetch_add(1, Ordering::SeqCst) >= 2
        })
        .await?;
        assert_eq!(calls.load(Ordering::SeqCst), 3);
        Ok(())
    }

    #[tokio::test(start_paused = true)]
    async fn until_names_what_it_waited_for() {
        let error = until(Duration::from_secs(1), "the moon", || async { false })
            .await
            .expect_err("the condition never holds");
        assert_eq!(error.to_string(), "timed out after 1s waiting for the moon");
    }

    #[tokio::test(start_paused = true)]
    async fn until_ok_reports_the_last_error() {
        let error = until_ok(Duration::from_secs(1), "a connection", || async {
            Err::<(), _>(anyhow::anyhow!("connection refused"))
        })
        .await
        .expect_err("the attempt never succeeds");
        let text = format!("{error:#}");
        assert!(text.contains("waiting for a connection"), "{text}");
        assert!(text.contains("connection refused"), "{text}");
    }

    #[tokio::test]
    async fn poll_stops_at_the_first_error() {
        let calls = AtomicU32::new(0);
        let error = poll(Duration::from_secs(60), "a port", || async {
            calls.fetch_add(1, Ordering::SeqCst);
            Err::<Option<()>, _>(anyhow::anyhow!("the server exited"))
        })
        .await
        .expect_err("the step fails");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(
            format!("{error:#}"),
            "while waiting for a port: the server exited"
        );
    }
}
