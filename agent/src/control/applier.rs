//! The applier: the one task that owns the agent's [`Bridges`] and carries
//! out what the control plane pushes, one push or withdrawal at a time, in
//! the order they arrived. It outlives each stream: an answer whose stream
//! has ended is dropped (the next Hello reports what runs, and the control
//! plane reconciles from that).

use ferry_shared::api::v1 as pb;
use pb::agent_message::Message as Up;
use tokio::sync::mpsc;

use super::bridges::Bridges;

/// Work for the applier, with the stream its answer goes to.
#[derive(Debug)]
pub struct Work {
    /// What to do.
    pub kind: WorkKind,
    /// Where to answer.
    pub reply: mpsc::Sender<pb::AgentMessage>,
}

/// What the applier is asked to do.
#[derive(Debug)]
pub enum WorkKind {
    /// Run this version (answered with an ACK or a NACK).
    Push(pb::ConfigPush),
    /// Stop this bridge (answered with an ACK of version 0).
    Withdraw(pb::ConfigWithdraw),
}

/// Applies work until `work` closes, then stops every bridge.
pub async fn run(mut bridges: Bridges, mut work: mpsc::Receiver<Work>) {
    while let Some(Work { kind, reply }) = work.recv().await {
        let answer = match kind {
            WorkKind::Push(push) => apply(&mut bridges, push).await,
            WorkKind::Withdraw(withdraw) => {
                bridges.withdraw(&withdraw.bridge_id).await;
                Up::Ack(pb::ConfigAck {
                    bridge_id: withdraw.bridge_id,
                    version: 0,
                    nonce: withdraw.nonce,
                })
            }
        };
        let answer = pb::AgentMessage {
            message: Some(answer),
        };
        if reply.send(answer).await.is_err() {
            tracing::debug!("the stream ended before the answer; the next hello reports what runs");
        }
    }
    bridges.shutdown().await;
}

async fn apply(bridges: &mut Bridges, push: pb::ConfigPush) -> Up {
    let bridge = push.bridge_id;
    match bridges
        .apply_version(&bridge, push.version, &push.yaml)
        .await
    {
        Ok(()) => {
            tracing::info!(%bridge, version = push.version, "configuration applied");
            Up::Ack(pb::ConfigAck {
                bridge_id: bridge,
                version: push.version,
                nonce: push.nonce,
            })
        }
        Err(error) => {
            let running_version = bridges.version(&bridge).unwrap_or(0);
            let text = error.to_string();
            let line = text.lines().next().unwrap_or_default().to_owned();
            tracing::warn!(%bridge, version = push.version, running_version, error = %line, "configuration refused");
            Up::Nack(pb::ConfigNack {
                bridge_id: bridge,
                version: push.version,
                nonce: push.nonce,
                error: line,
                details: error.details(),
                running_version,
            })
        }
    }
}
