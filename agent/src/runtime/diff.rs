//! [`diff`]: what a new version of a bridge changes, as a pure function over
//! the running and the new [`ValidConfig`] (ADR 0005).
//!
//! Invariants the rules keep:
//!
//! - a route is *unchanged* only when everything it runs with is equal: the
//!   route itself, its receiver, its bindings, the senders of its bindings and
//!   of its session block, and every session it uses (receiver and senders);
//! - a session is *unchanged* only when its own block is equal and it carries
//!   the same receiver for the same route (an MQTT session subscribes at
//!   connect, and its settings depend on the route it feeds);
//! - restarting is contagious, to a fixed point: a changed route restarts the
//!   session that carries its receiver (a receiver is handed out once, when its
//!   session starts), and a changed session restarts every route that uses it;
//! - a change of `bridge` or `stores` restarts everything
//!   ([`Diff::restart_all`]): every route reads and writes its stores.
//!
//! `telemetry` is not part of the diff: it is read once, when the process
//! starts.

use std::collections::BTreeSet;

use ferry_shared::config::{Binding, Receiver, Route, Sender, Session, ValidConfig};

/// What happens to the items of one kind (routes or sessions), by id, sorted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Left running, untouched.
    pub unchanged: Vec<String>,
    /// Started.
    pub added: Vec<String>,
    /// Stopped.
    pub removed: Vec<String>,
    /// Stopped, then started with the new version.
    pub changed: Vec<String>,
}

impl Changes {
    /// Ids stopped by the change: removed or changed.
    pub fn stopping(&self) -> impl Iterator<Item = &String> {
        self.removed.iter().chain(&self.changed)
    }

    /// Ids started by the change: added or changed.
    pub fn starting(&self) -> impl Iterator<Item = &String> {
        self.added.iter().chain(&self.changed)
    }

    /// True when nothing starts or stops.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.changed.is_empty()
    }
}

/// The difference between the running version of a bridge and a new one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Diff {
    /// `bridge` or `stores` changed: everything stops, then the new version
    /// starts (every route and session shared by both is in `changed`).
    pub restart_all: bool,
    /// The sessions.
    pub sessions: Changes,
    /// The routes.
    pub routes: Changes,
}

impl Diff {
    /// True when the new version runs exactly like the old one.
    pub fn is_empty(&self) -> bool {
        !self.restart_all && self.sessions.is_empty() && self.routes.is_empty()
    }
}

/// What `session` carries in `c`: each receiver on it that feeds a route,
/// with that route.
pub(crate) fn feed<'a>(c: &'a ValidConfig, session: &str) -> Vec<(&'a Receiver, &'a Route)> {
    c.receivers
        .iter()
        .filter(|r| r.session_id == session)
        .filter_map(|r| {
            c.routes
                .iter()
                .find(|route| route.receiver_id == r.id)
                .map(|route| (r, route))
        })
        .collect()
}

/// Everything a route runs with, except its sessions (compared by id).
#[derive(PartialEq)]
struct RouteKey<'a> {
    route: &'a Route,
    receiver: Option<&'a Receiver>,
    bindings: Vec<&'a Binding>,
    senders: Vec<Option<&'a Sender>>,
}

fn route_key<'a>(c: &'a ValidConfig, route: &'a Route) -> RouteKey<'a> {
    let bindings: Vec<&Binding> = c.route_bindings(route).collect();
    let senders = bindings
        .iter()
        .map(|b| b.sender_id.as_str())
        .chain(route.session.as_ref().map(|s| s.sender_id.as_str()))
        .map(|id| c.sender(id))
        .collect();
    RouteKey {
        route,
        receiver: c.receiver(&route.receiver_id),
        bindings,
        senders,
    }
}

/// The sessions a route uses in `c`: its receiver's and its senders'.
fn route_sessions(c: &ValidConfig, route: &Route) -> BTreeSet<String> {
    let key = route_key(c, route);
    key.receiver
        .map(|r| r.session_id.clone())
        .into_iter()
        .chain(key.senders.iter().flatten().map(|s| s.session_id.clone()))
        .collect()
}

/// The session carrying `route`'s receiver in `c`.
fn receiver_session(c: &ValidConfig, route: &Route) -> Option<String> {
    c.receiver(&route.receiver_id).map(|r| r.session_id.clone())
}

/// Splits ids present in `old` and/or `new` into added, removed and the ids
/// present in both.
fn split(
    old: impl Iterator<Item = String>,
    new: impl Iterator<Item = String>,
) -> (Vec<String>, Vec<String>, BTreeSet<String>) {
    let old: BTreeSet<String> = old.collect();
    let new: BTreeSet<String> = new.collect();
    let added = new.difference(&old).cloned().collect();
    let removed = old.difference(&new).cloned().collect();
    let both = old.intersection(&new).cloned().collect();
    (added, removed, both)
}

