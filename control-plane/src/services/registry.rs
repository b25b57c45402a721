//! The agents connected to this control-plane replica: who runs which
//! configuration version, and the channel that carries commands down each
//! stream. Commands wait here for their results.
//!
//! Locks are plain mutexes held only for map operations, never across an
//! `.await`.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use ferry_shared::api::v1 as pb;
use tokio::sync::{mpsc, oneshot};

/// The connected agents.
#[derive(Debug, Default)]
pub struct Registry {
    agents: Mutex<HashMap<String, Connected>>,
    pending: Mutex<HashMap<String, oneshot::Sender<pb::CommandResult>>>,
    next_session: Mutex<u64>,
}

#[derive(Debug)]
struct Connected {
    session: u64,
    commands: mpsc::Sender<pb::Command>,
    running: BTreeMap<String, u64>,
}

/// An agent running a bridge, as a redrive target.
#[derive(Debug, Clone)]
pub struct Runner {
    /// The agent.
    pub agent_id: String,
    /// The configuration version it runs.
    pub version: u64,
    commands: mpsc::Sender<pb::Command>,
}

/// Holds an agent's place in the registry; dropping it removes the agent.
#[derive(Debug)]
pub struct Registration {
    registry: Arc<Registry>,
    agent_id: String,
    session: u64,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves the maps consistent
    // (every operation is a single insert or remove).
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Registry {
    /// Registers a connected agent; `None` when one with this id is already
    /// connected.
    pub fn register(
        self: &Arc<Self>,
        agent_id: &str,
        commands: mpsc::Sender<pb::Command>,
    ) -> Option<Registration> {
        let session = {
            let mut next = lock(&self.next_session);
            *next += 1;
            *next
        };
        let mut agents = lock(&self.agents);
        if agents.contains_key(agent_id) {
            return None;
        }
        agents.insert(
            agent_id.to_owned(),
            Connected {
                session,
                commands,
                running: BTreeMap::new(),
            },
        );
        Some(Registration {
            registry: Arc::clone(self),
            agent_id: agent_id.to_owned(),
            session,
        })
    }

    /// How many agents are connected to this replica.
    pub fn connected(&self) -> usize {
        lock(&self.agents).len()
    }

    /// Agents that run `bridge_id` (at any version), ordered by id.
    pub fn runners(&self, bridge_id: &str) -> Vec<Runner> {
        let agents = lock(&self.agents);
        let mut runners: Vec<Runner> = agents
            .iter()
            .filter_map(|(agent_id, connected)| {
                connected.running.get(bridge_id).map(|&version| Runner {
                    agent_id: agent_id.clone(),
                    version,
                    commands: connected.commands.clone(),
                })
            })
            .collect();
        runners.sort_by(|a, b| a.agent_id.cmp(&b.agent_id));
        runners
    }

    /// Sends `command` to `runner` and waits up to `timeout` for its result.
    pub async fn execute(
        &self,
        runner: &Runner,
        command: pb::Command,
        timeout: Duration,
    ) -> Result<pb::CommandResult, String> {
        let id = command.command_id.clone();
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(id.clone(), tx);
        let outcome = async {
            runner
                .commands
                .send_timeout(command, timeout)
                .await
                .map_err(|_| format!("agent {} is not accepting commands", runner.agent_id))?;
            match tokio::time::timeout(timeout, rx).await {
                Ok(Ok(result)) => Ok(result),
                Ok(Err(_)) => Err(format!(
                    "agent {} disconnected before answering",
                    runner.agent_id
                )),
                Err(_) => Err(format!(
                    "agent {} did not answer within {timeout:?}",
                    runner.agent_id
                )),
            }
        }
        .await;
        lock(&self.pending).remove(&id);
        outcome
    }

    /// Hands a command result to the call waiting for it; false when none
    /// waits (unknown id, or it timed out).
    pub fn complete(&self, result: pb::CommandResult) -> bool {
        let waiter = lock(&self.pending).remove(&result.command_id);
        waiter.is_some_and(|tx| tx.send(result).is_ok())
    }
}

impl Registration {
    /// Records that the agent runs `version` of `bridge_id` (`None`: no
    /// longer runs it).
    pub fn set_running(&self, bridge_id: &str, version: Option<u64>) {
        let mut agents = lock(&self.registry.agents);
        if let Some(connected) = agents
            .get_mut(&self.agent_id)
            .filter(|c| c.session == self.session)
        {
            match version {
                Some(version) => {
                    connected.running.insert(bridge_id.to_owned(), version);
                }
                None => {
                    connected.running.remove(bridge_id);
                }
            }
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut agents = lock(&self.registry.agents);
        if agents
            .get(&self.agent_id)
            .is_some_and(|c| c.session == self.session)
        {
            agents.remove(&self.agent_id);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_registration_per_agent_and_commands_round_trip() {
        let registry = Arc::new(Registry::default());
        let (tx, mut rx) = mpsc::channel(4);
        let registration = registry.register("a1", tx.clone()).unwrap();
        assert!(registry.register("a1", tx).is_none());
        registration.set_running("b", Some(3));
        let runners = registry.runners("b");
        assert_eq!((runners.len(), runners[0].version), (1, 3));

        let answer = {
            let registry = Arc::clone(&registry);
            tokio::spawn(async move {
                let command = rx.recv().await.unwrap();
                registry.complete(pb::CommandResult {
                    command_id: command.command_id,
                    ok: true,
                    error: String::new(),
                })
            })
        };
        let command = pb::Command {
            command_id: "c1".into(),
            kind: None,
        };
        let result = registry
            .execute(&runners[0], command, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(result.ok);
        assert!(answer.await.unwrap());

        drop(registration);
        assert_eq!(registry.connected(), 0);
        assert!(registry.runners("b").is_empty());
    }
}
