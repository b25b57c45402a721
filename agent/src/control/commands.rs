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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn redrive(command_id: &str, bridge: &str) -> pb::Command {
        pb::Command {
            command_id: command_id.to_owned(),
            kind: Some(pb::command::Kind::Redrive(pb::RedriveCommand {
                entry: Some(pb::DlqEntry {
                    id: "e1".to_owned(),
                    bridge_id: bridge.to_owned(),
                    route_id: "main".to_owned(),
                    binding_id: "to-out".to_owned(),
                    address: "out".to_owned(),
                    envelope: Some(pb::Envelope {
                        id: "m1".to_owned(),
                        source: Some(pb::Source {
                            received_at: Some(std::time::SystemTime::now().into()),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }),
                    reason: pb::DlqReason::PermanentError.into(),
                    dead_lettered_at: Some(std::time::SystemTime::now().into()),
                    ..Default::default()
                }),
            })),
        }
    }

    async fn result(rx: &mut mpsc::Receiver<pb::AgentMessage>) -> pb::CommandResult {
        let message = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await;
        match message {
            Ok(Some(pb::AgentMessage {
                message: Some(Up::CommandResult(result)),
            })) => result,
            other => panic!("expected a command result, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn unknown_bridges_and_kinds_and_a_full_agent_are_clear_errors() {
        let (_bridges, running) = watch::channel(BTreeMap::new());
        let commands = Commands::new(running);
        let (tx, mut rx) = mpsc::channel(4);

        commands.spawn(redrive("c1", "ghost"), tx.clone());
        let r = result(&mut rx).await;
        assert_eq!(r.command_id, "c1");
        assert!(!r.ok);
        assert_eq!(r.error, r#"bridge "ghost" is not running here"#);

        let unknown = pb::Command {
            command_id: "c2".to_owned(),
            kind: None,
        };
        commands.spawn(unknown, tx.clone());
        let r = result(&mut rx).await;
        assert!(!r.ok && r.error.contains("unknown command kind"), "{r:?}");

        // Every permit taken: one more is refused at once, not queued.
        let held = Arc::clone(&commands.permits).try_acquire_many_owned(MAX_COMMANDS as u32);
        assert!(held.is_ok());
        commands.spawn(redrive("c3", "ghost"), tx);
        let r = result(&mut rx).await;
        assert_eq!(r.command_id, "c3");
        assert!(!r.ok && r.error.starts_with("agent busy"), "{r:?}");
    }
}
