//! The conformance suite every [`StateStore`](super::StateStore) backend
//! passes: generic async test functions over a [`TestBackend`], and
//! [`state_store_suite!`] to instantiate all of them for a backend in one
//! line (the pattern of Quickwit's `metastore_test_suite!`).
//!
//! Test data uses random ids, so the suites could share one database; each
//! backend still gives every test fresh storage.

use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::StateStore;

pub(crate) mod agents;
pub(crate) mod configs;
pub(crate) mod dlq;
pub(crate) mod leases;
pub(crate) mod metrics;
pub(crate) mod races;

/// What the suite needs from a backend beyond [`StateStore`].
pub(crate) trait TestBackend: Send + Sync + Sized + 'static {
    /// The store under test.
    type Store: StateStore;

    /// Fresh, empty storage.
    fn create() -> impl Future<Output = Self> + Send;

    /// A new store on the same storage, sharing nothing in process with
    /// earlier ones (a new connection or pool): a restarted control plane,
    /// or another replica.
    fn open(&self) -> impl Future<Output = Self::Store> + Send;

    /// The backend's first schema, as a build before any migration wrote it.
    fn schema_v1(&self) -> &'static str;

    /// Runs SQL statements on the storage directly, bypassing the store (to
    /// set up a database an older build wrote).
    fn execute_raw(&self, sql: &str) -> impl Future<Output = ()> + Send;
}

/// A random id with a readable prefix.
pub(crate) fn id(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::now_v7().simple())
}

/// A fixed point in time plus `secs` seconds.
pub(crate) fn at(secs: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_700_000_000 + secs)
}

/// Instantiates the whole conformance suite for a [`TestBackend`], as one
/// `#[tokio::test]` per generic test function.
macro_rules! state_store_suite {
    ($backend:ty) => {
        $crate::state::conformance::suite_tests!(
            $backend;
            configs::config_versions_increase_by_one,
            configs::config_unchanged_apply_keeps_version,
            configs::config_cas_conflict_stores_nothing,
            configs::config_history_newest_first_and_paged,
            configs::config_rollback_by_reapply,
            configs::config_delete_removes_history,
            configs::config_list_is_paged_by_bridge_id,
            configs::config_rejects_invalid_requests,
            configs::config_versions_from_schema_v1_migrate,
            agents::agent_hello_heartbeat_disconnect,
            agents::agent_bridge_status,
            leases::lease_versions_strictly_increase,
            leases::lease_renew_and_release_only_by_holder,
            leases::lease_versions_survive_reopen,
            leases::lease_list_by_prefix_paged,
            leases::lease_rejects_invalid_requests,
            dlq::dlq_put_is_idempotent_and_round_trips,
            dlq::dlq_filters,
            dlq::dlq_paging_oldest_first,
            dlq::dlq_purge_and_stats,
            metrics::metrics_latest_wins,
            races::race_fifty_acquirers_one_holder_at_a_time,
            races::race_same_expected_version_exactly_one_wins,
            races::race_two_stores_never_repeat_a_lease_version,
            races::race_two_stores_never_repeat_a_config_version,
        );
    };
}
pub(crate) use state_store_suite;

/// One `#[tokio::test]` per `module::function` of the suite.
macro_rules! suite_tests {
    ($backend:ty; $($module:ident :: $name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let backend =
                    <$backend as $crate::state::conformance::TestBackend>::create().await;
                $crate::state::conformance::$module::$name(&backend).await;
            }
        )*
    };
}
pub(crate) use suite_tests;
