//! The `direct_hold` route: receive → send → settle (DESIGN §4.2).
//!
//! Invariants:
//!
//! - **The source is settled only after the destination accepted the
//!   message** (`Sent`), or after its DLQ entry is durable (`DeadLettered`),
//!   or after a counted drop by policy. Until then it is held open; a crash
//!   means the source redelivers.
//! - A transient failure is retried in process with exponential backoff and
//!   full jitter while `send_retry_budget` lasts; then, or at once on a
//!   permanent error, `on_permanent_failure` applies. Except that a delivery
//!   whose source retries by itself (`Delivery::source_retries`, an outbox
//!   table) is settled `Failed` when the budget is spent: the source counts
//!   the failure, tries again later and dead-letters it past its own limit.
//! - **Only time the destination could be tried spends the budget.** While
//!   the sender's session is disconnected a delivery waits for it (no
//!   attempt, no backoff, no budget); a backoff sleep ends early when the
//!   session goes down. On reconnect every held delivery is tried at once
//!   with a fresh backoff, so an outage of any length dead-letters nothing
//!   and the route resumes as soon as the destination is back.
//! - **A DLQ write that fails holds its delivery and pauses intake.** The
//!   write is retried with backoff until it succeeds (the delivery is then
//!   settled `DeadLettered`) or the route shuts down (left unsettled: the
//!   source redelivers it). Settling it unacknowledged at once instead would
//!   block the source's in-order acknowledgements and make it resend the
//!   whole window behind it, again and again, while the DLQ stays full.
//! - Up to `max_in_flight` deliveries are handled at once; the receiver
//!   acknowledges them in receive order whatever order they finish in.
//! - A delivery the source marks as redelivered is counted once as such
//!   (`ferry_messages_redelivered_total`) when the route takes it.
//! - With tracing on, each delivery is handled in its `receive` span, and
//!   each attempt is a `send` span under it ([`spans`](crate::spans)).

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use ferry_shared::config::Policy;
use ferry_shared::envelope::Envelope;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio_util::sync::CancellationToken;

use super::hold::StoreHold;
use super::{
    Failure, RetryBackoff, RouteBinding, RouteIdentity, dispose_held, permanent_failure, with_ttl,
};
use crate::metrics::{RouteMetrics, Terminal};
use crate::spans;
use crate::stores::{DlqReason, DlqStore};
use crate::transports::{Address, Delivery, Outcome, Receiver, Sender};

/// One `direct_hold` route.
pub struct DirectHold {
    /// Bridge, route, agent.
    pub identity: RouteIdentity,
    /// The one binding.
    pub binding: RouteBinding,
    /// The binding's sender.
    pub sender: Arc<dyn Sender>,
    /// The DLQ, when configured.
    pub dlq: Option<Arc<dyn DlqStore>>,
    /// The route's policy.
    pub policy: Policy,
    /// Settle latency.
    pub route_metrics: RouteMetrics,
}

/// A [`DirectHold`] while it runs: the route and its shared state.
struct Running {
    route: DirectHold,
    /// Deliveries held on a failing DLQ write; intake pauses while any is.
    hold: StoreHold,
}

impl DirectHold {
    /// Takes deliveries until `shutdown`; then lets deliveries in progress
    /// finish within `grace` (retry waits end at once and leave theirs
    /// unsettled).
    pub async fn run(
        self,
        mut receiver: Box<dyn Receiver>,
        shutdown: CancellationToken,
        grace: Duration,
    ) {
        let this = Arc::new(Running {
            route: self,
            hold: StoreHold::default(),
        });
        let max_in_flight = this.route.policy.max_in_flight as usize;
        let mut in_flight = FuturesUnordered::new();
        loop {
            // Re-evaluated whenever a delivery finishes: a delivery stuck on
            // its DLQ write finishes only once the write went through.
            let taking = in_flight.len() < max_in_flight && !this.hold.active();
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                Some(()) = in_flight.next(), if !in_flight.is_empty() => {}
                delivery = receiver.recv(), if taking => {
                    match delivery {
                        // Boxed here: the set moves what it is given into its own
                        // task node, and a delivery's future is large.
                        Some(d) => in_flight.push(Box::pin(Arc::clone(&this).handle(d, shutdown.clone()))),
                        None => break,
                    }
                }
            }
        }
        if tokio::time::timeout(grace, async { while in_flight.next().await.is_some() {} })
            .await
            .is_err()
        {
            tracing::warn!(route = %this.route.identity.route_id, "deliveries still running after the grace period; left to the source");
        }
    }
}

