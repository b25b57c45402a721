//! The agent's metrics, defined once: every name, help text and label set is
//! here, so `/metrics`, the snapshots streamed to the control plane and the
//! tests read the same figures.
//!
//! # The conservation law
//!
//! For every route and binding,
//! `received = sent + dropped + filtered + expired + dead_lettered + in_flight`.
//! [`BindingMetrics`] keeps it by construction: [`BindingMetrics::received`]
//! is the only way to add to `in_flight`, and each terminal method moves one
//! message from `in_flight` to exactly one terminal counter. An expired
//! message counts as `expired` whatever `on_expired` does with it (drop or
//! DLQ entry with reason `expired`); `dead_lettered` counts permanent
//! failures and exhausted replays. `dropped` is the one signal of silent loss
//! and stays 0 unless a policy explicitly drops.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of everything counted per destination.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct BindingLabels {
    /// The configuration's `bridge.id`.
    pub bridge: String,
    /// The route id.
    pub route: String,
    /// The binding id.
    pub binding: String,
}

/// Labels of everything counted per route.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct RouteLabels {
    /// The configuration's `bridge.id`.
    pub bridge: String,
    /// The route id.
    pub route: String,
}

/// Labels of everything counted per session (broker connection).
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct SessionLabels {
    /// The configuration's `bridge.id`.
    pub bridge: String,
    /// The session id.
    pub session: String,
}

/// Labels of store errors.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct StoreErrorLabels {
    /// The configuration's `bridge.id`.
    pub bridge: String,
    /// `outbox`, `lease` or `dlq`.
    pub store: String,
    /// The error's kind: `full`, `unavailable`, `timeout`, `corrupt`.
    pub kind: String,
}

/// Labels of fencing rejections.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct StoreFencedLabels {
    /// The configuration's `bridge.id`.
    pub bridge: String,
    /// `outbox` or `lease`.
    pub store: String,
    /// The operation rejected: `claim`, `complete`, `release`, `expire`,
    /// `renew`, ...
    pub op: String,
}

/// [`ferry_shared::telemetry::dropped_spans`] as a counter: the process-wide
/// count the export queue keeps.
#[derive(Debug)]
struct SpansDropped;

impl prometheus_client::encoding::EncodeMetric for SpansDropped {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::MetricEncoder,
    ) -> Result<(), std::fmt::Error> {
        encoder.encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(
            &ferry_shared::telemetry::dropped_spans(),
            None,
        )
    }

    fn metric_type(&self) -> prometheus_client::metrics::MetricType {
        prometheus_client::metrics::MetricType::Counter
    }
}

/// Latency buckets from 0.5 ms to about 65 s.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 18))
}

/// Every metric the agent exports, registered once.
pub struct Metrics {
    registry: Registry,
    received: Family<BindingLabels, Counter>,
    sent: Family<BindingLabels, Counter>,
    dropped: Family<BindingLabels, Counter>,
    filtered: Family<BindingLabels, Counter>,
    expired: Family<BindingLabels, Counter>,
    dead_lettered: Family<BindingLabels, Counter>,
    in_flight: Family<BindingLabels, Gauge>,
    outbox_depth: Family<BindingLabels, Gauge>,
    outbox_oldest_age: Family<BindingLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    record_latency: Family<BindingLabels, Histogram, fn() -> Histogram>,
    settle_latency: Family<RouteLabels, Histogram, fn() -> Histogram>,
    lease_held: Family<RouteLabels, Gauge>,
    redelivered: Family<RouteLabels, Counter>,
    session_connected: Family<SessionLabels, Gauge>,
    session_reconnects: Family<SessionLabels, Counter>,
    store_errors: Family<StoreErrorLabels, Counter>,
    store_fenced: Family<StoreFencedLabels, Counter>,
    /// Every binding handed out, so snapshots can list them in order.
    bindings: Mutex<BTreeMap<BindingLabels, BindingMetrics>>,
    /// Every route handed out, for the snapshots' lease state.
    routes: Mutex<BTreeMap<RouteLabels, RouteMetrics>>,
    /// Every session handed out, for the snapshots' session state.
    sessions: Mutex<BTreeMap<SessionLabels, SessionMetrics>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric under the `ferry_` prefix.
    pub fn new() -> Self {
        let mut metrics = Metrics {
            registry: Registry::default(),
            received: Family::default(),
            sent: Family::default(),
            dropped: Family::default(),
            filtered: Family::default(),
            expired: Family::default(),
            dead_lettered: Family::default(),
            in_flight: Family::default(),
            outbox_depth: Family::default(),
            outbox_oldest_age: Family::default(),
            record_latency: Family::new_with_constructor(latency_histogram),
            settle_latency: Family::new_with_constructor(latency_histogram),
            lease_held: Family::default(),
            redelivered: Family::default(),
            session_connected: Family::default(),
            session_reconnects: Family::default(),
            store_errors: Family::default(),
            store_fenced: Family::default(),
            bindings: Mutex::new(BTreeMap::new()),
            routes: Mutex::new(BTreeMap::new()),
            sessions: Mutex::new(BTreeMap::new()),
        };
        metrics.registry = metrics.registry_of_all();
        metrics
    }

