//! ConfigService over both transports: every RPC and every error code.
#![allow(clippy::unwrap_used)]

mod common;

use common::{TRANSPORTS, TestServer, apply, document};
use ferry_shared::api::v1 as pb;
use tonic::Code;

#[tokio::test]
async fn every_config_rpc_works_in_memory_and_over_tcp() {
    for transport in TRANSPORTS {
        let server = TestServer::start(transport).await;
        let mut config = server.config();

        let first = config
            .apply_config(apply(&document("b1", 10), &[("site", "a")], Some(0)))
            .await
            .unwrap()
            .into_inner();
        assert!(first.changed, "{transport:?}");
        let stored = first.config.unwrap();
        assert_eq!((stored.bridge_id.as_str(), stored.version), ("b1", 1));
        assert_eq!(stored.selector.unwrap().match_labels["site"], "a");

        let same = config
            .apply_config(apply(&document("b1", 10), &[("site", "a")], None))
            .await
            .unwrap()
            .into_inner();
        assert!(!same.changed);
        assert_eq!(same.config.unwrap().version, 1);

        let second = config
            .apply_config(apply(&document("b1", 20), &[("site", "a")], Some(1)))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(second.config.unwrap().version, 2);

        let current = config
            .get_config(pb::GetConfigRequest {
                bridge_id: "b1".into(),
                version: 0,
                reveal_secrets: false,
            })
            .await
            .unwrap()
            .into_inner()
            .config
            .unwrap();
        assert_eq!(current.version, 2);
        assert!(current.yaml.contains("max_in_flight: 20"));
        let old = config
            .get_config(pb::GetConfigRequest {
                bridge_id: "b1".into(),
                version: 1,
                reveal_secrets: false,
            })
            .await
            .unwrap()
            .into_inner()
            .config
            .unwrap();
        assert!(old.yaml.contains("max_in_flight: 10"));

        config
            .apply_config(apply(&document("b2", 5), &[], None))
            .await
            .unwrap();
        let listed = config
            .list_configs(pb::ListConfigsRequest {
                page_size: 1,
                page_token: String::new(),
                reveal_secrets: false,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(listed.configs[0].bridge_id, "b1");
        let rest = config
            .list_configs(pb::ListConfigsRequest {
                page_size: 1,
                page_token: listed.next_page_token,
                reveal_secrets: false,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(rest.configs[0].bridge_id, "b2");
        assert!(rest.next_page_token.is_empty());

        let history = config
            .list_config_versions(pb::ListConfigVersionsRequest {
                bridge_id: "b1".into(),
                page_size: 0,
                page_token: String::new(),
            })
            .await
            .unwrap()
            .into_inner();
        let versions: Vec<u64> = history.versions.iter().map(|v| v.version).collect();
        assert_eq!(versions, [2, 1]);
        assert_eq!(history.versions[0].digest.len(), 64);

        let route = config
            .get_route(pb::GetRouteRequest {
                bridge_id: "b1".into(),
                route_id: "main".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(route.version, 2);
        assert!(
            route.route_yaml.contains("max_in_flight: 20"),
            "{}",
            route.route_yaml
        );

        let edited = route
            .route_yaml
            .replace("max_in_flight: 20", "max_in_flight: 30");
        let put = config
            .put_route(pb::PutRouteRequest {
                bridge_id: "b1".into(),
                route_yaml: edited.into_bytes(),
                expected_version: Some(2),
                change_note: "raise".into(),
            })
            .await
            .unwrap()
            .into_inner();
        let put = put.config.unwrap();
        assert_eq!(put.version, 3);
        assert!(put.yaml.contains("max_in_flight: 30"));
        assert_eq!(
            put.selector.unwrap().match_labels["site"],
            "a",
            "a route edit keeps the selector"
        );

        // Removing the only route leaves an invalid bridge: refused, nothing stored.
        let status = config
            .delete_route(pb::DeleteRouteRequest {
                bridge_id: "b1".into(),
                route_id: "main".into(),
                expected_version: None,
                change_note: String::new(),
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains("routes"), "{}", status.message());

        let rolled = config
            .rollback_config(pb::RollbackConfigRequest {
                bridge_id: "b1".into(),
                to_version: 1,
                expected_version: Some(3),
            })
            .await
            .unwrap()
            .into_inner()
            .config
            .unwrap();
        assert_eq!(rolled.version, 4);
        assert_eq!(rolled.yaml, old.yaml);
        assert!(rolled.change_note.contains("rollback to version 1"));

        // A second route added, then removed again.
        let second =
            b"id: second\nreceiver_id: spare\ndelivery_mode: direct_hold\nbindings: [to-out]\n";
        let added = config
            .put_route(pb::PutRouteRequest {
                bridge_id: "b1".into(),
                route_yaml: second.to_vec(),
                expected_version: None,
                change_note: "add".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .config
            .unwrap();
        assert_eq!(added.version, 5);
        assert!(added.yaml.contains("second"));
        let removed = config
            .delete_route(pb::DeleteRouteRequest {
                bridge_id: "b1".into(),
                route_id: "second".into(),
                expected_version: Some(5),
                change_note: "remove".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .config
            .unwrap();
        assert_eq!(removed.version, 6);
        assert!(!removed.yaml.contains("second") && removed.yaml.contains("main"));

        config
            .delete_config(pb::DeleteConfigRequest {
                bridge_id: "b2".into(),
                expected_version: Some(1),
            })
            .await
            .unwrap();
        let gone = config
            .get_config(pb::GetConfigRequest {
                bridge_id: "b2".into(),
                version: 0,
                reveal_secrets: false,
            })
            .await
            .unwrap_err();
        assert_eq!(gone.code(), Code::NotFound);
        server.stop().await;
    }
}

fn code_and_message<T: std::fmt::Debug>(
    result: Result<tonic::Response<T>, tonic::Status>,
) -> (Code, String) {
    let status = result.unwrap_err();
    (status.code(), status.message().to_owned())
}

#[tokio::test]
async fn config_error_codes() {
    for transport in TRANSPORTS {
        let server = TestServer::start(transport).await;
        let mut config = server.config();
        config
            .apply_config(apply(&document("b1", 10), &[], None))
            .await
            .unwrap();

        let (code, message) = code_and_message(
            config
                .get_config(pb::GetConfigRequest {
                    bridge_id: String::new(),
                    version: 0,
                    reveal_secrets: false,
                })
                .await,
        );
        assert_eq!(code, Code::InvalidArgument);
        assert!(message.contains("bridge_id"), "{message}");
        assert_eq!(
            code_and_message(
                config
                    .get_config(pb::GetConfigRequest {
                        bridge_id: "nope".into(),
                        version: 0,
                        reveal_secrets: false,
                    })
                    .await
            )
            .0,
            Code::NotFound
        );
        assert_eq!(
            code_and_message(
                config
                    .get_config(pb::GetConfigRequest {
                        bridge_id: "b1".into(),
                        version: 9,
                        reveal_secrets: false,
                    })
                    .await
            )
            .0,
            Code::NotFound
        );
        let (code, message) = code_and_message(
            config
                .apply_config(apply(&document("b1", 11), &[], Some(5)))
                .await,
        );
        assert_eq!(code, Code::FailedPrecondition);
        assert!(message.contains("current version is 1"), "{message}");
        assert_eq!(
            code_and_message(config.apply_config(pb::ApplyConfigRequest::default()).await).0,
            Code::InvalidArgument
        );
        assert_eq!(
            code_and_message(
                config
                    .delete_config(pb::DeleteConfigRequest {
                        bridge_id: "b1".into(),
                        expected_version: Some(7)
                    })
                    .await
            )
            .0,
            Code::FailedPrecondition
        );
        assert_eq!(
            code_and_message(
                config
                    .delete_config(pb::DeleteConfigRequest {
                        bridge_id: "nope".into(),
                        expected_version: None
                    })
                    .await
            )
            .0,
            Code::NotFound
        );
        assert_eq!(
            code_and_message(
                config
                    .delete_config(pb::DeleteConfigRequest {
                        bridge_id: String::new(),
                        expected_version: None
                    })
                    .await
            )
            .0,
            Code::InvalidArgument
        );
        assert_eq!(
            code_and_message(
                config
                    .list_configs(pb::ListConfigsRequest {
                        page_size: 1,
                        page_token: "zz".into(),
                        reveal_secrets: false,
                    })
                    .await
            )
            .0,
            Code::InvalidArgument
        );
        assert_eq!(
            code_and_message(
                config
                    .list_config_versions(pb::ListConfigVersionsRequest {
                        bridge_id: "nope".into(),
                        page_size: 0,
                        page_token: String::new()
                    })
                    .await
            )
            .0,
            Code::NotFound
        );
        assert_eq!(
            code_and_message(
                config
                    .list_config_versions(pb::ListConfigVersionsRequest {
                        bridge_id: String::new(),
                        page_size: 0,
                        page_token: String::new()
                    })
                    .await
            )
            .0,
            Code::InvalidArgument
        );
        let (code, message) = code_and_message(
            config
                .get_route(pb::GetRouteRequest {
                    bridge_id: "b1".into(),
                    route_id: String::new(),
                })
                .await,
        );
        assert_eq!(code, Code::InvalidArgument);
        assert!(message.contains("route_id"), "{message}");
        assert_eq!(
            code_and_message(
                config
                    .get_route(pb::GetRouteRequest {
                        bridge_id: "b1".into(),
                        route_id: "nope".into()
                    })
                    .await
            )
            .0,
            Code::NotFound
        );
        assert_eq!(
            code_and_message(
                config
                    .get_route(pb::GetRouteRequest {
                        bridge_id: "nope".into(),
                        route_id: "main".into()
                    })
                    .await
            )
            .0,
            Code::NotFound
        );
        assert_eq!(
            code_and_message(
                config
                    .put_route(pb::PutRouteRequest {
                        bridge_id: "b1".into(),
                        route_yaml: b"[not, a, mapping]".to_vec(),
                        expected_version: None,
                        change_note: String::new()
                    })
                    .await
            )
            .0,
            Code::InvalidArgument
        );
        assert_eq!(
            code_and_message(
                config
                    .put_route(pb::PutRouteRequest {
                        bridge_id: "b1".into(),
                        route_yaml: b"id: main\n".to_vec(),
                        expected_version: Some(4),
                        change_note: String::new()
                    })
                    .await
            )
            .0,
            Code::FailedPrecondition
        );
        let (code, message) = code_and_message(config.put_route(pb::PutRouteRequest { bridge_id: "b1".into(), route_yaml: b"id: extra\nreceiver_id: in\ndelivery_mode: direct_hold\ndispatch_mode: single\nbindings: [to-nowhere]\n".to_vec(), expected_version: None, change_note: String::new() }).await);
        assert_eq!(code, Code::InvalidArgument);
        assert!(message.contains("to-nowhere"), "{message}");
        assert_eq!(
            code_and_message(
                config
                    .delete_route(pb::DeleteRouteRequest {
                        bridge_id: "b1".into(),
                        route_id: "nope".into(),
                        expected_version: None,
                        change_note: String::new()
                    })
                    .await
            )
            .0,
            Code::NotFound
        );
        assert_eq!(
            code_and_message(
                config
                    .delete_route(pb::DeleteRouteRequest {
                        bridge_id: "b1".into(),
                        route_id: "main".into(),
                        expected_version: Some(3),
                        change_note: String::new()
                    })
                    .await
            )
            .0,
            Code::FailedPrecondition
        );
        assert_eq!(
            code_and_message(
                config
                    .rollback_config(pb::RollbackConfigRequest {
                        bridge_id: "b1".into(),
                        to_version: 0,
                        expected_version: None
                    })
                    .await
            )
            .0,
            Code::InvalidArgument
        );
        assert_eq!(
            code_and_message(
                config
                    .rollback_config(pb::RollbackConfigRequest {
                        bridge_id: "b1".into(),
                        to_version: 8,
                        expected_version: None
                    })
                    .await
            )
            .0,
            Code::NotFound
        );
        assert_eq!(
            code_and_message(
                config
                    .rollback_config(pb::RollbackConfigRequest {
                        bridge_id: "b1".into(),
                        to_version: 1,
                        expected_version: Some(9)
                    })
                    .await
            )
            .0,
            Code::FailedPrecondition
        );

        let history = config
            .list_config_versions(pb::ListConfigVersionsRequest {
                bridge_id: "b1".into(),
                page_size: 0,
                page_token: String::new(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(history.versions.len(), 1, "no refused call stored anything");
        server.stop().await;
    }
}
