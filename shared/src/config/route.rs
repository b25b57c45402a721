//! Routes: receiver → bindings, with their delivery mode, `policy` and `session` (drain) block.

use serde::Deserialize;

use super::duration::Duration;

/// How a route delivers (`delivery_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryMode {
    /// Receive → send → settle the source; the source is held open meanwhile. One binding.
    DirectHold,
    /// Receive → one outbox record per binding → settle the source → a drainer sends.
    SharedOutbox,
}

impl DeliveryMode {
    /// The name the configuration uses.
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryMode::DirectHold => "direct_hold",
            DeliveryMode::SharedOutbox => "shared_outbox",
        }
    }
}

/// How a route spreads a message over its bindings (`dispatch_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DispatchMode {
    /// Exactly one binding (default).
    #[default]
    Single,
    /// Every binding gets the message (shared_outbox only).
    FanOut,
}

/// When the source is acknowledged (`policy.ack_after`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AckAfter {
    /// Once the destination accepted the message (direct_hold).
    TargetAccept,
    /// Once the outbox records are durable (shared_outbox).
    OutboxPersist,
}

/// What happens to a message that expired or failed for good.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureAction {
    /// Write a DLQ entry (confirmed durable before the source or record is settled).
    Dlq,
    /// Drop it, counted as `dropped` (or `expired`).
    Drop,
}

/// One route (`routes[]`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// Unique id; with the bridge id it names the route's partition (`{bridge}/{route}`).
    pub id: String,
    /// The receiver whose deliveries this route takes.
    pub receiver_id: String,
    /// `direct_hold` or `shared_outbox`.
    pub delivery_mode: DeliveryMode,
    /// `single` (default) or `fan_out`.
    #[serde(default)]
    pub dispatch_mode: DispatchMode,
    /// Ids of the bindings the message goes to.
    pub bindings: Vec<String>,
    /// Acknowledgement, back-pressure, retry and failure policy.
    #[serde(default)]
    pub policy: Policy,
    /// The drainer's settings; required for `shared_outbox`, not allowed for `direct_hold`.
    #[serde(default)]
    pub session: Option<RouteSession>,
}

impl Route {
    /// `policy.ack_after`, or the delivery mode's default: `target_accept` for direct_hold,
    /// `outbox_persist` for shared_outbox.
    pub fn ack_after(&self) -> AckAfter {
        self.policy.ack_after.unwrap_or(match self.delivery_mode {
            DeliveryMode::DirectHold => AckAfter::TargetAccept,
            DeliveryMode::SharedOutbox => AckAfter::OutboxPersist,
        })
    }
}

/// A route's `policy:` block.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// When the source is acknowledged. Default: `target_accept` for direct_hold,
    /// `outbox_persist` for shared_outbox (the only value each mode accepts); see
    /// [`Route::ack_after`].
    #[serde(default)]
    pub ack_after: Option<AckAfter>,
    /// Unsettled deliveries at most; the route stops taking more at this count (MQTT v5
    /// `receive_maximum`). Default 100.
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: u32,
    /// Pending records in the partition at most before the route stops settling new
    /// deliveries. Default 10000.
    #[serde(default = "default_max_outbox_depth")]
    pub max_outbox_depth: u64,
    /// Counted releases of a record before it may go to the DLQ (together with
    /// `replay_budget`). Default 5; 0 dead-letters after the budget on the first failure.
    #[serde(default = "default_max_replay_attempts")]
    pub max_replay_attempts: u32,
    /// Wall-clock time since a record's first attempt before it may go to the DLQ (together
    /// with `max_replay_attempts`). Default 15m.
    #[serde(default = "default_replay_budget")]
    pub replay_budget: Duration,
    /// What to do with a message past its expiry: `dlq` (default) or `drop`.
    #[serde(default = "default_failure_action")]
    pub on_expired: FailureAction,
    /// What to do after a permanent send error (or an exhausted budget): `dlq` (default) or
    /// `drop`.
    #[serde(default = "default_failure_action")]
    pub on_permanent_failure: FailureAction,
    /// How long one send may take before it counts as a transient failure. Default 30s.
    #[serde(default = "default_send_timeout")]
    pub send_timeout: Duration,
    /// direct_hold: how long transient failures are retried in process before the delivery is
    /// treated as a permanent failure. Default 1m.
    #[serde(default = "default_send_retry_budget")]
    pub send_retry_budget: Duration,
    /// Backoff between in-process retries (full jitter).
    #[serde(default)]
    pub retry_backoff: RetryBackoff,
    /// Largest payload the route accepts; a larger message is a permanent failure. Default
    /// 262144 (256 KiB, SQS's classic limit).
    #[serde(default = "default_max_payload_bytes")]
    pub max_payload_bytes: u32,
    /// Time to live from receipt when the message carries no expiry of its own. Default: none.
    #[serde(default)]
    pub ttl: Option<Duration>,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            ack_after: None,
            max_in_flight: default_max_in_flight(),
            max_outbox_depth: default_max_outbox_depth(),
            max_replay_attempts: default_max_replay_attempts(),
            replay_budget: default_replay_budget(),
            on_expired: default_failure_action(),
            on_permanent_failure: default_failure_action(),
            send_timeout: default_send_timeout(),
            send_retry_budget: default_send_retry_budget(),
            retry_backoff: RetryBackoff::default(),
            max_payload_bytes: default_max_payload_bytes(),
            ttl: None,
        }
    }
}