    /// A registry holding every family of `self` (families share their
    /// values with their clones).
    fn registry_of_all(&self) -> Registry {
        let mut registry = Registry::with_prefix("ferry");
        let m = self;
        registry.register(
            "messages_received",
            "Messages received for a binding (one per binding of the route)",
            m.received.clone(),
        );
        registry.register(
            "messages_sent",
            "Messages accepted by the binding's destination",
            m.sent.clone(),
        );
        registry.register(
            "messages_dropped",
            "Messages ended without a send or a DLQ entry because a policy dropped them; \
             the one signal of silent loss",
            m.dropped.clone(),
        );
        registry.register(
            "messages_filtered",
            "Messages discarded on purpose by a filter",
            m.filtered.clone(),
        );
        registry.register(
            "messages_expired",
            "Messages that expired before delivery (dropped or dead-lettered per on_expired)",
            m.expired.clone(),
        );
        registry.register(
            "messages_dead_lettered",
            "Messages written to the DLQ after a permanent error or exhausted replays",
            m.dead_lettered.clone(),
        );
        registry.register(
            "messages_in_flight",
            "Messages received and not yet in a terminal state",
            m.in_flight.clone(),
        );
        registry.register(
            "outbox_depth",
            "Outbox records pending or claimed for a binding",
            m.outbox_depth.clone(),
        );
        registry.register(
            "outbox_oldest_pending_age_seconds",
            "Age of the oldest pending outbox record of a binding",
            m.outbox_oldest_age.clone(),
        );
        registry.register(
            "record_completion_seconds",
            "From outbox record creation (or receive, for direct_hold) to its terminal state",
            m.record_latency.clone(),
        );
        registry.register(
            "receive_to_settle_seconds",
            "From receive to settling the source",
            m.settle_latency.clone(),
        );
        registry.register(
            "lease_held",
            "1 when this agent holds the route's partition lease",
            m.lease_held.clone(),
        );
        registry.register(
            "messages_redelivered",
            "Deliveries the source marked as sent before (MQTT DUP): an earlier delivery was not \
             acknowledged, after a restart, a reconnect or a delivery left to the source",
            m.redelivered.clone(),
        );
        registry.register(
            "session_connected",
            "1 while the session's broker connection is up",
            m.session_connected.clone(),
        );
        registry.register(
            "session_reconnects",
            "Reconnections of a session since the agent started",
            m.session_reconnects.clone(),
        );
        registry.register(
            "store_errors",
            "Store operations that failed because of the store (full, unavailable, timeout, \
             corrupt); fencing outcomes (stale) and answers such as not found are not errors",
            m.store_errors.clone(),
        );
        registry.register(
            "store_fenced",
            "Store operations rejected as stale: this agent acted under a lease version that a \
             newer holder had fenced out (its late claims, completions, releases and renewals \
             after a pause or a lost lease); the store changed nothing",
            m.store_fenced.clone(),
        );
        registry.register(
            "spans_dropped",
            "Spans never exported: the bounded export queue was full (a slow or unreachable \
             collector), the collector refused them or did not answer, or they were still queued \
             at shutdown",
            SpansDropped,
        );
        registry
    }

