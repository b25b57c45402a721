//! `ferryctl token hash`: the token-file entry of a token, so that an
//! operator never writes a token's SHA-256 by hand and the token itself
//! never reaches the file.

use std::io::Read;

use ferry_shared::auth::Role;
use ferry_shared::auth::tokens::{hash_token, parse_role};

/// Reads one token from standard input and prints its entry.
pub fn hash(name: &str, role: &str, agent_id: Option<&str>) -> anyhow::Result<()> {
    let role = parse_role(role)
        .ok_or_else(|| anyhow::anyhow!("--role {role:?}: not admin, operator, viewer or agent"))?;
    match (role, agent_id) {
        (Role::Agent, None) => anyhow::bail!("--role agent needs --agent-id"),
        (r, Some(_)) if r != Role::Agent => anyhow::bail!("--agent-id goes with --role agent only"),
        _ => {}
    }
    let mut token = String::new();
    std::io::stdin().read_to_string(&mut token)?;
    let token = token.trim();
    anyhow::ensure!(!token.is_empty(), "no token on standard input");
    outln!("  - name: {name}")?;
    outln!("    role: {role}")?;
    if let Some(id) = agent_id {
        outln!("    agent_id: {id}")?;
    }
    outln!("    sha256: {}", hash_token(token))?;
    Ok(())
}
