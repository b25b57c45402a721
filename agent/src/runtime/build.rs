//! [`start`]: the construction of a [`Bridge`] from a validated configuration.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use ferry_shared::config::{DeliveryMode, Route, ValidConfig};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::settings;
use super::{Bridge, BuildError, DEFAULT_GRACE, Deps};
use crate::drainer::Drainer;
use crate::routes::direct_hold::DirectHold;
use crate::routes::redrive::{Redrive, Target};
use crate::routes::shared_outbox::{OutboxDepth, OutboxWriter};
use crate::routes::{RouteBinding, RouteIdentity};
use crate::stores::observed::{self, StoreObserver};
use crate::stores::{DlqStore, LeaseStore, OutboxStore};
use crate::transports::mqtt::{MqttReceiver, MqttSenderSettings, MqttSession};
use crate::transports::{Receiver, Sender, Session};

pub(super) async fn start(valid: &ValidConfig, deps: Deps) -> Result<Bridge, BuildError> {
    let bridge_id = valid.bridge_id().to_owned();
    let stale = valid
        .stale_claim_duration()
        .map_or(Duration::from_secs(300), |d| d.get());
    // Every store is observed: errors counted, health in /readyz, one log
    // line per change of state (stores::observed).
    let observer = |store| {
        StoreObserver::new(
            &bridge_id,
            store,
            Arc::clone(&deps.metrics),
            &deps.readiness,
        )
    };
    let outbox: Option<Arc<dyn OutboxStore>> = match &valid.stores.outbox {
        Some(c) => Some(observed::outbox(
            settings::outbox(c, stale).await?,
            observer("outbox"),
        )),
        None => None,
    };
    let leases: Option<Arc<dyn LeaseStore>> = match &valid.stores.lease {
        Some(c) => Some(observed::lease(
            settings::lease(c).await?,
            observer("lease"),
        )),
        None => None,
    };
    let dlq: Option<Arc<dyn DlqStore>> = match &valid.stores.dlq {
        Some(c) => Some(observed::dlq(settings::dlq(c).await?, observer("dlq"))),
        None => None,
    };

    // Sessions, each with the receiver of the route it feeds.
    let sessions_token = CancellationToken::new();
    // Sessions started before a later step fails must not outlive the error.
    let stop_sessions_on_error = sessions_token.clone().drop_guard();
    let mut sessions: HashMap<String, MqttSession> = HashMap::new();
    let mut receivers: HashMap<String, MqttReceiver> = HashMap::new();
    for session in &valid.sessions {
        let mut fed: Vec<(&ferry_shared::config::Receiver, &Route)> = Vec::new();
        for r in valid
            .receivers
            .iter()
            .filter(|r| r.session_id == session.id)
        {
            match valid.routes.iter().find(|route| route.receiver_id == r.id) {
                Some(route) => fed.push((r, route)),
                None => tracing::warn!(receiver = %r.id, "receiver feeds no route; not subscribed"),
            }
        }
        if fed.len() > 1 {
            return Err(BuildError::Unsupported(format!(
                "session {}: an mqtt session carries one receiver; give receivers {} sessions of their own",
                session.id,
                fed.iter()
                    .map(|(r, _)| r.id.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let route = fed.first().map(|(_, route)| *route);
        let s = settings::mqtt_session(session, route)?;
        let token = sessions_token.child_token();
        let refused = |e: crate::transports::mqtt::SettingsError| {
            BuildError::Session(format!("session {}: {e}", session.id))
        };
        let started = match fed.first() {
            Some((r, route)) => {
                let (m, rx) =
                    MqttSession::start_with_receiver(s, settings::mqtt_receiver(r, route), token)
                        .map_err(refused)?;
                receivers.insert(route.id.clone(), rx);
                m
            }
            None => MqttSession::start(s, token).map_err(refused)?,
        };
        sessions.insert(session.id.clone(), started);
    }

    let routes_token = CancellationToken::new();
    let drainers_token = CancellationToken::new();
    let stop_routes_on_error = routes_token.clone().drop_guard();
    let stop_drainers_on_error = drainers_token.clone().drop_guard();
    let mut route_tasks = Vec::new();
    let mut drainer_tasks = Vec::new();
    let mut targets = HashMap::new();
    let mut grace = Duration::ZERO;
    let owner = format!("{}/{}", deps.agent_id, uuid::Uuid::now_v7());

    for route in &valid.routes {
        let identity = RouteIdentity {
            bridge_id: bridge_id.clone(),
            route_id: route.id.clone(),
            agent_id: deps.agent_id.clone(),
        };
        let route_metrics = deps.metrics.route(&bridge_id, &route.id);
        let bindings: Vec<RouteBinding> = valid
            .route_bindings(route)
            .map(|b| RouteBinding {
                id: b.id.clone(),
                address: b.address.clone(),
                metrics: deps.metrics.binding(&bridge_id, &route.id, &b.id),
            })
            .collect();
        let sender_of = |sender_id: &str| -> Result<(Arc<dyn Sender>, _), BuildError> {
            let sender = valid.sender(sender_id).ok_or_else(|| {
                BuildError::Unsupported(format!("route {}: unknown sender {sender_id}", route.id))
            })?;
            let session = sessions.get(&sender.session_id).ok_or_else(|| {
                BuildError::Unsupported(format!("sender {sender_id}: session not started"))
            })?;
            let s = MqttSenderSettings {
                qos: settings::qos(sender.options.sender.qos()),
                retain: sender.options.sender.retain(),
                send_timeout: route.policy.send_timeout.get(),
            };
            Ok((Arc::new(session.sender(s)), Session::connected(session)))
        };
        let receiver: Box<dyn Receiver> = match receivers.remove(&route.id) {
            Some(r) => Box::new(r),
            None => {
                return Err(BuildError::Unsupported(format!(
                    "route {}: receiver {} is not on a started session",
                    route.id, route.receiver_id
                )));
            }
        };
        match route.delivery_mode {
            DeliveryMode::DirectHold => {
                let route_grace = DEFAULT_GRACE;
                grace = grace.max(route_grace);
                let binding = bindings.first().cloned().ok_or_else(|| {
                    BuildError::Unsupported(format!("route {}: no binding", route.id))
                })?;
                let sender_id = valid
                    .binding(&binding.id)
                    .map(|b| b.sender_id.clone())
                    .unwrap_or_default();
                let (sender, _) = sender_of(&sender_id)?;
                targets.insert(
                    route.id.clone(),
                    Target::Direct {
                        binding: binding.clone(),
                        sender: Arc::clone(&sender),
                    },
                );
                let task = DirectHold {
                    identity,
                    binding,
                    sender,
                    dlq: dlq.clone(),
                    policy: route.policy.clone(),
                    route_metrics,
                };
                route_tasks.push(tokio::spawn(task.run(
                    receiver,
                    routes_token.clone(),
                    route_grace,
                )));
            }
            DeliveryMode::SharedOutbox => {
                let (Some(outbox), Some(leases), Some(session_block)) =
                    (outbox.clone(), leases.clone(), route.session.as_ref())
                else {
                    return Err(BuildError::Unsupported(format!(
                        "route {}: shared_outbox needs an outbox, a lease store and a session block",
                        route.id
                    )));
                };
                let route_grace = session_block.step_down_grace.get();
                grace = grace.max(route_grace);
                let partition = valid.partition(route);
                let depth = Arc::new(OutboxDepth::default());
                recover_counts(&*outbox, &partition, &bindings, &depth).await?;
                let wake = Arc::new(Notify::new());
                let (sender, connected) = sender_of(&session_block.sender_id)?;
                targets.insert(
                    route.id.clone(),
                    Target::Outbox {
                        partition: partition.clone(),
                        outbox: Arc::clone(&outbox),
                        bindings: bindings.iter().map(|b| (b.id.clone(), b.clone())).collect(),
                        wake: Arc::clone(&wake),
                        depth: Arc::clone(&depth),
                    },
                );
                let drainer = Drainer {
                    identity: identity.clone(),
                    partition: partition.clone(),
                    holder: deps.agent_id.clone(),
                    owner: owner.clone(),
                    bindings: bindings.iter().map(|b| (b.id.clone(), b.clone())).collect(),
                    outbox: Arc::clone(&outbox),
                    leases,
                    dlq: dlq.clone(),
                    sender,
                    connected,
                    wake: Arc::clone(&wake),
                    depth: Arc::clone(&depth),
                    batch: session_block.drain_batch_size as usize,
                    poll: session_block.drain_poll(),
                    lease_ttl: session_block.lease_ttl.get(),
                    renew_interval: session_block.renew_interval().get(),
                    grace: route_grace,
                    on_expired: route.policy.on_expired,
                    on_permanent_failure: route.policy.on_permanent_failure,
                    max_replay_attempts: route.policy.max_replay_attempts,
                    replay_budget: route.policy.replay_budget.get(),
                    route_metrics: route_metrics.clone(),
                    lease_resolved: deps
                        .readiness
                        .condition(format!("lease of route {} resolved", route.id)),
                    state: Default::default(),
                };
                drainer_tasks.push(tokio::spawn(drainer.run(drainers_token.clone())));
                let writer = OutboxWriter {
                    identity,
                    partition,
                    bindings,
                    outbox,
                    dlq: dlq.clone(),
                    policy: route.policy.clone(),
                    route_metrics,
                    wake,
                    depth,
                };
                route_tasks.push(tokio::spawn(writer.run(
                    receiver,
                    routes_token.clone(),
                    route_grace,
                )));
            }
        }
    }

    let mut watcher_tasks = Vec::new();
    for (id, session) in &sessions {
        let condition = deps.readiness.condition(format!("session {id} connected"));
        let gauge = deps.metrics.session(&bridge_id, id);
        let mut connected = Session::connected(session);
        let token = sessions_token.clone();
        watcher_tasks.push(tokio::spawn(async move {
            let mut ever = false;
            loop {
                let up = *connected.borrow_and_update();
                condition.set(up);
                gauge.set_connected(up, up && ever);
                ever |= up;
                tokio::select! {
                    () = token.cancelled() => break,
                    changed = connected.changed() => if changed.is_err() { break },
                }
            }
        }));
    }

    stop_routes_on_error.disarm();
    stop_drainers_on_error.disarm();
    stop_sessions_on_error.disarm();
    Ok(Bridge {
        routes: routes_token,
        drainers: drainers_token,
        sessions_token,
        route_tasks,
        drainer_tasks,
        watcher_tasks,
        sessions: sessions.into_values().collect(),
        dlq,
        redrive: Arc::new(Redrive::new(bridge_id, targets)),
        grace: if grace.is_zero() {
            DEFAULT_GRACE
        } else {
            grace
        },
    })
}

/// Records already in the outbox at start (left by a previous run) count as
/// received and in flight, so that the conservation law holds for what this
/// process sends.
async fn recover_counts(
    outbox: &dyn OutboxStore,
    partition: &str,
    bindings: &[RouteBinding],
    depth: &OutboxDepth,
) -> Result<(), BuildError> {
    let stats = outbox
        .stats(partition)
        .await
        .map_err(|e| BuildError::Store(format!("outbox partition {partition}: {e}")))?;
    depth.set(stats.total.depth);
    for b in bindings {
        if let Some(s) = stats.bindings.get(&b.id) {
            b.metrics.received(s.depth);
        }
    }
    if stats.total.depth > 0 {
        tracing::info!(
            partition,
            depth = stats.total.depth,
            "outbox records from a previous run"
        );
    }
    Ok(())
}