impl Running {
    /// Handles one delivery in its `receive` span.
    async fn handle(self: Arc<Self>, mut delivery: Delivery, shutdown: CancellationToken) {
        let receive = spans::receive(&self.route.identity.route_id, &delivery.envelope);
        spans::stamp(&receive, &mut delivery.envelope);
        receive.scope(self.handle_in_span(delivery, shutdown)).await;
    }

    async fn handle_in_span(self: Arc<Self>, delivery: Delivery, shutdown: CancellationToken) {
        let Delivery {
            envelope,
            defect,
            redelivered,
            source_retries,
            settle,
        } = delivery;
        let route = &self.route;
        if redelivered {
            route.route_metrics.redelivered();
        }
        let envelope = with_ttl(envelope, route.policy.ttl.map(|d| d.get()));
        let received_at = envelope.source.received_at;
        let outcome = match defect {
            Some(defect) => {
                let failure = Failure {
                    reason: defect.dlq_reason(),
                    error: defect.to_string(),
                    attempts: 0,
                    first_attempt_at: None,
                    last_attempt_at: None,
                };
                self.fail(
                    &envelope,
                    route.policy.on_permanent_failure,
                    failure,
                    &shutdown,
                )
                .await
            }
            None => self.deliver(&envelope, source_retries, &shutdown).await,
        };
        settle.settle(outcome);
        if outcome.acknowledges() {
            route.route_metrics.settled_after(
                SystemTime::now()
                    .duration_since(received_at)
                    .unwrap_or_default(),
            );
        }
    }

    /// Sends with retries; returns the outcome to settle with.
    async fn deliver(
        &self,
        envelope: &Envelope,
        source_retries: bool,
        shutdown: &CancellationToken,
    ) -> Outcome {
        let route = &self.route;
        let address = Address::new(route.binding.address.clone());
        let mut connected = route.sender.connected();
        let mut budget = Budget::new(route.policy.send_retry_budget.get());
        let b = &route.policy.retry_backoff;
        let new_backoff =
            || RetryBackoff::new(b.initial_interval.get(), b.max_interval.get(), b.multiplier);
        let mut backoff = new_backoff();
        let mut first_attempt_at = None;
        let mut attempts = 0u32;
        loop {
            if !*connected.borrow_and_update() {
                // Not an attempt and not on the budget: the destination
                // cannot be tried. Wakes the moment the session is back.
                let down = Instant::now();
                let session_alive = tokio::select! {
                    () = shutdown.cancelled() => return Outcome::Shutdown,
                    up = connected.wait_for(|up| *up) => up.is_ok(),
                };
                if !session_alive {
                    // The session is gone for good: only shutdown ends it.
                    shutdown.cancelled().await;
                    return Outcome::Shutdown;
                }
                budget.pause(down.elapsed());
                backoff = new_backoff();
            }
            let now = SystemTime::now();
            if envelope.is_expired(now) {
                let failure = Failure {
                    reason: DlqReason::Expired,
                    error: "expired before delivery".into(),
                    attempts,
                    first_attempt_at,
                    last_attempt_at: first_attempt_at.map(|_| now),
                };
                return self
                    .fail(envelope, route.policy.on_expired, failure, shutdown)
                    .await;
            }
            first_attempt_at.get_or_insert(now);
            attempts += 1;
            let sent = spans::send(
                &*route.sender,
                envelope,
                &route.binding.id,
                &address,
                attempts,
            );
            let error = match sent.await {
                Ok(()) => {
                    route.binding.metrics.received(1);
                    route.binding.metrics.finished(
                        Terminal::Sent,
                        1,
                        SystemTime::now()
                            .duration_since(envelope.source.received_at)
                            .ok(),
                    );
                    return Outcome::Sent;
                }
                Err(error) if error.is_permanent() => {
                    let (reason, error) = permanent_failure(error);
                    let failure = Failure {
                        reason,
                        error,
                        attempts,
                        first_attempt_at,
                        last_attempt_at: Some(now),
                    };
                    return self
                        .fail(
                            envelope,
                            route.policy.on_permanent_failure,
                            failure,
                            shutdown,
                        )
                        .await;
                }
                Err(error) => error,
            };
            if !*connected.borrow_and_update() {
                // Lost with the connection: tried again once it is back.
                continue;
            }
            let delay = backoff.next_delay();
            if budget.spent() + delay > budget.limit && source_retries {
                tracing::debug!(route = %route.identity.route_id, message_id = %envelope.id, %error, "send failed past the retry budget; left to the source's retries");
                return Outcome::Failed;
            }
            if budget.spent() + delay > budget.limit {
                let failure = Failure {
                    reason: DlqReason::ReplayExhausted,
                    error: error.to_string(),
                    attempts,
                    first_attempt_at,
                    last_attempt_at: Some(now),
                };
                return self
                    .fail(
                        envelope,
                        route.policy.on_permanent_failure,
                        failure,
                        shutdown,
                    )
                    .await;
            }
            tracing::debug!(route = %route.identity.route_id, message_id = %envelope.id, %error, ?delay, "send failed; retrying");
            tokio::select! {
                () = shutdown.cancelled() => return Outcome::Shutdown,
                () = tokio::time::sleep(delay) => {}
                // Disconnected meanwhile: stop sleeping, wait for the session.
                Ok(_) = connected.wait_for(|up| !*up) => {}
            }
        }
    }

