//! [`StateStore`] for [`PostgresStore`]: writes through `in_transaction!`
//! (row locks, bounded retry of lost races), reads through `on_connection!`.

use std::time::{Duration, SystemTime};

use super::{
    MAX_ATTEMPTS, PostgresStore, TxError, TxResult, agents, configs, db_err, dlq, leases,
    lost_race, metrics,
};
use crate::state::error::StateError;
use crate::state::paging::{Page, PageRequest};
use crate::state::types::{
    AgentBridgeEvent, AgentHello, AgentRecord, AppliedConfig, ApplyConfig, ConfigVersion, DlqEntry,
    DlqFilter, DlqStat, Lease, LeaseAcquisition, MetricsRecord, StoredConfig,
};
use crate::state::{StateStore, StoreFuture};

impl StateStore for PostgresStore {
    fn apply_config(&self, apply: ApplyConfig) -> StoreFuture<'_, AppliedConfig> {
        Box::pin(async move {
            let now = SystemTime::now();
            in_transaction!(self, |tx| configs::apply(&tx, &apply, now))
        })
    }

    fn get_config<'a>(
        &'a self,
        bridge_id: &'a str,
        version: Option<u64>,
    ) -> StoreFuture<'a, StoredConfig> {
        Box::pin(async move { on_connection!(self, |c| configs::get(c, bridge_id, version)) })
    }

    fn list_configs(&self, page: PageRequest) -> StoreFuture<'_, Page<StoredConfig>> {
        Box::pin(async move { on_connection!(self, |c| configs::list(c, &page)) })
    }

    fn list_config_versions<'a>(
        &'a self,
        bridge_id: &'a str,
        page: PageRequest,
    ) -> StoreFuture<'a, Page<ConfigVersion>> {
        Box::pin(async move { on_connection!(self, |c| configs::versions(c, bridge_id, &page)) })
    }

    fn delete_config<'a>(
        &'a self,
        bridge_id: &'a str,
        expected_version: Option<u64>,
    ) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            in_transaction!(self, |tx| configs::delete(&tx, bridge_id, expected_version))
        })
    }

    fn upsert_agent(&self, hello: AgentHello) -> StoreFuture<'_, ()> {
        Box::pin(async move { in_transaction!(self, |tx| agents::upsert(&tx, &hello)) })
    }

    fn mark_agent_seen<'a>(&'a self, agent_id: &'a str, at: SystemTime) -> StoreFuture<'a, ()> {
        Box::pin(async move { in_transaction!(self, |tx| agents::seen(&tx, agent_id, at)) })
    }

    fn mark_agent_disconnected<'a>(
        &'a self,
        agent_id: &'a str,
        at: SystemTime,
    ) -> StoreFuture<'a, ()> {
        Box::pin(async move { in_transaction!(self, |tx| agents::disconnected(&tx, agent_id, at)) })
    }

    fn record_agent_bridge<'a>(
        &'a self,
        agent_id: &'a str,
        bridge_id: &'a str,
        event: AgentBridgeEvent,
        at: SystemTime,
    ) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            in_transaction!(self, |tx| agents::record(
                &tx, agent_id, bridge_id, &event, at
            ))
        })
    }

    fn get_agent<'a>(&'a self, agent_id: &'a str) -> StoreFuture<'a, AgentRecord> {
        Box::pin(async move { on_connection!(self, |c| agents::get(c, agent_id)) })
    }

    fn list_agents(&self) -> StoreFuture<'_, Vec<AgentRecord>> {
        Box::pin(async move { on_connection!(self, |c| agents::list(c)) })
    }

    fn acquire_lease<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        ttl: Duration,
        now: SystemTime,
    ) -> StoreFuture<'a, LeaseAcquisition> {
        Box::pin(
            async move { in_transaction!(self, |tx| leases::acquire(&tx, key, holder, ttl, now)) },
        )
    }

    fn renew_lease<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
        ttl: Duration,
        now: SystemTime,
    ) -> StoreFuture<'a, Lease> {
        Box::pin(async move {
            in_transaction!(self, |tx| leases::renew(
                &tx, key, holder, version, ttl, now
            ))
        })
    }

    fn release_lease<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
    ) -> StoreFuture<'a, ()> {
        Box::pin(
            async move { in_transaction!(self, |tx| leases::release(&tx, key, holder, version)) },
        )
    }

    fn list_leases<'a>(
        &'a self,
        prefix: &'a str,
        page: PageRequest,
    ) -> StoreFuture<'a, Page<Lease>> {
        Box::pin(async move { on_connection!(self, |c| leases::list(c, prefix, &page)) })
    }

    fn put_dlq(&self, entry: DlqEntry) -> StoreFuture<'_, bool> {
        Box::pin(async move { in_transaction!(self, |tx| dlq::put(&tx, &entry)) })
    }

    fn list_dlq<'a>(
        &'a self,
        filter: &'a DlqFilter,
        page: PageRequest,
    ) -> StoreFuture<'a, Page<DlqEntry>> {
        Box::pin(async move { on_connection!(self, |c| dlq::list(c, filter, &page)) })
    }

    fn get_dlq<'a>(&'a self, id: &'a str) -> StoreFuture<'a, DlqEntry> {
        Box::pin(async move { on_connection!(self, |c| dlq::get(c, id)) })
    }

    fn delete_dlq<'a>(&'a self, id: &'a str) -> StoreFuture<'a, ()> {
        Box::pin(async move { in_transaction!(self, |tx| dlq::delete(&tx, id)) })
    }

    fn purge_dlq<'a>(&'a self, filter: &'a DlqFilter) -> StoreFuture<'a, u64> {
        Box::pin(async move { in_transaction!(self, |tx| dlq::purge(&tx, filter)) })
    }

    fn dlq_stats<'a>(&'a self, filter: &'a DlqFilter) -> StoreFuture<'a, Vec<DlqStat>> {
        Box::pin(async move { on_connection!(self, |c| dlq::stats(c, filter)) })
    }

    fn put_metrics(&self, record: MetricsRecord) -> StoreFuture<'_, ()> {
        Box::pin(async move { in_transaction!(self, |tx| metrics::put(&tx, &record)) })
    }

    fn get_metrics<'a>(&'a self, agent_id: &'a str) -> StoreFuture<'a, MetricsRecord> {
        Box::pin(async move { on_connection!(self, |c| metrics::get(c, agent_id)) })
    }

    fn list_metrics(&self) -> StoreFuture<'_, Vec<MetricsRecord>> {
        Box::pin(async move { on_connection!(self, |c| metrics::list(c)) })
    }
}
