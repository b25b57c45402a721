//! Who may call what: one table from each RPC's full gRPC path to the roles
//! allowed to call it. A method without an entry is refused to everyone
//! (deny by default), so a new RPC cannot be reached before somebody decides
//! who may call it. The standard health and reflection services stay open:
//! they reveal nothing a client could not learn from the public protos.
//!
//! Rules that depend on the request body (an agent's own stream, leases and
//! DLQ writes only for the bridges assigned to it) are checked by the
//! service that reads the body, after this table let the call through.

use tonic::Status;

use super::{Principal, Role};

const ADMIN: Role = Role::Admin;
const OPERATOR: Role = Role::Operator;
const VIEWER: Role = Role::Viewer;
const AGENT: Role = Role::Agent;

/// Operators and readers: every read-only method.
const READERS: &[Role] = &[ADMIN, OPERATOR, VIEWER];
/// Configuration and DLQ changes.
const OPERATORS: &[Role] = &[ADMIN, OPERATOR];
/// What an agent does for itself.
const AGENTS: &[Role] = &[ADMIN, AGENT];

/// Every `ferry.v1` method and the roles allowed to call it.
pub const TABLE: &[(&str, &[Role])] = &[
    ("/ferry.v1.ConfigService/ApplyConfig", OPERATORS),
    ("/ferry.v1.ConfigService/GetConfig", READERS),
    ("/ferry.v1.ConfigService/ListConfigs", READERS),
    ("/ferry.v1.ConfigService/DeleteConfig", OPERATORS),
    ("/ferry.v1.ConfigService/GetRoute", READERS),
    ("/ferry.v1.ConfigService/PutRoute", OPERATORS),
    ("/ferry.v1.ConfigService/DeleteRoute", OPERATORS),
    ("/ferry.v1.ConfigService/ListConfigVersions", READERS),
    ("/ferry.v1.ConfigService/RollbackConfig", OPERATORS),
    ("/ferry.v1.AgentService/Connect", AGENTS),
    ("/ferry.v1.AgentService/ListAgents", READERS),
    ("/ferry.v1.AgentService/GetAgent", READERS),
    ("/ferry.v1.LeaseService/AcquireLease", AGENTS),
    ("/ferry.v1.LeaseService/RenewLease", AGENTS),
    ("/ferry.v1.LeaseService/ReleaseLease", AGENTS),
    ("/ferry.v1.LeaseService/ListLeases", READERS),
    ("/ferry.v1.DlqService/WriteDlqEntry", AGENTS),
    ("/ferry.v1.DlqService/ListDlqEntries", READERS),
    ("/ferry.v1.DlqService/GetDlqEntry", READERS),
    ("/ferry.v1.DlqService/RedriveDlqEntries", OPERATORS),
    ("/ferry.v1.DlqService/DeleteDlqEntry", OPERATORS),
    ("/ferry.v1.DlqService/PurgeDlqEntries", OPERATORS),
    ("/ferry.v1.DlqService/GetDlqStats", READERS),
    ("/ferry.v1.MetricsService/GetAgentMetrics", READERS),
    ("/ferry.v1.MetricsService/ListMetrics", READERS),
    ("/ferry.v1.MetricsService/GetTotals", READERS),
];

/// Services every client may call without a credential.
pub const OPEN_SERVICES: &[&str] = &[
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
];

/// Whether `path` (`/package.Service/Method`) belongs to an open service.
pub fn is_open(path: &str) -> bool {
    let service = path
        .strip_prefix('/')
        .and_then(|p| p.split_once('/'))
        .map(|(service, _)| service);
    service.is_some_and(|s| OPEN_SERVICES.contains(&s))
}

/// The roles allowed to call `path`; `None` when the table has no entry.
pub fn roles(path: &str) -> Option<&'static [Role]> {
    TABLE.iter().find(|(p, _)| *p == path).map(|(_, r)| *r)
}

/// `PERMISSION_DENIED` naming the principal, the method and who may call it,
/// unless `principal`'s role is allowed to call `path`.
pub fn authorize(path: &str, principal: &Principal) -> Result<(), Status> {
    let Some(allowed) = roles(path) else {
        return Err(Status::permission_denied(format!(
            "{path} has no entry in the authorization table; refused to everyone by default"
        )));
    };
    if allowed.contains(&principal.role) {
        return Ok(());
    }
    let names: Vec<&str> = allowed.iter().map(|r| r.as_str()).collect();
    Err(Status::permission_denied(format!(
        "{principal} may not call {path} (allowed: {})",
        names.join(", ")
    )))
}

/// For an agent principal, `PERMISSION_DENIED` unless `agent_id` is its own;
/// any other role passes.
pub fn require_own_agent(principal: &Principal, agent_id: &str, what: &str) -> Result<(), Status> {
    if principal.role != Role::Agent || principal.agent_id.as_deref() == Some(agent_id) {
        return Ok(());
    }
    Err(Status::permission_denied(format!(
        "{principal} acts only as agent {:?}; {what} names agent {agent_id:?}",
        principal.agent_id.as_deref().unwrap_or_default()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn principal(role: Role) -> Principal {
        Principal {
            name: "p".into(),
            role,
            agent_id: (role == Role::Agent).then(|| "edge-01".to_owned()),
        }
    }

    #[test]
    fn unknown_methods_are_refused_to_everyone() {
        let e = authorize("/ferry.v1.ConfigService/DropEverything", &principal(ADMIN))
            .expect_err("deny by default");
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.message().contains("no entry"), "{}", e.message());
    }

    #[test]
    fn a_refusal_names_who_may() {
        let e = authorize("/ferry.v1.DlqService/PurgeDlqEntries", &principal(VIEWER))
            .expect_err("viewer");
        assert!(
            e.message().contains("allowed: admin, operator"),
            "{}",
            e.message()
        );
        assert!(authorize("/ferry.v1.DlqService/PurgeDlqEntries", &principal(OPERATOR)).is_ok());
    }

    #[test]
    fn only_health_and_reflection_are_open() {
        assert!(is_open("/grpc.health.v1.Health/Check"));
        assert!(is_open(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
        ));
        assert!(!is_open("/ferry.v1.ConfigService/GetConfig"));
        assert!(!is_open("/grpc.health.v1.Healthz/Check"));
    }

    #[test]
    fn an_agent_is_only_itself() {
        let agent = principal(AGENT);
        assert!(require_own_agent(&agent, "edge-01", "hello.agent_id").is_ok());
        let e = require_own_agent(&agent, "edge-02", "hello.agent_id").expect_err("other");
        assert!(e.message().contains("edge-02"), "{}", e.message());
        assert!(require_own_agent(&principal(ADMIN), "edge-02", "x").is_ok());
    }
}
