//! Holding a delivery while the store write that would finish it fails.
//!
//! A delivery is finished by a store write: its outbox append
//! (`shared_outbox`) or its DLQ entry (both modes). When that write fails
//! (a full disk, an unreachable store), the delivery is **held**: unsettled,
//! its write retried with backoff until it succeeds or the route shuts down
//! (then it is settled unacknowledged and the source redelivers it to the
//! next run). While any delivery of a route is held, the route takes no new
//! delivery: the source keeps the rest.
//!
//! Settling such a delivery unacknowledged at once instead would be worse
//! than it looks: the source acknowledges in receive order, so everything
//! behind it would stay unacknowledged too, and the MQTT receiver reconnects
//! so the broker redelivers — the whole window again, into the same failing
//! store, over and over (594 deliveries for 200 messages in 25 s, every one
//! counted again).
//!
//! Invariants: [`StoreHold::active`] is true exactly while some delivery
//! is inside [`StoreHold::retry`] after a failed attempt. The route logs one
//! line when intake pauses and one when it resumes; the store's failure
//! itself is logged (once per change of state), counted and shown by
//! `/readyz` where every store is observed (`stores::observed`).

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::RetryBackoff;
use crate::stores::StoreError;

/// The longest wait between two attempts of a held write: the route is
/// paused meanwhile, so it resumes at most this long after the store
/// recovered.
const RETRY_MAX: Duration = Duration::from_secs(5);

/// The held deliveries of one route.
#[derive(Debug, Default)]
pub struct StoreHold {
    held: AtomicUsize,
}

impl StoreHold {
    /// True while a delivery is held on a failing write: take nothing new.
    pub fn active(&self) -> bool {
        self.held.load(Ordering::Acquire) > 0
    }

    /// Runs `write` until it succeeds (`Some`) or `shutdown` (`None`: leave
    /// the delivery to the source). The first retry waits `first_delay`,
    /// then twice as long each time up to five seconds, with full jitter.
    pub async fn retry<T, F, Fut>(
        &self,
        route: &str,
        first_delay: Duration,
        shutdown: &CancellationToken,
        mut write: F,
    ) -> Option<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let mut backoff: Option<RetryBackoff> = None;
        loop {
            let error = match write().await {
                Ok(value) => {
                    if backoff.is_some() {
                        self.release(route);
                    }
                    return Some(value);
                }
                Err(error) => error,
            };
            tracing::debug!(route, %error, "store write failed; retrying");
            let backoff = backoff.get_or_insert_with(|| {
                if self.held.fetch_add(1, Ordering::AcqRel) == 0 {
                    tracing::warn!(route, "holding a delivery whose store write fails; pausing intake until it succeeds");
                }
                RetryBackoff::new(first_delay, RETRY_MAX.max(first_delay), 2.0)
            });
            tokio::select! {
                () = shutdown.cancelled() => {
                    self.release(route);
                    return None;
                }
                () = tokio::time::sleep(backoff.next_delay()) => {}
            }
        }
    }
}

impl StoreHold {
    /// A held delivery is let go; intake resumes with the last one.
    fn release(&self, route: &str) {
        if self.held.fetch_sub(1, Ordering::AcqRel) == 1 {
            tracing::info!(
                route,
                "no delivery held on a failing store write; intake resumed"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::AtomicU32;

    use super::*;

    #[tokio::test]
    async fn a_write_is_retried_until_it_succeeds_and_holds_meanwhile() {
        let hold = Arc::new(StoreHold::default());
        let attempts = Arc::new(AtomicU32::new(0));
        let seen_active = Arc::new(AtomicU32::new(0));
        let result = hold
            .retry(
                "r",
                Duration::from_millis(1),
                &CancellationToken::new(),
                || {
                    let n = attempts.fetch_add(1, Ordering::SeqCst);
                    if hold.active() {
                        seen_active.fetch_add(1, Ordering::SeqCst);
                    }
                    async move {
                        if n < 3 {
                            Err(StoreError::Full("no room".into()))
                        } else {
                            Ok(n)
                        }
                    }
                },
            )
            .await;
        assert_eq!(result, Some(3));
        assert_eq!(
            seen_active.load(Ordering::SeqCst),
            3,
            "held after each failure"
        );
        assert!(!hold.active());
    }

    #[tokio::test]
    async fn shutdown_gives_the_delivery_back() {
        let hold = StoreHold::default();
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            stop.cancel();
        });
        let result: Option<()> = hold
            .retry("r", Duration::from_millis(1), &shutdown, || async {
                Err(StoreError::Unavailable("down".into()))
            })
            .await;
        assert_eq!(result, None);
        assert!(!hold.active());
    }
}
