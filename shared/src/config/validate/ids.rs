//! Identities: every id non-empty, well formed and unique within its kind; lookups by id for
//! the reference checks.

use std::collections::HashMap;

use super::super::model::BridgeConfig;
use super::super::route::Route;
use super::super::transport::{Binding, Receiver, Sender, Session};

/// The longest id accepted.
const MAX_ID_LEN: usize = 128;

/// First occurrence of every id, per kind.
pub(super) struct Index<'a> {
    pub sessions: HashMap<&'a str, &'a Session>,
    pub receivers: HashMap<&'a str, &'a Receiver>,
    pub senders: HashMap<&'a str, &'a Sender>,
    pub bindings: HashMap<&'a str, &'a Binding>,
}

impl<'a> Index<'a> {
    pub fn build(config: &'a BridgeConfig, error: &mut dyn FnMut(String, String)) -> Self {
        check_id("bridge.id", &config.bridge.id, error);
        let sessions = index("sessions", "session", &config.sessions, |s| &s.id, error);
        let receivers = index("receivers", "receiver", &config.receivers, |r| &r.id, error);
        let senders = index("senders", "sender", &config.senders, |s| &s.id, error);
        let bindings = index("bindings", "binding", &config.bindings, |b| &b.id, error);
        let _routes = index("routes", "route", &config.routes, |r: &Route| &r.id, error);
        Index {
            sessions,
            receivers,
            senders,
            bindings,
        }
    }
}

fn index<'a, T>(
    list: &str,
    kind: &str,
    items: &'a [T],
    id: impl Fn(&'a T) -> &'a String,
    error: &mut dyn FnMut(String, String),
) -> HashMap<&'a str, &'a T> {
    let mut first: HashMap<&'a str, (usize, &'a T)> = HashMap::new();
    for (i, item) in items.iter().enumerate() {
        let item_id = id(item);
        let path = format!("{list}[{i}].id");
        if !check_id(&path, item_id, error) {
            continue;
        }
        if let Some((j, _)) = first.get(item_id.as_str()) {
            error(
                path,
                format!("duplicate {kind} id \"{item_id}\" (also {list}[{j}])"),
            );
        } else {
            first.insert(item_id, (i, item));
        }
    }
    first.into_iter().map(|(k, (_, v))| (k, v)).collect()
}

/// Reports a malformed id; returns whether it is well formed.
fn check_id(path: &str, id: &str, error: &mut dyn FnMut(String, String)) -> bool {
    if id.is_empty() {
        error(path.to_owned(), "id must not be empty".to_owned());
        return false;
    }
    if id.len() > MAX_ID_LEN {
        error(
            path.to_owned(),
            format!(
                "id is {} bytes long, at most {MAX_ID_LEN} are allowed",
                id.len()
            ),
        );
        return false;
    }
    if !id
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    {
        error(
            path.to_owned(),
            format!(
                "id \"{id}\" may contain only ASCII letters, digits, '.', '_' and '-' (it becomes part of partition keys and metric labels)"
            ),
        );
        return false;
    }
    true
}
