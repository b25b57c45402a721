//! Domain types of the state store: what the services read and write,
//! independent of the gRPC messages and of any backend's rows.

use std::collections::BTreeMap;
use std::time::SystemTime;

pub use ferry_shared::dlq::{DlqFilter, DlqReason, DlqStat};

/// Labels of an agent, or a selector's required labels, ordered by name.
pub type Labels = BTreeMap<String, String>;

// ---------------------------------------------------------------------------
// Configurations

/// A request to store a bridge configuration as its next version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApplyConfig {
    /// The document's `bridge.id`; must not be empty.
    pub bridge_id: String,
    /// The document, exactly as it will be stored and pushed.
    pub yaml: String,
    /// Which agents run it (every label must match).
    pub selector: Labels,
    /// Free-form note stored with the version.
    pub change_note: String,
    /// Compare-and-swap: `Some(n)` succeeds only if the current version is
    /// `n` (`Some(0)`: the configuration must not exist yet).
    pub expected_version: Option<u64>,
    /// Who applies it; stored with the new version.
    pub applied_by: AppliedBy,
}

/// Who stored a configuration version (issue 16): the audit record every
/// version carries. Versions stored before the record existed (schema v1)
/// read back with both fields empty.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AppliedBy {
    /// The principal's name (`alice`, `anonymous (insecure mode)`).
    pub principal: String,
    /// The client's address (`10.0.0.7:53122`); empty when unknown.
    pub client_address: String,
}

/// One stored version of a bridge configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredConfig {
    /// The bridge id.
    pub bridge_id: String,
    /// 1 for the first apply, +1 for every change.
    pub version: u64,
    /// The document.
    pub yaml: String,
    /// The agent selector.
    pub selector: Labels,
    /// The note stored with this version.
    pub change_note: String,
    /// When this version was stored.
    pub created_at: SystemTime,
    /// Lowercase hex SHA-256 of `yaml`.
    pub digest: String,
    /// Who stored this version.
    pub applied_by: AppliedBy,
}

/// The outcome of [`ApplyConfig`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedConfig {
    /// The new version, or the current one when nothing changed.
    pub config: StoredConfig,
    /// False when document and selector equal the current version's (no new
    /// version was stored).
    pub changed: bool,
}

/// One entry of a configuration's history, without its document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigVersion {
    /// The version number.
    pub version: u64,
    /// When it was stored.
    pub created_at: SystemTime,
    /// The note stored with it.
    pub change_note: String,
    /// Lowercase hex SHA-256 of its document.
    pub digest: String,
    /// Who stored it.
    pub applied_by: AppliedBy,
}

// ---------------------------------------------------------------------------
// Agents

/// What an agent says when its stream opens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentHello {
    /// The agent id; must not be empty.
    pub agent_id: String,
    /// Its labels (matched against configuration selectors).
    pub labels: Labels,
    /// Its build version.
    pub build_version: String,
    /// Feature names it supports.
    pub capabilities: Vec<String>,
    /// When the stream opened.
    pub connected_at: SystemTime,
}

/// An agent as last seen, with its per-bridge status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentRecord {
    /// The agent id.
    pub agent_id: String,
    /// Its labels.
    pub labels: Labels,
    /// Its build version.
    pub build_version: String,
    /// Feature names it supports.
    pub capabilities: Vec<String>,
    /// Whether its stream is open.
    pub connected: bool,
    /// When its current (or last) stream opened.
    pub connected_at: SystemTime,
    /// When anything last arrived from it.
    pub last_seen: SystemTime,
    /// When its last stream ended; `None` while connected.
    pub disconnected_at: Option<SystemTime>,
    /// One entry per bridge pushed to it, ordered by bridge id.
    pub bridges: Vec<AgentBridgeStatus>,
}

/// What one agent did with one bridge configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentBridgeStatus {
    /// The bridge.
    pub bridge_id: String,
    /// The last push.
    pub pushed: Option<ConfigPushRecord>,
    /// The last version the agent acknowledged.
    pub acked: Option<ConfigAckRecord>,
    /// The last version the agent refused (kept after later ACKs, so an
    /// operator can still see it; compare its version with `acked`).
    pub last_nack: Option<ConfigNackRecord>,
}

/// A configuration version sent to an agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigPushRecord {
    /// The version pushed.
    pub version: u64,
    /// The nonce the answer must carry.
    pub nonce: String,
    /// When it was pushed.
    pub at: SystemTime,
}

/// A version an agent applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigAckRecord {
    /// The version.
    pub version: u64,
    /// When the ACK arrived.
    pub at: SystemTime,
}

/// A version an agent refused, with why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigNackRecord {
    /// The refused version.
    pub version: u64,
    /// The error as text.
    pub error: String,
    /// Every problem, each as `path: message`.
    pub details: Vec<String>,
    /// When the NACK arrived.
    pub at: SystemTime,
}

/// Something that happened between an agent and one bridge configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentBridgeEvent {
    /// A version was pushed with this nonce.
    Pushed {
        /// The version.
        version: u64,
        /// The nonce.
        nonce: String,
    },
    /// The agent acknowledged a version.
    Acked {
        /// The version.
        version: u64,
    },
    /// The agent refused a version.
    Nacked {
        /// The version.
        version: u64,
        /// The error as text.
        error: String,
        /// Every problem, each as `path: message`.
        details: Vec<String>,
    },
    /// The configuration was withdrawn from the agent: its status is removed.
    Withdrawn,
}

// ---------------------------------------------------------------------------
// Leases

/// A lease as granted or observed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The key, `{bridge}/{partition}`.
    pub key: String,
    /// The holder; `None` after a release. An expired lease keeps its holder
    /// until somebody else takes it (compare `expires_at` with the time).
    pub holder: Option<String>,
    /// The fencing version of the current (or last) grant.
    pub version: u64,
    /// When the current (or last) holder acquired it.
    pub acquired_at: SystemTime,
    /// When it lapses unless renewed.
    pub expires_at: SystemTime,
}

/// The outcome of an acquire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseAcquisition {
    /// The caller holds the lease.
    Granted(Lease),
    /// Somebody else holds it and it has not expired.
    HeldByOther(Lease),
}

// ---------------------------------------------------------------------------
// Dead letters (the reason, filter and counts are ferry-shared's, which the
// agent uses too)

/// One dead letter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DlqEntry {
    /// Deterministic id; writing the same id twice stores it once.
    pub id: String,
    /// The bridge.
    pub bridge_id: String,
    /// The route.
    pub route_id: String,
    /// The binding that failed.
    pub binding_id: String,
    /// Why.
    pub reason: DlqReason,
    /// The last error as text.
    pub last_error: String,
    /// Delivery attempts made.
    pub attempts: u32,
    /// The first attempt, if any.
    pub first_attempt_at: Option<SystemTime>,
    /// The last attempt, if any.
    pub last_attempt_at: Option<SystemTime>,
    /// When the entry was written (listings are ordered by it).
    pub dead_lettered_at: SystemTime,
    /// The agent that wrote it.
    pub agent_id: String,
    /// The binding's address (topic or queue).
    pub address: String,
    /// The message: an encoded `ferry.v1.Envelope`, stored verbatim.
    pub envelope: Vec<u8>,
}

// ---------------------------------------------------------------------------
// Metrics

/// The latest metrics snapshot of one agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsRecord {
    /// The agent.
    pub agent_id: String,
    /// When the snapshot was taken; a snapshot older than the stored one is
    /// ignored.
    pub captured_at: SystemTime,
    /// The snapshot: an encoded `ferry.v1.MetricsSnapshot`, stored verbatim.
    pub snapshot: Vec<u8>,
}
