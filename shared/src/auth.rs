//! Who is calling: the principal an authenticated gRPC request carries, and
//! the caller (principal and client address) that audit records name.
//!
//! The server's authentication layer puts a [`Principal`] into each request's
//! extensions once it has checked the credential (a bearer token or a client
//! certificate); services read it back with [`Caller::of`] for their
//! authorization and audit records. A request that reached a service without
//! passing that layer (a test calling a service directly) has no principal:
//! [`Caller::of`] then names it [`Principal::unauthenticated`], which no
//! authorization check grants anything beyond what the open mode grants.
//!
//! - [`tokens`]: the hashed token file and its reloading;
//! - [`certs`]: client certificates (`ferry://ROLE/NAME` SAN URIs) as principals;
//! - [`policy`]: the one table of which role may call which RPC;
//! - [`layer`]: the tower layer that authenticates and checks that table;
//! - [`flags`]: the security flags of every server;
//! - [`tls`], [`client`]: TLS for servers, and the credentials clients present.

pub mod certs;
pub mod client;
pub mod flags;
pub mod layer;
pub mod policy;
pub mod tls;
pub mod tokens;

use std::fmt;
use std::net::SocketAddr;

/// What a principal may do. Operators and agents never share a role: an
/// agent's credential reaches only its own stream, leases and DLQ writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Everything, including reading secrets.
    Admin,
    /// Configurations and the DLQ, read and write.
    Operator,
    /// Read only.
    Viewer,
    /// One agent: its own `Connect` stream, leases and DLQ writes for the
    /// bridges assigned to it.
    Agent,
}

impl Role {
    /// The role's name as token files and audit records spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Admin => "admin",
            Self::Operator => "operator",
            Self::Viewer => "viewer",
            Self::Agent => "agent",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An authenticated identity: a token's name or a certificate's subject.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The name audit records show (`alice`, `agent:edge-7`, `anonymous`).
    pub name: String,
    /// What it may do.
    pub role: Role,
    /// For [`Role::Agent`]: the one agent id it may act as.
    pub agent_id: Option<String>,
}

impl Principal {
    /// The principal of the explicit `--insecure` open mode: anyone who can
    /// reach the port, with every right, named so in audit records.
    pub fn insecure() -> Self {
        Self {
            name: "anonymous (insecure mode)".to_owned(),
            role: Role::Admin,
            agent_id: None,
        }
    }

    /// The principal of a request no authentication layer looked at.
    pub fn unauthenticated() -> Self {
        Self {
            name: "unauthenticated".to_owned(),
            role: Role::Viewer,
            agent_id: None,
        }
    }
}

impl fmt::Display for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name, self.role)
    }
}

/// Who made a request and from where, as audit records name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The authenticated principal.
    pub principal: Principal,
    /// The client's address, when the transport knows it.
    pub peer: Option<SocketAddr>,
}

impl Caller {
    /// The caller of `request`: the principal the authentication layer
    /// stored in its extensions (or [`Principal::unauthenticated`]) and the
    /// connection's remote address.
    pub fn of<T>(request: &tonic::Request<T>) -> Self {
        Self {
            principal: request
                .extensions()
                .get::<Principal>()
                .cloned()
                .unwrap_or_else(Principal::unauthenticated),
            peer: request.remote_addr(),
        }
    }

    /// The client address as audit records store it: empty when unknown.
    pub fn peer_text(&self) -> String {
        self.peer.map(|p| p.to_string()).unwrap_or_default()
    }
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.peer {
            Some(peer) => write!(f, "{} from {peer}", self.principal),
            None => write!(f, "{}", self.principal),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_without_a_principal_is_unauthenticated() {
        let caller = Caller::of(&tonic::Request::new(()));
        assert_eq!(caller.principal, Principal::unauthenticated());
        assert_eq!(caller.peer_text(), "");
        assert_eq!(caller.to_string(), "unauthenticated (viewer)");
    }

    #[test]
    fn the_layer_principal_is_read_back() {
        let mut request = tonic::Request::new(());
        let alice = Principal {
            name: "alice".to_owned(),
            role: Role::Operator,
            agent_id: None,
        };
        request.extensions_mut().insert(alice.clone());
        assert_eq!(Caller::of(&request).principal, alice);
    }
}
