//! Commands from the control plane (today: redrive one DLQ entry), each run
//! in its own task so the stream keeps reading, answering heartbeats and
//! applying pushes meanwhile.
//!
//! Invariants:
//! - every command is answered exactly once with its `command_id`: `ok` only
//!   when its work is durable (a redriven envelope appended to the route's
//!   outbox, or accepted by the destination of a `direct_hold` route), so
//!   the control plane deletes a DLQ entry only after that;
//! - a redrive puts the envelope back on the entry's failed binding only,
//!   through the running bridge's [`crate::routes::Redrive`];
//! - at most [`MAX_COMMANDS`] commands run at once; one more is refused at
//!   once (not queued), and the control plane reports it as failed;
//! - a bridge, route or binding this agent does not run is a clear error,
//!   never a silent success.

use std::collections::BTreeMap;
use std::sync::Arc;

use ferry_shared::api::v1 as pb;
use pb::agent_message::Message as Up;
use tokio::sync::{Semaphore, mpsc, watch};

use super::bridges::BridgeHandle;
use crate::stores::DlqEntry;

/// Commands running at once, at most.
pub const MAX_COMMANDS: usize = 16;

/// Runs commands against the running bridges.
#[derive(Clone, Debug)]
pub struct Commands {
    bridges: watch::Receiver<BTreeMap<String, BridgeHandle>>,
    permits: Arc<Semaphore>,
}

impl Commands {
    /// Commands against the bridges `bridges` lists.
    pub fn new(bridges: watch::Receiver<BTreeMap<String, BridgeHandle>>) -> Self {
        Self {
            bridges,
            permits: Arc::new(Semaphore::new(MAX_COMMANDS)),
        }
    }

    /// Runs `command` in a task of its own and sends its result on `reply`
    /// (the stream it came from). Returns at once.
    pub fn spawn(&self, command: pb::Command, reply: mpsc::Sender<pb::AgentMessage>) {
        let command_id = command.command_id.clone();
        let Ok(permit) = Arc::clone(&self.permits).try_acquire_owned() else {
            tracing::warn!(command = %command_id, limit = MAX_COMMANDS, "command refused: too many in progress");
            let busy = format!("agent busy: {MAX_COMMANDS} commands in progress; retry");
            tokio::spawn(answer(reply, command_id, Err(busy)));
            return;
        };
        let bridges = self.bridges.clone();
        tokio::spawn(async move {
            let outcome = run(&bridges, command).await;
            drop(permit);
            answer(reply, command_id, outcome).await;
        });
    }
}

async fn run(
    bridges: &watch::Receiver<BTreeMap<String, BridgeHandle>>,
    command: pb::Command,
) -> Result<(), String> {
    match command.kind {
        Some(pb::command::Kind::Redrive(redrive)) => {
            let entry = redrive
                .entry
                .ok_or_else(|| "redrive command without an entry".to_owned())?;
            redrive_entry(bridges, entry).await
        }
        None => Err("unknown command kind (a newer control plane?)".to_owned()),
    }
}

async fn redrive_entry(
    bridges: &watch::Receiver<BTreeMap<String, BridgeHandle>>,
    entry: pb::DlqEntry,
) -> Result<(), String> {
    let entry = DlqEntry::try_from(entry).map_err(|e| format!("invalid DLQ entry: {e}"))?;
    // Cloned out of the watch: a push may replace the bridge meanwhile.
    let redrive = bridges
        .borrow()
        .get(&entry.bridge_id)
        .map(|handle| Arc::clone(&handle.redrive));
    let redrive =
        redrive.ok_or_else(|| format!("bridge {:?} is not running here", entry.bridge_id))?;
    let outcome = redrive.redrive(&entry).await;
    match &outcome {
        Ok(()) => {
            tracing::info!(entry = %entry.id, bridge = %entry.bridge_id, route = %entry.route_id, binding = %entry.binding_id, "dead letter redriven")
        }
        Err(error) => {
            tracing::warn!(entry = %entry.id, bridge = %entry.bridge_id, route = %entry.route_id, binding = %entry.binding_id, %error, "redrive failed")
        }
    }
    outcome
}

async fn answer(
    reply: mpsc::Sender<pb::AgentMessage>,
    command_id: String,
    outcome: Result<(), String>,
) {
    let (ok, error) = match outcome {
        Ok(()) => (true, String::new()),
        Err(error) => (false, error),
    };
    let message = pb::AgentMessage {
        message: Some(Up::CommandResult(pb::CommandResult {
            command_id,
            ok,
            error,
        })),
    };
    if reply.send(message).await.is_err() {
        // The control plane times the command out and reports it failed;
        // a durable redrive may then be redriven twice (at least once).
        tracing::debug!("the stream ended before the command's result");
    }
}