    /// The counters of one binding; created on first use, shared afterwards.
    pub fn binding(&self, bridge: &str, route: &str, binding: &str) -> BindingMetrics {
        let labels = BindingLabels {
            bridge: bridge.to_owned(),
            route: route.to_owned(),
            binding: binding.to_owned(),
        };
        let mut bindings = self.bindings.lock().unwrap_or_else(PoisonError::into_inner);
        bindings
            .entry(labels.clone())
            .or_insert_with(|| BindingMetrics {
                inner: Arc::new(BindingInner {
                    received: self.received.get_or_create_owned(&labels),
                    sent: self.sent.get_or_create_owned(&labels),
                    dropped: self.dropped.get_or_create_owned(&labels),
                    filtered: self.filtered.get_or_create_owned(&labels),
                    expired: self.expired.get_or_create_owned(&labels),
                    dead_lettered: self.dead_lettered.get_or_create_owned(&labels),
                    in_flight: self.in_flight.get_or_create_owned(&labels),
                    outbox_depth: self.outbox_depth.get_or_create_owned(&labels),
                    outbox_oldest_age: self.outbox_oldest_age.get_or_create_owned(&labels),
                    record_latency: self.record_latency.get_or_create_owned(&labels),
                }),
            })
            .clone()
    }

    /// The gauges and histograms of one route.
    pub fn route(&self, bridge: &str, route: &str) -> RouteMetrics {
        let labels = RouteLabels {
            bridge: bridge.to_owned(),
            route: route.to_owned(),
        };
        let mut routes = self.routes.lock().unwrap_or_else(PoisonError::into_inner);
        routes
            .entry(labels.clone())
            .or_insert_with(|| RouteMetrics {
                lease_held: self.lease_held.get_or_create_owned(&labels),
                settle_latency: self.settle_latency.get_or_create_owned(&labels),
                redelivered: self.redelivered.get_or_create_owned(&labels),
            })
            .clone()
    }

    /// The gauges of one session.
    pub fn session(&self, bridge: &str, session: &str) -> SessionMetrics {
        let labels = SessionLabels {
            bridge: bridge.to_owned(),
            session: session.to_owned(),
        };
        let mut sessions = self.sessions.lock().unwrap_or_else(PoisonError::into_inner);
        sessions
            .entry(labels.clone())
            .or_insert_with(|| SessionMetrics {
                connected: self.session_connected.get_or_create_owned(&labels),
                reconnects: self.session_reconnects.get_or_create_owned(&labels),
            })
            .clone()
    }

    /// The error counter of one store and error kind.
    pub fn store_errors(&self, bridge: &str, store: &str, kind: &str) -> Counter {
        self.store_errors.get_or_create_owned(&StoreErrorLabels {
            bridge: bridge.to_owned(),
            store: store.to_owned(),
            kind: kind.to_owned(),
        })
    }

    /// The fencing-rejection counter of `op` on `store` of `bridge`.
    pub fn store_fenced(&self, bridge: &str, store: &str, op: &str) -> Counter {
        self.store_fenced.get_or_create_owned(&StoreFencedLabels {
            bridge: bridge.to_owned(),
            store: store.to_owned(),
            op: op.to_owned(),
        })
    }

    /// The current counts of every binding, ordered by bridge, route, binding.
    pub fn snapshot(&self) -> Vec<(BindingLabels, BindingCounts)> {
        let bindings = self.bindings.lock().unwrap_or_else(PoisonError::into_inner);
        bindings
            .iter()
            .map(|(labels, metrics)| (labels.clone(), metrics.counts()))
            .collect()
    }

    /// Whether this agent holds each route's partition lease, ordered by
    /// bridge and route.
    pub fn lease_states(&self) -> Vec<(RouteLabels, bool)> {
        let routes = self.routes.lock().unwrap_or_else(PoisonError::into_inner);
        routes
            .iter()
            .map(|(labels, route)| (labels.clone(), route.lease_held.get() > 0))
            .collect()
    }

    /// The state of every session, ordered by bridge and session.
    pub fn session_states(&self) -> Vec<(SessionLabels, SessionState)> {
        let sessions = self.sessions.lock().unwrap_or_else(PoisonError::into_inner);
        sessions
            .iter()
            .map(|(labels, session)| {
                let state = SessionState {
                    connected: session.connected.get() > 0,
                    reconnects: session.reconnects.get(),
                };
                (labels.clone(), state)
            })
            .collect()
    }

