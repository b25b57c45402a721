//! Bearer tokens: the token file, its hashed entries and its reloading.
//!
//! The file (`--tokens FILE`) is YAML and holds no token itself, only each
//! token's SHA-256 (lowercase hex) with the principal it stands for:
//!
//! ```yaml
//! tokens:
//!   - name: alice
//!     role: operator
//!     sha256: 2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae
//!   - name: edge-01
//!     role: agent
//!     agent_id: edge-01
//!     sha256: fcde2b2edba56bf408601fb721fe9b5c338d10ee429ea04fae5511b68fbf8fb9
//! ```
//!
//! Invariants:
//! - a [`TokenFile`] is only ever built from a file that parsed and passed
//!   every check (names and hashes unique, an `agent_id` exactly for the
//!   `agent` role), so a lookup never meets a half-valid set;
//! - [`Tokens`] swaps the whole set at once: a request sees the old set or
//!   the new one, never a mix; a file that fails on reload leaves the old set
//!   in place (and the reason is logged once per change of the file).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde::Deserialize;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use super::{Principal, Role};

/// How often the token file is read again for changes.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(1);

/// Why a token file was refused.
#[derive(Debug, thiserror::Error)]
pub enum TokenFileError {
    /// It could not be read.
    #[error("cannot read token file {path}: {error}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        error: std::io::Error,
    },
    /// It is not the expected YAML.
    #[error("token file {path}: {error}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        error: String,
    },
    /// It parsed but breaks rules; every problem, `tokens[i].field: message`.
    #[error("token file {path}: {}", problems.join("; "))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Every problem found.
        problems: Vec<String>,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileDoc {
    /// The entries; an empty list is allowed (nobody may call).
    tokens: Vec<Entry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    /// The principal's name, as audit records show it.
    name: String,
    /// `admin`, `operator`, `viewer` or `agent`.
    role: String,
    /// For the `agent` role: the agent id the token may act as.
    #[serde(default)]
    agent_id: Option<String>,
    /// SHA-256 of the token, 64 lowercase hex digits.
    sha256: String,
}

/// A role by the name token files use.
pub fn parse_role(name: &str) -> Option<Role> {
    [Role::Admin, Role::Operator, Role::Viewer, Role::Agent]
        .into_iter()
        .find(|r| r.as_str() == name)
}

/// The SHA-256 of `token` in lowercase hex: what a token file stores.
pub fn hash_token(token: &str) -> String {
    Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// One checked token file: principals by token hash.
#[derive(Debug, Default, Clone)]
pub struct TokenFile {
    by_hash: HashMap<String, Principal>,
}

impl TokenFile {
    /// Reads and checks `path`.
    pub fn load(path: &Path) -> Result<Self, TokenFileError> {
        let text = std::fs::read_to_string(path).map_err(|error| TokenFileError::Read {
            path: path.to_owned(),
            error,
        })?;
        Self::parse(path, &text)
    }

    /// Parses and checks `text` (the contents of `path`, named in errors).
    pub fn parse(path: &Path, text: &str) -> Result<Self, TokenFileError> {
        let doc: FileDoc = serde_saphyr::from_str(text).map_err(|e| TokenFileError::Parse {
            path: path.to_owned(),
            error: e.to_string(),
        })?;
        let mut problems = Vec::new();
        let mut by_hash = HashMap::new();
        let mut names = HashMap::new();
        for (i, entry) in doc.tokens.into_iter().enumerate() {
            let at = |field: &str, message: &str| format!("tokens[{i}].{field}: {message}");
            if entry.name.trim().is_empty() {
                problems.push(at("name", "must not be empty"));
            } else if let Some(first) = names.insert(entry.name.clone(), i) {
                problems.push(at(
                    "name",
                    &format!("{:?} is also tokens[{first}]", entry.name),
                ));
            }
            let role = parse_role(&entry.role);
            if role.is_none() {
                problems.push(at(
                    "role",
                    &format!("{:?} is not admin, operator, viewer or agent", entry.role),
                ));
            }
            match (role, &entry.agent_id) {
                (Some(Role::Agent), None) => problems.push(at(
                    "agent_id",
                    "the agent role needs the agent id it acts as",
                )),
                (Some(Role::Agent), Some(id)) if id.trim().is_empty() => {
                    problems.push(at("agent_id", "must not be empty"))
                }
                (Some(r), Some(_)) if r != Role::Agent => {
                    problems.push(at("agent_id", "only the agent role names an agent id"))
                }
                _ => {}
            }
            let hash = entry.sha256.to_ascii_lowercase();
            if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
                problems.push(at(
                    "sha256",
                    "must be 64 hex digits (the SHA-256 of the token; `ferryctl token hash`)",
                ));
                continue;
            }
            let Some(role) = role else { continue };
            let principal = Principal {
                name: entry.name,
                role,
                agent_id: entry.agent_id,
            };
            if by_hash.insert(hash, principal).is_some() {
                problems.push(at("sha256", "the same token is listed twice"));
            }
        }
        if !problems.is_empty() {
            return Err(TokenFileError::Invalid {
                path: path.to_owned(),
                problems,
            });
        }
        Ok(Self { by_hash })
    }

    /// The principal `token` stands for.
    pub fn principal(&self, token: &str) -> Option<&Principal> {
        self.by_hash.get(&hash_token(token))
    }

    /// How many tokens the file lists.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    /// Whether it lists none.
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }
}

