//! Audit events: one structured `tracing` event per change an operator
//! makes, so a log pipeline can keep them apart from the rest of the log
//! (filter on the target [`TARGET`], e.g. `RUST_LOG=ferry::audit=info`).
//!
//! Every event has the same fields:
//!
//! | field | value |
//! |---|---|
//! | `principal` | the caller's name ([`Principal::name`](crate::auth::Principal)) |
//! | `role` | its role (`admin`, `operator`, ...) |
//! | `client` | the client's address, empty when unknown |
//! | `action` | what was asked: [`Action`] as text (`config.apply`, `dlq.purge`, ...) |
//! | `bridge` | the bridge it concerns, empty when none or several |
//! | `subject` | what exactly: a version, entry ids, a DLQ filter, a lease key |
//! | `outcome` | `ok`, or `error: <code>: <message>` when it was refused or failed |
//!
//! An event is written once the outcome is known, also for a refused or
//! failed request (a refused purge is worth knowing about). Events never
//! carry a configuration document or a message payload.

use std::fmt;

use tonic::Status;

use crate::auth::Caller;

/// The `tracing` target of every audit event.
pub const TARGET: &str = "ferry::audit";

/// What an audited request asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// A configuration stored as a new version (ApplyConfig, PutRoute,
    /// DeleteRoute).
    ConfigApply,
    /// An old version applied again as a new version.
    ConfigRollback,
    /// A configuration and its history deleted.
    ConfigDelete,
    /// A configuration read with its secrets revealed (or refused).
    ConfigRevealSecrets,
    /// Dead letters redriven.
    DlqRedrive,
    /// One dead letter deleted.
    DlqDelete,
    /// Dead letters purged by filter.
    DlqPurge,
    /// A lease acquired by an operator (not an agent's own acquire).
    LeaseAcquire,
    /// A lease released by an operator.
    LeaseRelease,
}

impl Action {
    /// The action as audit events spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ConfigApply => "config.apply",
            Self::ConfigRollback => "config.rollback",
            Self::ConfigDelete => "config.delete",
            Self::ConfigRevealSecrets => "config.reveal_secrets",
            Self::DlqRedrive => "dlq.redrive",
            Self::DlqDelete => "dlq.delete",
            Self::DlqPurge => "dlq.purge",
            Self::LeaseAcquire => "lease.acquire",
            Self::LeaseRelease => "lease.release",
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Writes one audit event: `caller` asked for `action` on `bridge` /
/// `subject`, with `outcome`.
pub fn record(caller: &Caller, action: Action, bridge: &str, subject: &str, outcome: &Outcome) {
    tracing::info!(
        target: TARGET,
        principal = %caller.principal.name,
        role = %caller.principal.role,
        client = %caller.peer_text(),
        action = action.as_str(),
        bridge,
        subject,
        outcome = %outcome,
        "audit"
    );
}

/// How an audited request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Done.
    Ok,
    /// Refused or failed: the status the caller got.
    Error {
        /// The gRPC code.
        code: tonic::Code,
        /// The status message.
        message: String,
    },
}

impl Outcome {
    /// The outcome of a service call's result.
    pub fn of<T>(result: &Result<T, Status>) -> Self {
        match result {
            Ok(_) => Self::Ok,
            Err(status) => Self::Error {
                code: status.code(),
                message: status.message().to_owned(),
            },
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ok => f.write_str("ok"),
            Self::Error { code, message } => write!(f, "error: {code:?}: {message}"),
        }
    }
}

/// Test-only: captures the audit events written while a closure or future
/// runs, with their fields as text, for both halves' tests.
#[cfg(any(test, feature = "test-util"))]
pub mod capture {
    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex};

    use tracing::field::{Field, Visit};
    use tracing::subscriber::DefaultGuard;
    use tracing_subscriber::layer::{Context, SubscriberExt};
    use tracing_subscriber::{Layer, Registry};

    /// One captured event: field name → value as text.
    pub type Event = BTreeMap<String, String>;

    /// The audit events captured so far.
    #[derive(Clone, Default)]
    pub struct Captured(Arc<Mutex<Vec<Event>>>);

    impl Captured {
        /// The events, in the order they were written.
        pub fn events(&self) -> Vec<Event> {
            self.0.lock().map(|e| e.clone()).unwrap_or_default()
        }
    }

    /// Captures audit events on this thread until the guard is dropped (use a
    /// current-thread runtime for async tests).
    pub fn start() -> (Captured, DefaultGuard) {
        let captured = Captured::default();
        let subscriber = Registry::default().with(CaptureLayer(captured.clone()));
        (captured, tracing::subscriber::set_default(subscriber))
    }

    struct CaptureLayer(Captured);

    impl<S: tracing::Subscriber> Layer<S> for CaptureLayer {
        fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
            if event.metadata().target() != super::TARGET {
                return;
            }
            let mut fields = FieldText::default();
            event.record(&mut fields);
            if let Ok(mut events) = (self.0).0.lock() {
                events.push(fields.0);
            }
        }
    }

    #[derive(Default)]
    struct FieldText(Event);

    impl Visit for FieldText {
        fn record_str(&mut self, field: &Field, value: &str) {
            self.0.insert(field.name().to_owned(), value.to_owned());
        }

        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            self.0.insert(field.name().to_owned(), format!("{value:?}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{Principal, Role};

    #[test]
    fn an_event_names_caller_action_and_outcome() {
        let (captured, _guard) = capture::start();
        let caller = Caller {
            principal: Principal {
                name: "alice".into(),
                role: Role::Operator,
                agent_id: None,
            },
            peer: Some("192.0.2.7:53122".parse().expect("address")),
        };
        record(
            &caller,
            Action::DlqPurge,
            "b1",
            "filter bridge=b1",
            &Outcome::Ok,
        );
        let refused = Outcome::of::<()>(&Err(Status::permission_denied("needs operator")));
        record(&caller, Action::ConfigDelete, "b1", "", &refused);

        let events = captured.events();
        assert_eq!(events.len(), 2);
        let first = &events[0];
        assert_eq!(first["principal"], "alice");
        assert_eq!(first["role"], "operator");
        assert_eq!(first["client"], "192.0.2.7:53122");
        assert_eq!(first["action"], "dlq.purge");
        assert_eq!(first["bridge"], "b1");
        assert_eq!(first["subject"], "filter bridge=b1");
        assert_eq!(first["outcome"], "ok");
        assert_eq!(
            events[1]["outcome"],
            "error: PermissionDenied: needs operator"
        );
    }
}