/// What applying `new` to a bridge running `old` starts, stops and leaves
/// alone (see the module's invariants).
pub fn diff(old: &ValidConfig, new: &ValidConfig) -> Diff {
    let (s_added, s_removed, s_both) = split(
        old.sessions.iter().map(|s| s.id.clone()),
        new.sessions.iter().map(|s| s.id.clone()),
    );
    let (r_added, r_removed, r_both) = split(
        old.routes.iter().map(|r| r.id.clone()),
        new.routes.iter().map(|r| r.id.clone()),
    );
    let restart_all = old.bridge != new.bridge || old.stores != new.stores;

    let mut s_changed: BTreeSet<String> = BTreeSet::new();
    let mut r_changed: BTreeSet<String> = BTreeSet::new();
    if restart_all {
        s_changed.clone_from(&s_both);
        r_changed.clone_from(&r_both);
    } else {
        let session_of = |c: &ValidConfig, id: &str| -> Option<Session> { c.session(id).cloned() };
        for id in &s_both {
            if session_of(old, id) != session_of(new, id) || feed(old, id) != feed(new, id) {
                s_changed.insert(id.clone());
            }
        }
        for id in &r_both {
            let (Some(o), Some(n)) = (old.route(id), new.route(id)) else {
                continue;
            };
            if route_key(old, o) != route_key(new, n) {
                r_changed.insert(id.clone());
            }
        }
        // Contagion, to a fixed point (each pass only adds).
        loop {
            let before = (s_changed.len(), r_changed.len());
            for id in &r_both {
                let (Some(o), Some(n)) = (old.route(id), new.route(id)) else {
                    continue;
                };
                let uses_changed = route_sessions(old, o)
                    .union(&route_sessions(new, n))
                    .any(|s| s_changed.contains(s));
                if uses_changed {
                    r_changed.insert(id.clone());
                }
            }
            for id in &r_changed {
                let carriers = [old.route(id), new.route(id)];
                for (c, route) in [(old, carriers[0]), (new, carriers[1])] {
                    if let Some(s) = route.and_then(|r| receiver_session(c, r))
                        && s_both.contains(&s)
                    {
                        s_changed.insert(s);
                    }
                }
            }
            if (s_changed.len(), r_changed.len()) == before {
                break;
            }
        }
    }
    let changes = |added: Vec<String>,
                   removed: Vec<String>,
                   both: &BTreeSet<String>,
                   changed: &BTreeSet<String>| Changes {
        unchanged: both.difference(changed).cloned().collect(),
        added,
        removed,
        changed: changed.iter().cloned().collect(),
    };
    Diff {
        restart_all,
        sessions: changes(s_added, s_removed, &s_both, &s_changed),
        routes: changes(r_added, r_removed, &r_both, &r_changed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_shared::config::{ProcessEnv, check_bytes};

    /// Two independent routes, `a` (direct_hold) and `b` (shared_outbox,
    /// bindings `b1`), each on sessions of its own, plus `extra` lines.
    fn config(extra_bindings: &str, b_bindings: &str, extra: &str) -> ValidConfig {
        config_with_dlq(
            extra_bindings,
            b_bindings,
            extra,
            "{ type: memory, options: { acknowledge_volatile: true } }",
        )
    }

    fn config_with_dlq(
        extra_bindings: &str,
        b_bindings: &str,
        extra: &str,
        dlq: &str,
    ) -> ValidConfig {
        parse(&format!(
            r#"
bridge: {{ id: t }}
sessions:
  - {{ id: a-in, transport: mqtt, options: {{ session: {{ broker_url: "tcp://127.0.0.1:1883", client_id: a-in }} }} }}
  - {{ id: a-out, transport: mqtt, options: {{ session: {{ broker_url: "tcp://127.0.0.1:1884", client_id: a-out }} }} }}
  - {{ id: b-in, transport: mqtt, options: {{ session: {{ broker_url: "tcp://127.0.0.1:1883", client_id: b-in }} }} }}
  - {{ id: b-out, transport: mqtt, options: {{ session: {{ broker_url: "tcp://127.0.0.1:1884", client_id: b-out }} }} }}
  - {{ id: c-in, transport: mqtt, options: {{ session: {{ broker_url: "tcp://127.0.0.1:1883", client_id: c-in }} }} }}
stores:
  outbox: {{ type: memory, options: {{ acknowledge_volatile: true }} }}
  lease: {{ type: memory, options: {{}} }}
  dlq: {dlq}
receivers:
  - {{ id: a-rx, session_id: a-in, topics: [{{ topic: a/in, qos: 1 }}] }}
  - {{ id: b-rx, session_id: b-in, topics: [{{ topic: b/in, qos: 1 }}] }}
  - {{ id: c-rx, session_id: c-in, topics: [{{ topic: c/in, qos: 1 }}] }}
senders:
  - {{ id: a-tx, session_id: a-out, options: {{ sender: {{ qos: 1 }} }} }}
  - {{ id: b-tx, session_id: b-out, options: {{ sender: {{ qos: 1 }} }} }}
bindings:
  - {{ id: a1, sender_id: a-tx, address: a/out }}
  - {{ id: b1, sender_id: b-tx, address: b/out/1 }}
{extra_bindings}
routes:
  - {{ id: a, receiver_id: a-rx, delivery_mode: direct_hold, bindings: [a1] }}
  - id: b
    receiver_id: b-rx
    delivery_mode: shared_outbox
    dispatch_mode: fan_out
    bindings: [{b_bindings}]
    session: {{ session_id: b-out, sender_id: b-tx }}
{extra}
"#
        ))
    }

    fn parse(yaml: &str) -> ValidConfig {
        match check_bytes(yaml.as_bytes(), &ProcessEnv) {
            Ok(valid) => valid,
            Err(e) => panic!("test configuration: {e:?}\n{yaml}"),
        }
    }

    fn base() -> ValidConfig {
        config("", "b1", "")
    }

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    const ROUTE_C: &str =
        "  - { id: c, receiver_id: c-rx, delivery_mode: direct_hold, bindings: [a1] }";

    #[test]
    fn the_same_version_changes_nothing() {
        let d = diff(&base(), &base());
        assert!(d.is_empty(), "{d:?}");
        assert_eq!(d.routes.unchanged, ids(&["a", "b"]));
        assert_eq!(
            d.sessions.unchanged,
            ids(&["a-in", "a-out", "b-in", "b-out", "c-in"])
        );
    }

    #[test]
    fn an_added_route_starts_and_restarts_its_receivers_session_only() {
        let d = diff(&base(), &config("", "b1", ROUTE_C));
        assert_eq!(d.routes.added, ids(&["c"]));
        assert_eq!(d.routes.unchanged, ids(&["a", "b"]));
        assert!(d.routes.changed.is_empty());
        // c-in carried no receiver before: it reconnects to subscribe.
        assert_eq!(d.sessions.changed, ids(&["c-in"]));
        assert!(!d.restart_all);
    }

    #[test]
    fn a_removed_route_stops_and_leaves_the_others_alone() {
        let d = diff(&config("", "b1", ROUTE_C), &base());
        assert_eq!(d.routes.removed, ids(&["c"]));
        assert_eq!(d.routes.unchanged, ids(&["a", "b"]));
        assert_eq!(d.sessions.changed, ids(&["c-in"]));
        assert_eq!(
            d.sessions.unchanged,
            ids(&["a-in", "a-out", "b-in", "b-out"])
        );
    }

    #[test]
    fn a_binding_added_to_a_route_changes_that_route_and_its_receiver_session() {
        let extra = "  - { id: b2, sender_id: b-tx, address: b/out/2 }";
        let d = diff(&base(), &config(extra, "b1, b2", ""));
        assert_eq!(d.routes.changed, ids(&["b"]));
        assert_eq!(d.routes.unchanged, ids(&["a"]));
        // The receiver is handed out once per session start; the sender's
        // session is only used by b, whose route restarts, not the session.
        assert_eq!(d.sessions.changed, ids(&["b-in"]));
        assert_eq!(
            d.sessions.unchanged,
            ids(&["a-in", "a-out", "b-out", "c-in"])
        );
    }

    #[test]
    fn a_changed_binding_address_changes_its_route() {
        let mut new = base().into_inner();
        new.bindings[1].address = "b/elsewhere".into();
        let new = ferry_shared::config::validate(&new).expect("valid");
        let d = diff(&base(), &new);
        assert_eq!(d.routes.changed, ids(&["b"]));
        assert_eq!(d.routes.unchanged, ids(&["a"]));
    }

    #[test]
    fn a_changed_session_restarts_every_route_that_uses_it() {
        let mut new = base().into_inner();
        // a-out sends for a; b's drainer moves onto it too.
        new.senders[1].session_id = "a-out".into();
        if let Some(block) = new.routes[1].session.as_mut() {
            block.session_id = "a-out".into();
        }
        let new = ferry_shared::config::validate(&new).expect("valid");
        let d = diff(&base(), &new);
        assert_eq!(d.routes.changed, ids(&["b"]));
        assert_eq!(d.routes.unchanged, ids(&["a"]));

        let mut new = base().into_inner();
        new.sessions[1].options.session.keep_alive = Some(60);
        let new = ferry_shared::config::validate(&new).expect("valid");
        let d = diff(&base(), &new);
        assert_eq!(d.sessions.changed, ids(&["a-in", "a-out"]));
        assert_eq!(d.routes.changed, ids(&["a"]));
        assert_eq!(d.routes.unchanged, ids(&["b"]));
    }

    #[test]
    fn a_changed_store_restarts_everything() {
        // Only compared, never opened.
        let new = config_with_dlq(
            "",
            "b1",
            "",
            "{ type: sqlite, options: { path: /nonexistent/dlq.db } }",
        );
        let d = diff(&base(), &new);
        assert!(d.restart_all);
        assert_eq!(d.routes.changed, ids(&["a", "b"]));
        assert!(d.routes.unchanged.is_empty() && d.sessions.unchanged.is_empty());
    }
}
