//! Routes: references, delivery and dispatch modes, acknowledgement, stores the mode needs,
//! the policy's limits and the session (drain) block.

use std::collections::HashMap;

use super::super::route::{
    AckAfter, DeliveryMode, DispatchMode, FailureAction, Policy, Route, RouteSession,
};
use super::Validator;

impl Validator<'_> {
    pub(super) fn routes(&mut self) {
        if self.config.routes.is_empty() {
            self.error("routes", "a bridge needs at least one route");
        }
        let mut receiver_users: HashMap<&str, usize> = HashMap::new();
        for (i, route) in self.config.routes.iter().enumerate() {
            let base = format!("routes[{i}]");
            if self
                .index
                .receivers
                .contains_key(route.receiver_id.as_str())
            {
                if let Some(first) = receiver_users.get(route.receiver_id.as_str()) {
                    self.error(
                        format!("{base}.receiver_id"),
                        format!(
                            "receiver \"{}\" already feeds routes[{first}]; a delivery can be settled only once, so each receiver belongs to one route",
                            route.receiver_id
                        ),
                    );
                } else {
                    receiver_users.insert(&route.receiver_id, i);
                }
            } else {
                self.error(
                    format!("{base}.receiver_id"),
                    format!("unknown receiver \"{}\"", route.receiver_id),
                );
            }
            self.route_bindings(&base, route);
            self.modes(&base, route);
            self.policy(&format!("{base}.policy"), &route.policy);
            match (&route.session, route.delivery_mode) {
                (Some(session), DeliveryMode::SharedOutbox) => {
                    self.route_session(&base, route, session);
                }
                (None, DeliveryMode::SharedOutbox) => self.error(
                    format!("{base}.session"),
                    "shared_outbox needs a session block (session_id and sender_id of its drainer)",
                ),
                (Some(_), DeliveryMode::DirectHold) => self.error(
                    format!("{base}.session"),
                    "only shared_outbox routes have a drainer; remove the session block from this direct_hold route",
                ),
                (None, DeliveryMode::DirectHold) => {}
            }
        }
    }

    fn route_bindings(&mut self, base: &str, route: &Route) {
        if route.bindings.is_empty() {
            self.error(
                format!("{base}.bindings"),
                "a route needs at least one binding",
            );
        }
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (j, id) in route.bindings.iter().enumerate() {
            let path = format!("{base}.bindings[{j}]");
            if !self.index.bindings.contains_key(id.as_str()) {
                self.error(path, format!("unknown binding \"{id}\""));
            } else if let Some(first) = seen.get(id.as_str()) {
                self.error(
                    path,
                    format!("binding \"{id}\" is listed twice (also bindings[{first}])"),
                );
            } else {
                seen.insert(id, j);
            }
        }
    }

    fn modes(&mut self, base: &str, route: &Route) {
        let n = route.bindings.len();
        let direct_hold = route.delivery_mode == DeliveryMode::DirectHold;
        if direct_hold && route.dispatch_mode == DispatchMode::FanOut {
            self.error(
                format!("{base}.dispatch_mode"),
                "fan_out needs delivery_mode shared_outbox (direct_hold delivers to one binding; the outbox keeps per-destination progress)",
            );
        }
        if direct_hold && n != 1 {
            self.error(
                format!("{base}.bindings"),
                format!("direct_hold needs exactly one binding, found {n}"),
            );
        } else if route.dispatch_mode == DispatchMode::Single && n != 1 {
            self.error(
                format!("{base}.bindings"),
                format!(
                    "single dispatch needs exactly one binding, found {n} (use dispatch_mode: fan_out)"
                ),
            );
        }
        match (route.delivery_mode, route.policy.ack_after) {
            (DeliveryMode::SharedOutbox, Some(AckAfter::TargetAccept)) => self.error(
                format!("{base}.policy.ack_after"),
                "target_accept is not possible on shared_outbox: the drainer sends after the source is settled; use outbox_persist, or direct_hold to hold the source until the target accepts",
            ),
            (DeliveryMode::DirectHold, Some(AckAfter::OutboxPersist)) => self.error(
                format!("{base}.policy.ack_after"),
                "outbox_persist needs delivery_mode shared_outbox; direct_hold has no outbox and settles the source after the target accepts (target_accept)",
            ),
            _ => {}
        }
        if route.delivery_mode == DeliveryMode::SharedOutbox {
            let stores = &self.config.stores;
            if stores.outbox.is_none() {
                self.error(
                    format!("{base}.delivery_mode"),
                    "shared_outbox needs an outbox store (stores.outbox)",
                );
            }
            if stores.lease.is_none() {
                self.error(
                    format!("{base}.delivery_mode"),
                    "shared_outbox needs a lease store (stores.lease) for its drainer",
                );
            }
        }
        for (key, action) in [
            ("on_expired", route.policy.on_expired),
            ("on_permanent_failure", route.policy.on_permanent_failure),
        ] {
            if action == FailureAction::Dlq && self.config.stores.dlq.is_none() {
                self.error(
                    format!("{base}.policy.{key}"),
                    format!("{key}: dlq (the default) needs a DLQ store (stores.dlq); add one or set {key}: drop"),
                );
            }
        }
    }

    fn policy(&mut self, base: &str, p: &Policy) {
        for (key, value) in [
            ("max_in_flight", u64::from(p.max_in_flight)),
            ("max_outbox_depth", p.max_outbox_depth),
            ("max_payload_bytes", u64::from(p.max_payload_bytes)),
        ] {
            if value == 0 {
                self.error(format!("{base}.{key}"), "must be greater than zero");
            }
        }
        self.positive(format!("{base}.replay_budget"), p.replay_budget);
        self.positive(format!("{base}.send_timeout"), p.send_timeout);
        self.positive(format!("{base}.send_retry_budget"), p.send_retry_budget);
        if let Some(ttl) = p.ttl {
            self.positive(format!("{base}.ttl"), ttl);
        }
        let b = &p.retry_backoff;
        let bb = format!("{base}.retry_backoff");
        self.positive(format!("{bb}.initial_interval"), b.initial_interval);
        self.positive(format!("{bb}.max_interval"), b.max_interval);
        if b.initial_interval > b.max_interval {
            self.error(
                format!("{bb}.initial_interval"),
                format!(
                    "initial_interval ({}) must not exceed max_interval ({})",
                    b.initial_interval, b.max_interval
                ),
            );
        }
        self.multiplier(format!("{bb}.multiplier"), b.multiplier);
    }

    fn route_session(&mut self, base: &str, route: &Route, s: &RouteSession) {
        let sb = format!("{base}.session");
        let session_known = self.index.sessions.contains_key(s.session_id.as_str());
        if !session_known {
            self.error(
                format!("{sb}.session_id"),
                format!("unknown session \"{}\"", s.session_id),
            );
        }
        match self.index.senders.get(s.sender_id.as_str()).copied() {
            None => self.error(
                format!("{sb}.sender_id"),
                format!("unknown sender \"{}\"", s.sender_id),
            ),
            Some(sender) => {
                if session_known && sender.session_id != s.session_id {
                    self.error(
                        format!("{sb}.sender_id"),
                        format!(
                            "sender \"{}\" publishes on session \"{}\", not on the session block's session \"{}\"",
                            s.sender_id, sender.session_id, s.session_id
                        ),
                    );
                }
                for (j, id) in route.bindings.iter().enumerate() {
                    if let Some(binding) = self.index.bindings.get(id.as_str()).copied()
                        && binding.sender_id != s.sender_id
                        && self.index.senders.contains_key(binding.sender_id.as_str())
                    {
                        self.error(
                            format!("{base}.bindings[{j}]"),
                            format!(
                                "binding \"{id}\" is on sender \"{}\", but this shared_outbox route drains through sender \"{}\" (its session block); a destination on another sender needs a route of its own",
                                binding.sender_id, s.sender_id
                            ),
                        );
                    }
                }
            }
        }
        if s.drain_interval.is_some() && s.drain_strategy.is_some() {
            self.error(
                format!("{sb}.drain_strategy"),
                "drain_interval and drain_strategy are mutually exclusive; set one",
            );
        }
        if let Some(interval) = s.drain_interval {
            self.positive(format!("{sb}.drain_interval"), interval);
        }
        if let Some(strategy) = &s.drain_strategy {
            let ds = format!("{sb}.drain_strategy");
            self.positive(format!("{ds}.min_interval"), strategy.min_interval);
            self.positive(format!("{ds}.max_interval"), strategy.max_interval);
            if strategy.min_interval > strategy.max_interval {
                self.error(
                    format!("{ds}.min_interval"),
                    format!(
                        "min_interval ({}) must not exceed max_interval ({})",
                        strategy.min_interval, strategy.max_interval
                    ),
                );
            }
            self.multiplier(format!("{ds}.multiplier"), strategy.multiplier);
        }
        if s.drain_batch_size == 0 {
            self.error(
                format!("{sb}.drain_batch_size"),
                "must be greater than zero",
            );
        }
        self.positive(format!("{sb}.lease_ttl"), s.lease_ttl);
        self.positive(format!("{sb}.step_down_grace"), s.step_down_grace);
        if let Some(renew) = s.renew_interval {
            self.positive(format!("{sb}.renew_interval"), renew);
        }
        let renew = s.renew_interval();
        if !s.lease_ttl.is_zero() && renew >= s.lease_ttl {
            self.error(
                format!("{sb}.renew_interval"),
                format!(
                    "renew_interval ({renew}) must be less than lease_ttl ({}), or the lease lapses between renewals",
                    s.lease_ttl
                ),
            );
        }
    }
}
