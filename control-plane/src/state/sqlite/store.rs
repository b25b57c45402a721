//! [`StateStore`] for [`SqliteStore`]: every operation runs on the
//! connection thread, writes in a `BEGIN IMMEDIATE` transaction.

use std::time::{Duration, SystemTime};

use super::{SqliteStore, agents, configs, dlq, leases, metrics};
use crate::state::paging::{Page, PageRequest};
use crate::state::types::{
    AgentBridgeEvent, AgentHello, AgentRecord, AppliedConfig, ApplyConfig, ConfigVersion, DlqEntry,
    DlqFilter, DlqStat, Lease, LeaseAcquisition, MetricsRecord, StoredConfig,
};
use crate::state::{StateStore, StoreFuture};

impl StateStore for SqliteStore {
    fn apply_config(&self, apply: ApplyConfig) -> StoreFuture<'_, AppliedConfig> {
        Box::pin(self.write(move |tx| configs::apply(tx, &apply, SystemTime::now())))
    }

    fn get_config<'a>(
        &'a self,
        bridge_id: &'a str,
        version: Option<u64>,
    ) -> StoreFuture<'a, StoredConfig> {
        let bridge_id = bridge_id.to_owned();
        Box::pin(self.call(move |conn| configs::get(conn, &bridge_id, version)))
    }

    fn list_configs(&self, page: PageRequest) -> StoreFuture<'_, Page<StoredConfig>> {
        Box::pin(self.call(move |conn| configs::list(conn, &page)))
    }

    fn list_config_versions<'a>(
        &'a self,
        bridge_id: &'a str,
        page: PageRequest,
    ) -> StoreFuture<'a, Page<ConfigVersion>> {
        let bridge_id = bridge_id.to_owned();
        Box::pin(self.call(move |conn| configs::versions(conn, &bridge_id, &page)))
    }

    fn delete_config<'a>(
        &'a self,
        bridge_id: &'a str,
        expected_version: Option<u64>,
    ) -> StoreFuture<'a, ()> {
        let bridge_id = bridge_id.to_owned();
        Box::pin(self.write(move |tx| configs::delete(tx, &bridge_id, expected_version)))
    }

    fn upsert_agent(&self, hello: AgentHello) -> StoreFuture<'_, ()> {
        Box::pin(self.write(move |tx| agents::upsert(tx, &hello)))
    }

    fn mark_agent_seen<'a>(&'a self, agent_id: &'a str, at: SystemTime) -> StoreFuture<'a, ()> {
        let agent_id = agent_id.to_owned();
        Box::pin(self.write(move |tx| agents::seen(tx, &agent_id, at)))
    }

    fn mark_agent_disconnected<'a>(
        &'a self,
        agent_id: &'a str,
        at: SystemTime,
    ) -> StoreFuture<'a, ()> {
        let agent_id = agent_id.to_owned();
        Box::pin(self.write(move |tx| agents::disconnected(tx, &agent_id, at)))
    }

    fn record_agent_bridge<'a>(
        &'a self,
        agent_id: &'a str,
        bridge_id: &'a str,
        event: AgentBridgeEvent,
        at: SystemTime,
    ) -> StoreFuture<'a, ()> {
        let (agent_id, bridge_id) = (agent_id.to_owned(), bridge_id.to_owned());
        Box::pin(self.write(move |tx| agents::record(tx, &agent_id, &bridge_id, &event, at)))
    }

    fn get_agent<'a>(&'a self, agent_id: &'a str) -> StoreFuture<'a, AgentRecord> {
        let agent_id = agent_id.to_owned();
        Box::pin(self.call(move |conn| agents::get(conn, &agent_id)))
    }

    fn list_agents(&self) -> StoreFuture<'_, Vec<AgentRecord>> {
        Box::pin(self.call(|conn| agents::list(conn)))
    }

    fn acquire_lease<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        ttl: Duration,
        now: SystemTime,
    ) -> StoreFuture<'a, LeaseAcquisition> {
        let (key, holder) = (key.to_owned(), holder.to_owned());
        Box::pin(self.write(move |tx| leases::acquire(tx, &key, &holder, ttl, now)))
    }

    fn renew_lease<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
        ttl: Duration,
        now: SystemTime,
    ) -> StoreFuture<'a, Lease> {
        let (key, holder) = (key.to_owned(), holder.to_owned());
        Box::pin(self.write(move |tx| leases::renew(tx, &key, &holder, version, ttl, now)))
    }

    fn release_lease<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
    ) -> StoreFuture<'a, ()> {
        let (key, holder) = (key.to_owned(), holder.to_owned());
        Box::pin(self.write(move |tx| leases::release(tx, &key, &holder, version)))
    }

    fn list_leases<'a>(
        &'a self,
        prefix: &'a str,
        page: PageRequest,
    ) -> StoreFuture<'a, Page<Lease>> {
        let prefix = prefix.to_owned();
        Box::pin(self.call(move |conn| leases::list(conn, &prefix, &page)))
    }

    fn put_dlq(&self, entry: DlqEntry) -> StoreFuture<'_, bool> {
        Box::pin(self.write(move |tx| dlq::put(tx, &entry)))
    }

    fn list_dlq<'a>(
        &'a self,
        filter: &'a DlqFilter,
        page: PageRequest,
    ) -> StoreFuture<'a, Page<DlqEntry>> {
        let filter = filter.clone();
        Box::pin(self.call(move |conn| dlq::list(conn, &filter, &page)))
    }

    fn get_dlq<'a>(&'a self, id: &'a str) -> StoreFuture<'a, DlqEntry> {
        let id = id.to_owned();
        Box::pin(self.call(move |conn| dlq::get(conn, &id)))
    }

    fn delete_dlq<'a>(&'a self, id: &'a str) -> StoreFuture<'a, ()> {
        let id = id.to_owned();
        Box::pin(self.write(move |tx| dlq::delete(tx, &id)))
    }

    fn purge_dlq<'a>(&'a self, filter: &'a DlqFilter) -> StoreFuture<'a, u64> {
        let filter = filter.clone();
        Box::pin(self.write(move |tx| dlq::purge(tx, &filter)))
    }

    fn dlq_stats<'a>(&'a self, filter: &'a DlqFilter) -> StoreFuture<'a, Vec<DlqStat>> {
        let filter = filter.clone();
        Box::pin(self.call(move |conn| dlq::stats(conn, &filter)))
    }

    fn put_metrics(&self, record: MetricsRecord) -> StoreFuture<'_, ()> {
        Box::pin(self.write(move |tx| metrics::put(tx, &record)))
    }

    fn get_metrics<'a>(&'a self, agent_id: &'a str) -> StoreFuture<'a, MetricsRecord> {
        let agent_id = agent_id.to_owned();
        Box::pin(self.call(move |conn| metrics::get(conn, &agent_id)))
    }

    fn list_metrics(&self) -> StoreFuture<'_, Vec<MetricsRecord>> {
        Box::pin(self.call(|conn| metrics::list(conn)))
    }
}