    /// Everything in the Prometheus text exposition format.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

struct BindingInner {
    received: Counter,
    sent: Counter,
    dropped: Counter,
    filtered: Counter,
    expired: Counter,
    dead_lettered: Counter,
    in_flight: Gauge,
    outbox_depth: Gauge,
    outbox_oldest_age: Gauge<f64, std::sync::atomic::AtomicU64>,
    record_latency: Histogram,
}

/// The counters of one binding. Cloning shares them.
#[derive(Clone)]
pub struct BindingMetrics {
    inner: Arc<BindingInner>,
}

impl std::fmt::Debug for BindingMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BindingMetrics")
            .field("counts", &self.counts())
            .finish()
    }
}

/// The terminal state a message reached for one binding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Terminal {
    /// Accepted by the destination.
    Sent,
    /// Dropped by an explicit policy.
    Dropped,
    /// Discarded by a filter.
    Filtered,
    /// Expired before delivery.
    Expired,
    /// Written to the DLQ.
    DeadLettered,
}

impl BindingMetrics {
    /// `n` messages entered the route for this binding.
    pub fn received(&self, n: u64) {
        self.inner.received.inc_by(n);
        self.inner.in_flight.inc_by(gauge_value(n));
    }

    /// `n` messages reached `terminal`; `latency` is how long each took, when
    /// known (from record creation or receive).
    pub fn finished(&self, terminal: Terminal, n: u64, latency: Option<Duration>) {
        let counter = match terminal {
            Terminal::Sent => &self.inner.sent,
            Terminal::Dropped => &self.inner.dropped,
            Terminal::Filtered => &self.inner.filtered,
            Terminal::Expired => &self.inner.expired,
            Terminal::DeadLettered => &self.inner.dead_lettered,
        };
        counter.inc_by(n);
        self.inner.in_flight.dec_by(gauge_value(n));
        if let Some(latency) = latency {
            self.inner.record_latency.observe(latency.as_secs_f64());
        }
    }

    /// The outbox's current depth and oldest pending age for this binding.
    pub fn set_outbox(&self, depth: u64, oldest_pending_age: Option<Duration>) {
        self.inner.outbox_depth.set(gauge_value(depth));
        self.inner
            .outbox_oldest_age
            .set(oldest_pending_age.map_or(0.0, |age| age.as_secs_f64()));
    }

    /// The current counts.
    pub fn counts(&self) -> BindingCounts {
        let i = &self.inner;
        BindingCounts {
            received: i.received.get(),
            sent: i.sent.get(),
            dropped: i.dropped.get(),
            filtered: i.filtered.get(),
            expired: i.expired.get(),
            dead_lettered: i.dead_lettered.get(),
            in_flight: u64::try_from(i.in_flight.get()).unwrap_or(0),
            outbox_depth: u64::try_from(i.outbox_depth.get()).unwrap_or(0),
            oldest_pending_age: Duration::try_from_secs_f64(i.outbox_oldest_age.get()).ok(),
        }
    }
}

/// Gauges are signed; counts beyond `i64::MAX` cannot happen in practice and
/// saturate rather than wrap.
fn gauge_value(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// One binding's figures at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BindingCounts {
    /// Messages received for the binding.
    pub received: u64,
    /// Accepted by the destination.
    pub sent: u64,
    /// Dropped by an explicit policy.
    pub dropped: u64,
    /// Discarded by a filter.
    pub filtered: u64,
    /// Expired before delivery.
    pub expired: u64,
    /// Written to the DLQ.
    pub dead_lettered: u64,
    /// Not yet terminal.
    pub in_flight: u64,
    /// Outbox records pending or claimed.
    pub outbox_depth: u64,
    /// Age of the oldest pending record, when there is one.
    pub oldest_pending_age: Option<Duration>,
}

impl BindingCounts {
    /// True when `received` equals the sum of the terminal counters and
    /// `in_flight`.
    pub fn is_conserved(&self) -> bool {
        self.received
            == self.sent
                + self.dropped
                + self.filtered
                + self.expired
                + self.dead_lettered
                + self.in_flight
    }
}

/// One session's state at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionState {
    /// Its broker connection is up.
    pub connected: bool,
    /// Reconnections since the agent started.
    pub reconnects: u64,
}

