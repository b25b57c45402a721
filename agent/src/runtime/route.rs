//! Starting and stopping one route, per delivery mode: `direct_hold` (one
//! task) or `shared_outbox` (the writer plus its drainer). Each route has its
//! own cancellation tokens and join handles ([`RunningRoute`]), so it starts
//! and stops on its own.
//!
//! Invariants:
//!
//! - stopping a route stops its intake first and lets the deliveries in
//!   progress finish within the grace period; what is left stays unsettled
//!   (the broker redelivers). Only then its drainer finishes its cycle and
//!   releases its lease, so a route started again on the same partition never
//!   runs beside the drainer it replaces;
//! - records already in the outbox when a partition is first opened by this
//!   process (left by a previous run) count as received, once: a route that
//!   stops and starts again in the same process does not count them twice;
//! - records of a binding the route no longer lists (a binding removed by a
//!   change) are still drained to the address they were written for, and
//!   counted under that binding: they were acknowledged to their source when
//!   they were written (ADR 0005).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use ferry_shared::config::{DeliveryMode, Route, ValidConfig};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::sessions::SessionEntry;
use super::stores::Stores;
use super::{BuildError, DEFAULT_GRACE, Deps, join_all};
use crate::drainer::Drainer;
use crate::routes::direct_hold::DirectHold;
use crate::routes::redrive::Target;
use crate::routes::shared_outbox::{OutboxDepth, OutboxWriter};
use crate::routes::{RouteBinding, RouteIdentity};
use crate::stores::OutboxStore;
use crate::transports::address::Templated;
use crate::transports::{Receiver, Sender};

/// What starting a route needs from the bridge.
pub(crate) struct RouteContext<'a> {
    pub valid: &'a ValidConfig,
    pub deps: &'a Deps,
    pub stores: &'a Stores,
    pub sessions: &'a HashMap<String, SessionEntry>,
    /// The claim owner: the agent id plus this bridge's incarnation.
    pub owner: &'a str,
    /// The address of every binding this bridge has run, by id (for the
    /// DLQ entries of records whose binding a change removed).
    pub addresses: &'a HashMap<String, String>,
}

/// One running route.
pub(crate) struct RunningRoute {
    intake: CancellationToken,
    drain: CancellationToken,
    intake_task: JoinHandle<()>,
    drainer_task: Option<JoinHandle<()>>,
    /// The partition, for the depth gauges once the drainer stopped.
    outbox: Option<OutboxView>,
    /// The grace period for its in-flight work.
    pub grace: Duration,
}

struct OutboxView {
    partition: String,
    outbox: Arc<dyn OutboxStore>,
    bindings: HashMap<String, RouteBinding>,
}