    /// Applies `action`; a DLQ write that fails holds the delivery and is
    /// retried (intake paused) until it succeeds or the route shuts down.
    async fn fail(
        &self,
        envelope: &Envelope,
        action: ferry_shared::config::FailureAction,
        failure: Failure,
        shutdown: &CancellationToken,
    ) -> Outcome {
        let route = &self.route;
        let written = dispose_held(
            &self.hold,
            route.policy.retry_backoff.initial_interval.get(),
            shutdown,
            &route.identity,
            route.dlq.as_ref(),
            action,
            &route.binding,
            envelope,
            &failure,
        )
        .await;
        written.unwrap_or_else(|| {
            tracing::info!(route = %route.identity.route_id, message_id = %envelope.id, "shutting down with a dlq write still failing; left to the source");
            Outcome::StoreFailure
        })
    }
}

/// A delivery's send retry budget: wall time since its first attempt, less
/// the time its destination's session was down.
struct Budget {
    limit: Duration,
    started: Instant,
    paused: Duration,
}

impl Budget {
    fn new(limit: Duration) -> Self {
        Self {
            limit,
            started: Instant::now(),
            paused: Duration::ZERO,
        }
    }

    /// `time` spent waiting for the session does not count.
    fn pause(&mut self, time: Duration) {
        self.paused += time;
    }

    fn spent(&self) -> Duration {
        self.started.elapsed().saturating_sub(self.paused)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use ferry_shared::config::Duration as D;
    use ferry_shared::envelope::Source;
    use tokio::sync::{mpsc, watch};

    use super::*;
    use crate::metrics::Metrics;
    use crate::stores::memory::MemoryDlqStore;
    use crate::stores::{DlqFilter, PageRequest};
    use crate::transports::{RecvFuture, SendError, SendFuture, SettleHandle};

    struct Channel(mpsc::Receiver<Delivery>);

    impl Receiver for Channel {
        fn recv(&mut self) -> RecvFuture<'_> {
            Box::pin(self.0.recv())
        }
    }

    /// Fails while disconnected and the first `failures` sends with a
    /// transient error, then accepts.
    struct Flaky {
        failures: Mutex<u32>,
        connected: watch::Receiver<bool>,
    }