/// `policy.retry_backoff`: exponential backoff with full jitter.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryBackoff {
    /// First delay. Default 100ms.
    #[serde(default = "default_backoff_initial")]
    pub initial_interval: Duration,
    /// Largest delay. Default 30s.
    #[serde(default = "default_backoff_max")]
    pub max_interval: Duration,
    /// Growth per attempt, at least 1.0. Default 2.0.
    #[serde(default = "default_multiplier")]
    pub multiplier: f64,
}

impl Default for RetryBackoff {
    fn default() -> Self {
        RetryBackoff {
            initial_interval: default_backoff_initial(),
            max_interval: default_backoff_max(),
            multiplier: default_multiplier(),
        }
    }
}

/// A route's `session:` block: who drains the partition, how often, and the lease timings.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteSession {
    /// The session that owns the partition: the drainer pauses while it is disconnected.
    pub session_id: String,
    /// The sender the drainer sends through; every binding of the route must be on it.
    pub sender_id: String,
    /// Fallback poll interval when no write wakes the drainer. Default 1s when no
    /// `drain_strategy` is set; not allowed together with `drain_strategy`.
    #[serde(default)]
    pub drain_interval: Option<Duration>,
    /// Adaptive polling instead of `drain_interval`.
    #[serde(default)]
    pub drain_strategy: Option<DrainStrategy>,
    /// Records claimed per drain cycle at most. Default 50.
    #[serde(default = "default_drain_batch_size")]
    pub drain_batch_size: u32,
    /// Lifetime of the partition lease. Default 15s.
    #[serde(default = "default_lease_ttl")]
    pub lease_ttl: Duration,
    /// How often the lease is renewed; less than `lease_ttl`. Default `lease_ttl / 3`.
    #[serde(default)]
    pub renew_interval: Option<Duration>,
    /// How long a drainer that is losing its lease may finish in-flight sends. Default 5s.
    #[serde(default = "default_step_down_grace")]
    pub step_down_grace: Duration,
}

/// The kind of `drain_strategy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DrainStrategyType {
    /// min → ×multiplier → max while the partition is empty, back to min when records appear.
    AdaptiveBackoff,
}

/// `session.drain_strategy`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrainStrategy {
    /// `adaptive_backoff`.
    #[serde(rename = "type")]
    pub kind: DrainStrategyType,
    /// Poll interval while records flow. Default 100ms.
    #[serde(default = "default_backoff_initial")]
    pub min_interval: Duration,
    /// Longest poll interval while empty. Default 30s.
    #[serde(default = "default_backoff_max")]
    pub max_interval: Duration,
    /// Growth per empty poll, at least 1.0. Default 2.0.
    #[serde(default = "default_multiplier")]
    pub multiplier: f64,
}

/// How the drainer polls when no write wakes it, resolved from the session block.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DrainPoll {
    /// A fixed interval.
    Fixed(Duration),
    /// Adaptive backoff.
    AdaptiveBackoff {
        /// Interval while records flow.
        min_interval: Duration,
        /// Longest interval while empty.
        max_interval: Duration,
        /// Growth per empty poll.
        multiplier: f64,
    },
}

impl RouteSession {
    /// `drain_strategy` if set, otherwise `drain_interval` (default 1s).
    pub fn drain_poll(&self) -> DrainPoll {
        match &self.drain_strategy {
            Some(s) => match s.kind {
                DrainStrategyType::AdaptiveBackoff => DrainPoll::AdaptiveBackoff {
                    min_interval: s.min_interval,
                    max_interval: s.max_interval,
                    multiplier: s.multiplier,
                },
            },
            None => DrainPoll::Fixed(self.drain_interval.unwrap_or_else(default_drain_interval)),
        }
    }

    /// `renew_interval`, or `lease_ttl / 3`.
    pub fn renew_interval(&self) -> Duration {
        self.renew_interval
            .unwrap_or_else(|| Duration::from(self.lease_ttl.get() / 3))
    }
}

/// Default `policy.max_in_flight`.
pub fn default_max_in_flight() -> u32 {
    100
}

/// Default `policy.max_outbox_depth`.
pub fn default_max_outbox_depth() -> u64 {
    10_000
}

/// Default `policy.max_replay_attempts`.
pub fn default_max_replay_attempts() -> u32 {
    5
}

/// Default `policy.replay_budget`.
pub fn default_replay_budget() -> Duration {
    Duration::from_secs(15 * 60)
}

/// Default `policy.on_expired` and `policy.on_permanent_failure`.
pub fn default_failure_action() -> FailureAction {
    FailureAction::Dlq
}

/// Default `policy.send_timeout`.
pub fn default_send_timeout() -> Duration {
    Duration::from_secs(30)
}

/// Default `policy.send_retry_budget`.
pub fn default_send_retry_budget() -> Duration {
    Duration::from_secs(60)
}

/// Default `policy.max_payload_bytes`.
pub fn default_max_payload_bytes() -> u32 {
    256 * 1024
}

/// Default first backoff delay and adaptive drain `min_interval`.
pub fn default_backoff_initial() -> Duration {
    Duration::from_millis(100)
}

/// Default largest backoff delay and adaptive drain `max_interval`.
pub fn default_backoff_max() -> Duration {
    Duration::from_secs(30)
}

/// Default backoff and adaptive drain multiplier.
pub fn default_multiplier() -> f64 {
    2.0
}

/// Default `session.drain_interval` (when no `drain_strategy` is set).
pub fn default_drain_interval() -> Duration {
    Duration::from_secs(1)
}

/// Default `session.drain_batch_size`.
pub fn default_drain_batch_size() -> u32 {
    50
}

/// Default `session.lease_ttl`.
pub fn default_lease_ttl() -> Duration {
    Duration::from_secs(15)
}

/// Default `session.step_down_grace`.
pub fn default_step_down_grace() -> Duration {
    Duration::from_secs(5)
}