/// The gauges and histograms of one route.
#[derive(Clone, Debug)]
pub struct RouteMetrics {
    lease_held: Gauge,
    settle_latency: Histogram,
    redelivered: Counter,
}

impl RouteMetrics {
    /// Whether this agent holds the route's partition lease.
    pub fn set_lease_held(&self, held: bool) {
        self.lease_held.set(i64::from(held));
    }

    /// The route took a delivery the source had sent before.
    pub fn redelivered(&self) {
        self.redelivered.inc();
    }

    /// A source delivery was settled `latency` after it was received.
    pub fn settled_after(&self, latency: Duration) {
        self.settle_latency.observe(latency.as_secs_f64());
    }
}

/// The gauges of one session.
#[derive(Clone, Debug)]
pub struct SessionMetrics {
    connected: Gauge,
    reconnects: Counter,
}

impl SessionMetrics {
    /// The session's connection went up or down; a transition to up after
    /// the first connection counts as a reconnect.
    pub fn set_connected(&self, connected: bool, is_reconnect: bool) {
        self.connected.set(i64::from(connected));
        if connected && is_reconnect {
            self.reconnects.inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_terminal_keeps_the_conservation_law() {
        let metrics = Metrics::new();
        let binding = metrics.binding("b", "r", "to-events");
        binding.received(10);
        for terminal in [
            Terminal::Sent,
            Terminal::Dropped,
            Terminal::Filtered,
            Terminal::Expired,
            Terminal::DeadLettered,
        ] {
            binding.finished(terminal, 1, Some(Duration::from_millis(3)));
        }
        let counts = binding.counts();
        assert_eq!(counts.in_flight, 5);
        assert!(counts.is_conserved(), "{counts:?}");
        assert_eq!(counts.sent + counts.dead_lettered, 2);
    }

    #[test]
    fn lease_and_session_states_are_listed_in_order() {
        let metrics = Metrics::new();
        metrics.route("b", "z").set_lease_held(true);
        metrics.route("b", "a");
        let session = metrics.session("b", "conn");
        session.set_connected(true, false);
        session.set_connected(false, false);
        metrics.session("b", "conn").set_connected(true, true);
        let leases: Vec<_> = metrics
            .lease_states()
            .into_iter()
            .map(|(l, held)| (l.route, held))
            .collect();
        assert_eq!(leases, [("a".to_owned(), false), ("z".to_owned(), true)]);
        let sessions = metrics.session_states();
        assert_eq!(sessions.len(), 1);
        let expected = SessionState {
            connected: true,
            reconnects: 1,
        };
        assert_eq!(sessions[0].1, expected);
    }

    #[test]
    fn bindings_are_shared_and_listed_in_order() {
        let metrics = Metrics::new();
        metrics.binding("b", "r", "z").received(1);
        metrics.binding("b", "r", "a").received(2);
        metrics.binding("b", "r", "z").received(3);
        let snapshot = metrics.snapshot();
        let names: Vec<_> = snapshot.iter().map(|(l, _)| l.binding.as_str()).collect();
        assert_eq!(names, ["a", "z"]);
        assert_eq!(snapshot[1].1.received, 4);
    }

    #[test]
    fn text_exposition_names_every_family() {
        let metrics = Metrics::new();
        metrics
            .binding("bridge-1", "route-1", "to-events")
            .received(1);
        metrics.route("bridge-1", "route-1").set_lease_held(true);
        metrics
            .session("bridge-1", "mqtt-conn")
            .set_connected(true, false);
        let text = metrics.encode().expect("encoding to a String cannot fail");
        for name in [
            "ferry_messages_received_total{bridge=\"bridge-1\",route=\"route-1\",binding=\"to-events\"} 1",
            "ferry_messages_in_flight{bridge=\"bridge-1\",route=\"route-1\",binding=\"to-events\"} 1",
            "ferry_lease_held{bridge=\"bridge-1\",route=\"route-1\"} 1",
            "ferry_session_connected{bridge=\"bridge-1\",session=\"mqtt-conn\"} 1",
            "ferry_spans_dropped_total 0",
        ] {
            assert!(text.contains(name), "missing {name} in:\n{text}");
        }
    }
}
