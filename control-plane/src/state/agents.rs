//! Agent helpers shared by the backends.

use super::error::StateError;

/// The `NotFound` error for an agent.
pub(crate) fn agent_not_found(agent_id: &str) -> StateError {
    StateError::not_found(format!("agent {agent_id:?}"))
}
