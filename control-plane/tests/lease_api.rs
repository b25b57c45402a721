//! LeaseService over both transports: every RPC and error code, 50
//! concurrent acquirers, and versions that keep growing across a restart.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{TRANSPORTS, TestServer, Transport, test_options};
use ferry_shared::api::v1 as pb;
use pb::acquire_lease_response::Outcome;
use tonic::Code;

fn ttl(ms: u64) -> Option<prost_types::Duration> {
    Some(Duration::from_millis(ms).try_into().unwrap())
}

fn acquire(key: &str, holder: &str, ms: u64) -> pb::AcquireLeaseRequest {
    pb::AcquireLeaseRequest {
        key: key.into(),
        holder: holder.into(),
        ttl: ttl(ms),
    }
}

#[tokio::test]
async fn every_lease_rpc_and_error_code() {
    for transport in TRANSPORTS {
        let server = TestServer::start(transport).await;
        let mut leases = server.leases();
        let Some(Outcome::Granted(first)) = leases
            .acquire_lease(acquire("b/p", "h1", 60_000))
            .await
            .unwrap()
            .into_inner()
            .outcome
        else {
            panic!()
        };
        assert_eq!((first.holder.as_str(), first.version), ("h1", 1));
        let Some(Outcome::HeldByOther(held)) = leases
            .acquire_lease(acquire("b/p", "h2", 60_000))
            .await
            .unwrap()
            .into_inner()
            .outcome
        else {
            panic!()
        };
        assert_eq!(held.holder, "h1");
        let renewed = leases
            .renew_lease(pb::RenewLeaseRequest {
                key: "b/p".into(),
                holder: "h1".into(),
                version: 1,
                ttl: ttl(60_000),
            })
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        assert_eq!(renewed.version, 1);
        let status = leases
            .renew_lease(pb::RenewLeaseRequest {
                key: "b/p".into(),
                holder: "h2".into(),
                version: 1,
                ttl: ttl(1000),
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::FailedPrecondition);
        let status = leases
            .release_lease(pb::ReleaseLeaseRequest {
                key: "b/p".into(),
                holder: "h2".into(),
                version: 1,
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::FailedPrecondition);
        leases
            .release_lease(pb::ReleaseLeaseRequest {
                key: "b/p".into(),
                holder: "h1".into(),
                version: 1,
            })
            .await
            .unwrap();
        let Some(Outcome::Granted(second)) = leases
            .acquire_lease(acquire("b/p", "h2", 60_000))
            .await
            .unwrap()
            .into_inner()
            .outcome
        else {
            panic!()
        };
        assert_eq!(second.version, 2);
        leases
            .acquire_lease(acquire("c/p", "h1", 60_000))
            .await
            .unwrap();

        let listed = leases
            .list_leases(pb::ListLeasesRequest {
                key_prefix: "b/".into(),
                page_size: 0,
                page_token: String::new(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(listed.leases.len(), 1);
        assert_eq!(listed.leases[0].holder, "h2");
        let page = leases
            .list_leases(pb::ListLeasesRequest {
                key_prefix: String::new(),
                page_size: 1,
                page_token: String::new(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(!page.next_page_token.is_empty());

        let invalid = [
            (
                "key",
                leases.acquire_lease(acquire("", "h", 1000)).await.map(drop),
            ),
            (
                "holder",
                leases.acquire_lease(acquire("k", "", 1000)).await.map(drop),
            ),
            (
                "ttl",
                leases
                    .acquire_lease(pb::AcquireLeaseRequest {
                        key: "k".into(),
                        holder: "h".into(),
                        ttl: None,
                    })
                    .await
                    .map(drop),
            ),
            (
                "ttl",
                leases.acquire_lease(acquire("k", "h", 0)).await.map(drop),
            ),
            (
                "ttl",
                leases
                    .acquire_lease(pb::AcquireLeaseRequest {
                        key: "k".into(),
                        holder: "h".into(),
                        ttl: Some(prost_types::Duration {
                            seconds: -1,
                            nanos: 0,
                        }),
                    })
                    .await
                    .map(drop),
            ),
            (
                "ttl",
                leases
                    .renew_lease(pb::RenewLeaseRequest {
                        key: "b/p".into(),
                        holder: "h2".into(),
                        version: 2,
                        ttl: ttl(0),
                    })
                    .await
                    .map(drop),
            ),
            (
                "version",
                leases
                    .renew_lease(pb::RenewLeaseRequest {
                        key: "b/p".into(),
                        holder: "h2".into(),
                        version: 0,
                        ttl: ttl(10),
                    })
                    .await
                    .map(drop),
            ),
            (
                "key",
                leases
                    .release_lease(pb::ReleaseLeaseRequest {
                        key: String::new(),
                        holder: "h2".into(),
                        version: 2,
                    })
                    .await
                    .map(drop),
            ),
            (
                "page token",
                leases
                    .list_leases(pb::ListLeasesRequest {
                        key_prefix: String::new(),
                        page_size: 1,
                        page_token: "zz".into(),
                    })
                    .await
                    .map(drop),
            ),
        ];
        for (field, result) in invalid {
            let status = result.unwrap_err();
            assert_eq!(status.code(), Code::InvalidArgument, "{field}: {status:?}");
            assert!(
                status.message().contains(field) || field == "page token",
                "{field}: {}",
                status.message()
            );
        }
        server.stop().await;
    }
}

/// 50 acquirers race for one key, each holding it briefly then releasing:
/// every grant has a higher version than the one before, and no two hold it
/// at once.
#[tokio::test]
async fn fifty_concurrent_acquirers_get_increasing_versions_one_holder_at_a_time() {
    let server = TestServer::start(Transport::Tcp).await;
    let held = Arc::new(AtomicBool::new(false));
    let grants = Arc::new(std::sync::Mutex::new(Vec::new()));
    let tasks = (0..50).map(|i| {
        let mut leases = server.leases();
        let held = held.clone();
        let grants = grants.clone();
        tokio::spawn(async move {
            let holder = format!("holder-{i}");
            loop {
                let outcome = leases
                    .acquire_lease(acquire("race/p", &holder, 30_000))
                    .await
                    .unwrap()
                    .into_inner()
                    .outcome;
                if let Some(Outcome::Granted(lease)) = outcome {
                    assert!(!held.swap(true, Ordering::SeqCst), "two holders at once");
                    grants.lock().unwrap().push(lease.version);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    held.store(false, Ordering::SeqCst);
                    leases
                        .release_lease(pb::ReleaseLeaseRequest {
                            key: "race/p".into(),
                            holder,
                            version: lease.version,
                        })
                        .await
                        .unwrap();
                    return;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    });
    for task in futures::future::join_all(tasks).await {
        task.unwrap();
    }
    let grants = grants.lock().unwrap().clone();
    assert_eq!(grants.len(), 50);
    assert!(
        grants.windows(2).all(|w| w[0] < w[1]),
        "grant order = version order: {grants:?}"
    );
    server.stop().await;
}

#[tokio::test]
async fn versions_keep_increasing_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/state.db", dir.path().display());
    let mut last = 0;
    for _restart in 0..3 {
        let server = TestServer::start_on(Transport::Tcp, &url, test_options()).await;
        let mut leases = server.leases();
        for holder in ["x", "y"] {
            let Some(Outcome::Granted(lease)) = leases
                .acquire_lease(acquire("restart/p", holder, 60_000))
                .await
                .unwrap()
                .into_inner()
                .outcome
            else {
                panic!()
            };
            assert!(lease.version > last, "{} after {last}", lease.version);
            last = lease.version;
            leases
                .release_lease(pb::ReleaseLeaseRequest {
                    key: "restart/p".into(),
                    holder: holder.into(),
                    version: lease.version,
                })
                .await
                .unwrap();
        }
        server.stop().await;
    }
    assert_eq!(last, 6);
}

/// A state store that cannot be reached (its PostgreSQL database dropped
/// under the server) answers UNAVAILABLE.
#[tokio::test]
async fn an_unreachable_state_store_is_unavailable() {
    let admin = std::env::var("FERRY_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let (client, connection) = tokio_postgres::connect(&admin, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let name = format!("ferry_unavailable_{}", uuid::Uuid::now_v7().simple());
    client
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    let base = admin
        .rsplit_once('/')
        .map_or(admin.as_str(), |(base, _)| base);
    let url = format!("{base}/{name}");
    let server = TestServer::start_on(Transport::Memory, &url, test_options()).await;
    let mut leases = server.leases();
    leases
        .acquire_lease(acquire("u/p", "h", 1000))
        .await
        .unwrap();

    client
        .batch_execute(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .await
        .unwrap();
    let status = leases
        .acquire_lease(acquire("u/p", "h", 1000))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    let status = server
        .config()
        .get_config(pb::GetConfigRequest {
            bridge_id: "b".into(),
            version: 0,
            reveal_secrets: false,
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    server.stop().await;
}