/// The token set in force, reloaded from its file on change.
#[derive(Debug, Clone)]
pub struct Tokens {
    current: Arc<RwLock<Arc<TokenFile>>>,
}

impl Tokens {
    /// A fixed set (tests, and the start of [`Tokens::watch`]).
    pub fn fixed(file: TokenFile) -> Self {
        Self {
            current: Arc::new(RwLock::new(Arc::new(file))),
        }
    }

    /// Loads `path` (an error if it does not load: a server never starts
    /// with a broken token file) and re-reads it every [`RELOAD_INTERVAL`]
    /// until `stop` is cancelled: a changed file that checks replaces the
    /// set; one that does not is logged and the old set stays.
    pub fn watch(path: &Path, stop: CancellationToken) -> Result<Self, TokenFileError> {
        let text = read(path)?;
        let tokens = Self::fixed(TokenFile::parse(path, &text)?);
        tracing::info!(file = %path.display(), tokens = tokens.snapshot().len(), "token file loaded");
        let watched = tokens.clone();
        let path = path.to_owned();
        tokio::spawn(async move {
            let mut last = text;
            let mut ticker = tokio::time::interval(RELOAD_INTERVAL);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    _ = ticker.tick() => {}
                }
                watched.reload(&path, &mut last);
            }
        });
        Ok(tokens)
    }

    /// Reads `path` again; `last` is the text last seen (a change is
    /// logged once, not on every tick).
    fn reload(&self, path: &Path, last: &mut String) {
        let text = match read(path) {
            Ok(text) => text,
            Err(error) => {
                if !last.is_empty() {
                    tracing::error!(%error, "token file unreadable; the tokens loaded before stay in force");
                    last.clear();
                }
                return;
            }
        };
        if text == *last {
            return;
        }
        match TokenFile::parse(path, &text) {
            Ok(file) => {
                tracing::info!(file = %path.display(), tokens = file.len(), "token file reloaded");
                *self.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(file);
            }
            Err(error) => {
                tracing::error!(%error, "token file refused; the tokens loaded before stay in force")
            }
        }
        *last = text;
    }

    /// The set in force now.
    pub fn snapshot(&self) -> Arc<TokenFile> {
        Arc::clone(&self.current.read().unwrap_or_else(|e| e.into_inner()))
    }
}

fn read(path: &Path) -> Result<String, TokenFileError> {
    std::fs::read_to_string(path).map_err(|error| TokenFileError::Read {
        path: path.to_owned(),
        error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, role: &str, agent: Option<&str>, token: &str) -> String {
        let agent = agent
            .map(|a| format!("    agent_id: {a}\n"))
            .unwrap_or_default();
        format!(
            "  - name: {name}\n    role: {role}\n{agent}    sha256: {}\n",
            hash_token(token)
        )
    }

    #[test]
    fn a_token_names_its_principal() {
        let text = format!(
            "tokens:\n{}{}",
            entry("alice", "operator", None, "s3cret"),
            entry("edge", "agent", Some("edge-01"), "agent-token")
        );
        let file = TokenFile::parse(Path::new("t.yaml"), &text).expect("valid");
        let alice = file.principal("s3cret").expect("alice");
        assert_eq!((alice.name.as_str(), alice.role), ("alice", Role::Operator));
        let edge = file.principal("agent-token").expect("edge");
        assert_eq!(edge.agent_id.as_deref(), Some("edge-01"));
        assert!(file.principal("other").is_none());
    }

    #[test]
    fn every_problem_is_reported() {
        let text = format!(
            "tokens:\n{}{}{}  - name: x\n    role: root\n    sha256: abc\n",
            entry("a", "agent", None, "1"),
            entry("b", "viewer", Some("e"), "2"),
            entry("b", "viewer", None, "2"),
        );
        let error = TokenFile::parse(Path::new("t.yaml"), &text)
            .expect_err("invalid")
            .to_string();
        for needle in [
            "tokens[0].agent_id: the agent role needs",
            "tokens[1].agent_id: only the agent role",
            "tokens[2].name: \"b\" is also tokens[1]",
            "tokens[2].sha256: the same token is listed twice",
            "tokens[3].role: \"root\" is not",
            "tokens[3].sha256: must be 64 hex digits",
        ] {
            assert!(error.contains(needle), "{needle} in {error}");
        }
    }

    #[test]
    fn a_bad_reload_keeps_the_old_set() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tokens.yaml");
        let first = format!("tokens:\n{}", entry("alice", "admin", None, "one"));
        std::fs::write(&path, &first).expect("write");
        let tokens = Tokens::fixed(TokenFile::load(&path).expect("load"));
        let mut last = first;
        std::fs::write(&path, "tokens: [").expect("write");
        tokens.reload(&path, &mut last);
        assert!(tokens.snapshot().principal("one").is_some());
        std::fs::write(
            &path,
            format!("tokens:\n{}", entry("bob", "viewer", None, "two")),
        )
        .expect("write");
        tokens.reload(&path, &mut last);
        assert!(tokens.snapshot().principal("one").is_none());
        assert!(tokens.snapshot().principal("two").is_some());
    }
}
