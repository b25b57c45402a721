//! Client certificates as principals. Under mTLS (`--client-ca`) the TLS
//! handshake already proved the certificate chains to the configured CA;
//! what it says about its holder is one URI in its subject alternative
//! names:
//!
//! `ferry://ROLE/NAME` — `ferry://agent/edge-01` is the agent `edge-01`,
//! `ferry://operator/alice` the operator `alice`. The URI, not the CN, is
//! read: the CN has no defined syntax and CAs treat it as display text,
//! while a SAN URI is typed and exact. A certificate with no such URI, or
//! with two, names nobody and is refused.

use rustls::pki_types::CertificateDer;

use super::tokens::parse_role;
use super::{Principal, Role};

/// The scheme of the SAN URI that names a Ferry principal.
pub const SCHEME: &str = "ferry://";

/// The principal `cert` names, or why it names none.
pub fn principal(cert: &CertificateDer<'_>) -> Result<Principal, String> {
    let parsed = webpki::EndEntityCert::try_from(cert)
        .map_err(|e| format!("the client certificate does not parse: {e}"))?;
    let uris: Vec<&str> = parsed
        .valid_uri_names()
        .filter(|u| u.starts_with(SCHEME))
        .collect();
    let [uri] = uris.as_slice() else {
        return Err(format!(
            "the client certificate must name exactly one {SCHEME}ROLE/NAME URI in its subject alternative names (it names {})",
            uris.len()
        ));
    };
    from_uri(uri)
}

/// `ferry://ROLE/NAME` as a principal.
pub fn from_uri(uri: &str) -> Result<Principal, String> {
    let rest = uri.strip_prefix(SCHEME).unwrap_or(uri);
    let (role, name) = rest
        .split_once('/')
        .ok_or_else(|| format!("{uri:?} is not {SCHEME}ROLE/NAME"))?;
    let role = parse_role(role)
        .ok_or_else(|| format!("{uri:?}: {role:?} is not admin, operator, viewer or agent"))?;
    if name.is_empty() || name.contains('/') {
        return Err(format!(
            "{uri:?}: the name must be one non-empty path segment"
        ));
    }
    Ok(Principal {
        name: name.to_owned(),
        role,
        agent_id: (role == Role::Agent).then(|| name.to_owned()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_name_principals() {
        let agent = from_uri("ferry://agent/edge-01").expect("agent");
        assert_eq!(agent.role, Role::Agent);
        assert_eq!(agent.agent_id.as_deref(), Some("edge-01"));
        let alice = from_uri("ferry://operator/alice").expect("operator");
        assert_eq!((alice.role, alice.agent_id), (Role::Operator, None));
        for bad in [
            "ferry://root/x",
            "ferry://agent/",
            "ferry://agent",
            "ferry://agent/a/b",
        ] {
            assert!(from_uri(bad).is_err(), "{bad}");
        }
    }
}
