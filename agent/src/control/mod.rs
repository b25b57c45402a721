//! A managed agent: the control plane's side of the agent (`ferry-agent run
//! --control-plane URL`).
//!
//! - [`stream`]: one `AgentService.Connect` stream (Hello, pushes, answers,
//!   heartbeats both ways);
//! - [`applier`]: the task that owns the running bridges and applies each
//!   push or withdrawal in order, answering ACK or NACK;
//! - [`bridges`]: bridge id → running bridge, one version at a time, the
//!   last good one kept when a new one is refused;
//! - [`cache`]: every ACKed configuration on disk, so the agent runs without
//!   the control plane;
//! - [`report`]: the metrics snapshot sent up the stream every interval;
//! - [`commands`]: the control plane's commands (redrive), one task each;
//! - [`managed`]: the whole managed agent (data directory, admin listener,
//!   this loop) behind one call, for `ferry-agent run` and `ferry quickstart`.
//!
//! Invariants:
//! - the cached bridges start before the first connection attempt, so an
//!   agent whose control plane is down runs what it last ran;
//! - the running bridges do not depend on the stream: a lost control plane
//!   stops no message flow, and the agent reconnects with jittered
//!   exponential backoff, capped at the heartbeat interval (so it is back
//!   within about one interval of the control plane's return), logging an
//!   outage once rather than once per attempt;
//! - on shutdown the stream ends first, then every bridge shuts down
//!   gracefully.

pub mod applier;
pub mod bridges;
pub mod cache;
pub mod commands;
pub mod managed;
pub mod report;
pub mod stream;

use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::routes::RetryBackoff;
use bridges::Bridges;
use commands::Commands;
use report::Reporter;
use stream::{Identity, Reached, Upstream};

/// Pushes and withdrawals queued for the applier.
const WORK_BUFFER: usize = 16;
/// The first reconnection delay's ceiling.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// Runs the cached bridges, then keeps a stream open to `endpoint` until
/// `shutdown` is cancelled, sending a metrics snapshot every
/// `metrics_interval`; stops every bridge before returning.
pub async fn run(
    endpoint: String,
    identity: Identity,
    mut bridges: Bridges,
    metrics_interval: Duration,
    shutdown: CancellationToken,
) {
    bridges.start_cached().await;
    let versions = bridges.versions();
    let upstream = Upstream {
        reporter: Reporter::new(
            identity.agent_id.clone(),
            metrics_interval,
            bridges.metrics(),
            bridges.handles(),
        ),
        commands: Commands::new(bridges.handles()),
    };
    let (work_tx, work_rx) = mpsc::channel(WORK_BUFFER);
    let applier = tokio::spawn(applier::run(bridges, work_rx));
    let mut heartbeat = stream::DEFAULT_HEARTBEAT;
    let mut backoff = new_backoff(heartbeat);
    // The error last logged while the control plane is unreachable: an outage
    // is logged once (and again when its error changes), not once per attempt.
    let mut logged: Option<String> = None;
    while !shutdown.is_cancelled() {
        let serve = stream::serve(
            &endpoint,
            &identity,
            &versions,
            work_tx.clone(),
            &upstream,
            &mut heartbeat,
            &shutdown,
        );
        // A connection attempt in progress does not delay a shutdown.
        let (reached, result) = tokio::select! {
            () = shutdown.cancelled() => break,
            served = serve => served,
        };
        if reached == Reached::Yes {
            backoff = new_backoff(heartbeat);
            logged = None;
        }
        let error = match result {
            Ok(()) => break,
            Err(error) => error.to_string(),
        };
        let delay = backoff.next_delay();
        if logged.as_ref() == Some(&error) {
            tracing::debug!(%endpoint, %error, ?delay, "control plane still unreachable");
        } else if reached == Reached::Yes {
            tracing::warn!(%endpoint, %error, "control plane stream down; reconnecting (the bridges keep running)");
        } else {
            tracing::warn!(%endpoint, %error, retry_max = ?heartbeat, "cannot reach the control plane; the bridges keep running, retrying with backoff (logged again when connected or when the error changes)");
        }
        logged = Some(error);
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = tokio::time::sleep(delay) => {}
        }
    }
    drop(work_tx);
    if let Err(error) = applier.await {
        tracing::error!(%error, "the applier task failed");
    }
}

/// Full jitter, doubling from 100 ms up to the heartbeat interval.
fn new_backoff(heartbeat: Duration) -> RetryBackoff {
    RetryBackoff::new(FIRST_BACKOFF, heartbeat.max(FIRST_BACKOFF), 2.0)
}