    impl Sender for Flaky {
        fn send<'a>(&'a self, _: &'a Envelope, _: &'a Address) -> SendFuture<'a> {
            let mut left = self.failures.lock().expect("lock");
            let result = if !*self.connected.borrow() {
                Err(SendError::Transient("not connected".into()))
            } else if *left > 0 {
                *left -= 1;
                Err(SendError::Transient("down".into()))
            } else {
                Ok(())
            };
            Box::pin(async move { result })
        }

        fn connected(&self) -> watch::Receiver<bool> {
            self.connected.clone()
        }
    }

    fn envelope() -> Envelope {
        Envelope::new(
            "m1",
            b"1".to_vec(),
            Source::new("mqtt", "s", "in", SystemTime::now()),
        )
    }

    /// Runs one delivery through a route whose sender fails `failures` times; returns the
    /// settle outcome, the binding's counts and the DLQ.
    async fn run_one(
        failures: u32,
    ) -> (Outcome, crate::metrics::BindingCounts, Arc<MemoryDlqStore>) {
        run_with(failures, watch::channel(true).1, false).await
    }

    /// [`run_one`] with the sender's session state given.
    async fn run_with(
        failures: u32,
        connected: watch::Receiver<bool>,
        source_retries: bool,
    ) -> (Outcome, crate::metrics::BindingCounts, Arc<MemoryDlqStore>) {
        let metrics = Metrics::new();
        let dlq = Arc::new(MemoryDlqStore::new());
        let mut policy = Policy::default();
        policy.retry_backoff.initial_interval = D::from_millis(1);
        policy.retry_backoff.max_interval = D::from_millis(5);
        policy.send_retry_budget = D::from_millis(200);
        let binding = RouteBinding {
            id: "x".into(),
            address: "out".into(),
            metrics: metrics.binding("b", "r", "x"),
        };
        let route = DirectHold {
            identity: RouteIdentity {
                bridge_id: "b".into(),
                route_id: "r".into(),
                agent_id: "a".into(),
            },
            binding: binding.clone(),
            sender: Arc::new(Flaky {
                failures: Mutex::new(failures),
                connected,
            }),
            dlq: Some(Arc::clone(&dlq) as Arc<dyn DlqStore>),
            policy,
            route_metrics: metrics.route("b", "r"),
        };
        let (tx, rx) = mpsc::channel(1);
        let (settled_tx, mut settled_rx) = mpsc::unbounded_channel();
        tx.send(Delivery {
            envelope: envelope(),
            defect: None,
            redelivered: false,
            source_retries,
            settle: SettleHandle::new(move |o| {
                settled_tx.send(o).ok();
            }),
        })
        .await
        .expect("send");
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(route.run(
            Box::new(Channel(rx)),
            shutdown.clone(),
            Duration::from_secs(1),
        ));
        let outcome = settled_rx.recv().await.expect("settled");
        shutdown.cancel();
        task.await.expect("route task");
        (outcome, binding.metrics.counts(), dlq)
    }

    #[tokio::test]
    async fn transient_failures_are_retried_until_the_send_is_accepted() {
        let (outcome, counts, _) = run_one(3).await;
        assert_eq!(outcome, Outcome::Sent);
        assert_eq!((counts.received, counts.sent, counts.in_flight), (1, 1, 0));
    }

    /// The session is down for three times the 200 ms budget: the delivery
    /// waits for it (no attempt, no budget spent) and is sent once it is up.
    #[tokio::test]
    async fn time_disconnected_does_not_spend_the_retry_budget() {
        let (up, connected) = watch::channel(false);
        let reconnect = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(600)).await;
            up.send(true).ok();
            up
        });
        let (outcome, counts, dlq) = run_with(0, connected, false).await;
        assert_eq!(outcome, Outcome::Sent);
        assert_eq!((counts.sent, counts.dead_lettered), (1, 0));
        let stats = dlq.stats(&DlqFilter::default()).await.expect("stats");
        assert_eq!(stats.total, 0);
        drop(reconnect.await);
    }

    #[tokio::test]
    async fn an_exhausted_retry_budget_dead_letters_then_settles() {
        let (outcome, counts, dlq) = run_one(u32::MAX).await;
        assert_eq!(outcome, Outcome::DeadLettered);
        assert_eq!((counts.received, counts.dead_lettered), (1, 1));
        let page = dlq
            .list(&DlqFilter::default(), PageRequest::default())
            .await
            .expect("list");
        assert_eq!(page.entries.len(), 1);
        assert!(
            page.entries[0].id.starts_with("m1/x/"),
            "{:?}",
            page.entries[0].id
        );
        assert_eq!(page.entries[0].reason, DlqReason::ReplayExhausted);
        assert!(page.entries[0].attempts > 1);
    }

    /// A source with retries of its own (an outbox table) gets the delivery back unacknowledged
    /// when the budget is spent, and nothing is dead-lettered or counted as finished.
    #[tokio::test]
    async fn an_exhausted_budget_is_left_to_a_source_that_retries() {
        let (outcome, counts, dlq) = run_with(u32::MAX, watch::channel(true).1, true).await;
        assert_eq!(outcome, Outcome::Failed);
        assert_eq!(
            (counts.received, counts.sent, counts.dead_lettered),
            (0, 0, 0)
        );
        let stats = dlq.stats(&DlqFilter::default()).await.expect("stats");
        assert_eq!(stats.total, 0);
    }
}