/// Starts `route` on `receiver`; returns it with its redrive target.
/// `counted`: the partitions whose records this process already counted.
pub(crate) async fn start(
    ctx: &RouteContext<'_>,
    route: &Route,
    receiver: Box<dyn Receiver>,
    counted: &mut HashSet<String>,
) -> Result<(RunningRoute, Target), BuildError> {
    let valid = ctx.valid;
    let bridge_id = valid.bridge_id().to_owned();
    let identity = RouteIdentity {
        bridge_id: bridge_id.clone(),
        route_id: route.id.clone(),
        agent_id: ctx.deps.agent_id.clone(),
    };
    let route_metrics = ctx.deps.metrics.route(&bridge_id, &route.id);
    let binding = |id: &str, address: &str| RouteBinding {
        id: id.to_owned(),
        address: address.to_owned(),
        metrics: ctx.deps.metrics.binding(&bridge_id, &route.id, id),
    };
    let bindings: Vec<RouteBinding> = valid
        .route_bindings(route)
        .map(|b| binding(&b.id, &b.address))
        .collect();
    let sender_of = |sender_id: &str| -> Result<Arc<dyn Sender>, BuildError> {
        let sender = valid.sender(sender_id).ok_or_else(|| {
            BuildError::Unsupported(format!("route {}: unknown sender {sender_id}", route.id))
        })?;
        let entry = ctx.sessions.get(&sender.session_id).ok_or_else(|| {
            BuildError::Unsupported(format!("sender {sender_id}: session not started"))
        })?;
        // Every sender fills address templates the same way (`transports::address`).
        Ok(Templated::wrap(
            entry
                .session
                .sender(sender, route.policy.send_timeout.get()),
        ))
    };
    let intake = CancellationToken::new();
    let drain = CancellationToken::new();
    match route.delivery_mode {
        DeliveryMode::DirectHold => {
            let grace = DEFAULT_GRACE;
            let binding = bindings.first().cloned().ok_or_else(|| {
                BuildError::Unsupported(format!("route {}: no binding", route.id))
            })?;
            let sender_id = valid
                .binding(&binding.id)
                .map(|b| b.sender_id.clone())
                .unwrap_or_default();
            let sender = sender_of(&sender_id)?;
            let target = Target::Direct {
                binding: binding.clone(),
                sender: Arc::clone(&sender),
            };
            let task = DirectHold {
                identity,
                binding,
                sender,
                dlq: ctx.stores.dlq.clone(),
                policy: route.policy.clone(),
                route_metrics,
            };
            let intake_task = tokio::spawn(task.run(receiver, intake.clone(), grace));
            Ok((
                RunningRoute {
                    intake,
                    drain,
                    intake_task,
                    drainer_task: None,
                    outbox: None,
                    grace,
                },
                target,
            ))
        }
        DeliveryMode::SharedOutbox => {
            let (Some(outbox), Some(leases), Some(block)) = (
                ctx.stores.outbox.clone(),
                ctx.stores.leases.clone(),
                route.session.as_ref(),
            ) else {
                return Err(BuildError::Unsupported(format!(
                    "route {}: shared_outbox needs an outbox, a lease store and a session block",
                    route.id
                )));
            };
            let grace = block.step_down_grace.get();
            let partition = valid.partition(route);
            let sender = sender_of(&block.sender_id)?;
            let connected = sender.connected();
            let depth = Arc::new(OutboxDepth::default());
            let mut drained: HashMap<String, RouteBinding> =
                bindings.iter().map(|b| (b.id.clone(), b.clone())).collect();
            // The drainer sends a record to the address stored with it; the
            // binding's address only goes into a DLQ entry.
            let retired_binding =
                |id: &str| binding(id, ctx.addresses.get(id).map_or("", String::as_str));
            let retired = recover(
                &*outbox,
                &partition,
                &mut drained,
                &depth,
                counted,
                &retired_binding,
            )
            .await?;
            if !retired.is_empty() {
                tracing::info!(route = %route.id, partition, bindings = ?retired, "draining the records of bindings the route no longer lists");
            }
            let wake = Arc::new(Notify::new());
            let configured: HashMap<String, RouteBinding> =
                bindings.iter().map(|b| (b.id.clone(), b.clone())).collect();
            let target = Target::Outbox {
                partition: partition.clone(),
                outbox: Arc::clone(&outbox),
                bindings: configured,
                wake: Arc::clone(&wake),
                depth: Arc::clone(&depth),
            };
            let drainer = Drainer {
                identity: identity.clone(),
                partition: partition.clone(),
                holder: ctx.deps.agent_id.clone(),
                owner: ctx.owner.to_owned(),
                bindings: drained.clone(),
                outbox: Arc::clone(&outbox),
                leases,
                dlq: ctx.stores.dlq.clone(),
                sender,
                connected,
                wake: Arc::clone(&wake),
                depth: Arc::clone(&depth),
                batch: block.drain_batch_size as usize,
                poll: block.drain_poll(),
                lease_ttl: block.lease_ttl.get(),
                renew_interval: block.renew_interval().get(),
                grace,
                on_expired: route.policy.on_expired,
                on_permanent_failure: route.policy.on_permanent_failure,
                max_replay_attempts: route.policy.max_replay_attempts,
                replay_budget: route.policy.replay_budget.get(),
                route_metrics: route_metrics.clone(),
                lease_resolved: ctx
                    .deps
                    .readiness
                    .condition(format!("lease of route {} resolved", route.id)),
                state: Default::default(),
            };
            let drainer_task = tokio::spawn(drainer.run(drain.clone()));
            let writer = OutboxWriter {
                identity,
                partition: partition.clone(),
                bindings,
                outbox: Arc::clone(&outbox),
                dlq: ctx.stores.dlq.clone(),
                policy: route.policy.clone(),
                route_metrics,
                wake,
                depth,
            };
            let intake_task = tokio::spawn(writer.run(receiver, intake.clone(), grace));
            Ok((
                RunningRoute {
                    intake,
                    drain,
                    intake_task,
                    drainer_task: Some(drainer_task),
                    outbox: Some(OutboxView {
                        partition,
                        outbox,
                        bindings: drained,
                    }),
                    grace,
                },
                target,
            ))
        }
    }
}

