//! The part of the authorization that depends on the request body: an agent
//! acts only for the bridges assigned to it, that is the configurations
//! whose selector matches the labels of its last `Connect` hello (the same
//! rule that decides what is pushed to it). Every other role passes here;
//! the role table of [`ferry_shared::auth::policy`] already let it through.
//!
//! The labels are the agent's own declaration: an agent credential bounds
//! what an agent may claim to be (its id), not which labels it declares.

use ferry_shared::auth::{Principal, Role};
use tonic::Status;

use super::Context;
use super::status::{selects, state_status};
use crate::state::StateError;

/// `PERMISSION_DENIED` when `principal` is an agent that `bridge_id` is not
/// assigned to.
pub async fn require_assigned(
    ctx: &Context,
    principal: &Principal,
    bridge_id: &str,
) -> Result<(), Status> {
    if principal.role != Role::Agent {
        return Ok(());
    }
    let agent_id = principal.agent_id.as_deref().unwrap_or_default();
    let denied = |why: &str| {
        Status::permission_denied(format!(
            "{principal} may act only for the bridges assigned to agent {agent_id:?}; bridge {bridge_id:?} {why}"
        ))
    };
    let agent = match ctx.store.get_agent(agent_id).await {
        Ok(agent) => agent,
        Err(StateError::NotFound { .. }) => {
            return Err(denied("cannot be: the agent never connected"));
        }
        Err(e) => return Err(state_status(e)),
    };
    let config = match ctx.store.get_config(bridge_id, None).await {
        Ok(config) => config,
        Err(StateError::NotFound { .. }) => return Err(denied("has no configuration")),
        Err(e) => return Err(state_status(e)),
    };
    if selects(&config.selector, &agent.labels) {
        Ok(())
    } else {
        Err(denied(
            "is not: its selector does not match the agent's labels",
        ))
    }
}

/// The bridge of a lease key `{bridge}/{partition}`.
pub fn lease_bridge(key: &str) -> &str {
    key.split_once('/').map_or(key, |(bridge, _)| bridge)
}