/// Reads the partition's records at start: sets the depth, counts them as
/// received the first time this process opens the partition, and adds to
/// `bindings` the bindings that have records but are no longer listed
/// (returned).
async fn recover(
    outbox: &dyn OutboxStore,
    partition: &str,
    bindings: &mut HashMap<String, RouteBinding>,
    depth: &OutboxDepth,
    counted: &mut HashSet<String>,
    binding: &(dyn Fn(&str) -> RouteBinding + Sync),
) -> Result<Vec<String>, BuildError> {
    let stats = outbox
        .stats(partition)
        .await
        .map_err(|e| BuildError::Store(format!("outbox partition {partition}: {e}")))?;
    depth.set(stats.total.depth);
    let mut retired = Vec::new();
    for (id, s) in &stats.bindings {
        if s.depth > 0 && !bindings.contains_key(id) {
            bindings.insert(id.clone(), binding(id));
            retired.push(id.clone());
        }
    }
    let first_open = counted.insert(partition.to_owned());
    if first_open {
        for (id, b) in bindings.iter() {
            if let Some(s) = stats.bindings.get(id) {
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
    }
    retired.sort();
    Ok(retired)
}

/// Stops `routes` in dependency order: every intake first (in parallel),
/// then every drainer, which releases its lease. Afterwards the depth gauges
/// of the stopped partitions show what is left in them.
pub(crate) async fn stop_all(routes: Vec<RunningRoute>) {
    let grace = routes
        .iter()
        .map(|r| r.grace)
        .max()
        .unwrap_or(DEFAULT_GRACE);
    // Each task bounds itself by the grace period; the margin covers a
    // store call in progress.
    let bound = grace + Duration::from_secs(2);
    let mut intakes = Vec::new();
    let mut drainers = Vec::new();
    let mut views = Vec::new();
    for r in routes {
        r.intake.cancel();
        intakes.push(r.intake_task);
        drainers.push((r.drain, r.drainer_task));
        views.extend(r.outbox);
    }
    join_all("route", intakes, bound).await;
    let mut tasks = Vec::new();
    for (token, task) in drainers {
        token.cancel();
        tasks.extend(task);
    }
    join_all("drainer", tasks, bound).await;
    for view in views {
        view.refresh_gauges().await;
    }
}

impl OutboxView {
    /// Sets the depth and oldest-age gauges of the partition's bindings from
    /// the store, so that what a stopped route left behind stays visible.
    async fn refresh_gauges(&self) {
        match self.outbox.stats(&self.partition).await {
            Ok(stats) => {
                let now = std::time::SystemTime::now();
                for (id, b) in &self.bindings {
                    let s = stats.bindings.get(id).cloned().unwrap_or_default();
                    b.metrics.set_outbox(s.depth, s.oldest_pending_age(now));
                }
                if stats.total.depth > 0 {
                    tracing::info!(partition = %self.partition, depth = stats.total.depth, "route stopped; its records stay in the outbox");
                }
            }
            Err(error) => {
                tracing::warn!(partition = %self.partition, %error, "cannot read the depth of a stopped route's partition");
            }
        }
    }
}
