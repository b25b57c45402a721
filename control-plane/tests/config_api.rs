//! ConfigService over both transports: every RPC, every error code, CAS,
//! and refused documents that store nothing.
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
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(listed.configs[0].bridge_id, "b1");
        let rest = config
            .list_configs(pb::ListConfigsRequest {
                page_size: 1,
                page_token: listed.next_page_token,
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
                        version: 0
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
                        version: 9
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
                        page_token: "zz".into()
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

#[tokio::test]
async fn bad_documents_are_invalid_argument_naming_the_problem_and_store_nothing() {
    let server = TestServer::start(common::Transport::Tcp).await;
    let mut config = server.config();
    let valid = document("b1", 10);
    let cases: Vec<(&str, Vec<u8>, Vec<&str>)> = vec![
        (
            "empty bridge id",
            valid.replace("  id: b1\n", "  id: \"\"\n").into_bytes(),
            vec!["bridge.id"],
        ),
        (
            "unknown reference",
            valid
                .replace("bindings: [to-out]", "bindings: [to-nowhere]")
                .into_bytes(),
            vec!["routes[0].bindings[0]", "to-nowhere"],
        ),
        (
            "invalid yaml",
            b"bridge:\n  id: b1\nroutes: [\n".to_vec(),
            vec!["yaml error at line"],
        ),
        (
            "wrong type",
            valid
                .replace("max_in_flight: 10", "max_in_flight: \"lots\"")
                .into_bytes(),
            vec!["yaml error at line", "u32"],
        ),
        (
            "unset variable",
            valid
                .replace("client_id: b1-client", "client_id: ${CLIENT_ID}")
                .into_bytes(),
            vec!["CLIENT_ID"],
        ),
        (
            "ten mebibytes",
            {
                let mut big = valid.clone().into_bytes();
                big.extend(std::iter::repeat_n(b'#', 10 << 20));
                big
            },
            vec!["more than the limit of 1048576 bytes"],
        ),
        (
            "not utf-8",
            b"bridge:\n  id: \xff\n".to_vec(),
            vec!["UTF-8"],
        ),
    ];
    for (name, yaml, expected) in cases {
        let request = pb::ApplyConfigRequest {
            document: Some(pb::apply_config_request::Document::Yaml(yaml)),
            ..Default::default()
        };
        let status = config.apply_config(request).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{name}: {status:?}");
        for needle in expected {
            assert!(
                status.message().contains(needle),
                "{name}: {:?} lacks {needle:?}",
                status.message()
            );
        }
    }
    // Several problems at once: every one listed, one per line.
    let two = valid
        .replace("bindings: [to-out]", "bindings: [to-nowhere]")
        .replace("receiver_id: in", "receiver_id: nothing");
    let status = config
        .apply_config(apply(&two, &[], None))
        .await
        .unwrap_err();
    let lines: Vec<&str> = status.message().lines().skip(1).collect();
    assert!(lines.len() >= 2, "{}", status.message());
    assert!(lines.iter().all(|l| l.contains(": ")), "{lines:?}");

    let listed = config
        .list_configs(pb::ListConfigsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(listed.configs.is_empty(), "nothing stored");
    server.stop().await;
}

fn json_to_proto(value: serde_json::Value) -> prost_types::Value {
    use prost_types::value::Kind;
    let kind = match value {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap()),
        serde_json::Value::String(s) => Kind::StringValue(s),
        serde_json::Value::Array(a) => Kind::ListValue(prost_types::ListValue {
            values: a.into_iter().map(json_to_proto).collect(),
        }),
        serde_json::Value::Object(o) => Kind::StructValue(prost_types::Struct {
            fields: o.into_iter().map(|(k, v)| (k, json_to_proto(v))).collect(),
        }),
    };
    prost_types::Value { kind: Some(kind) }
}

#[tokio::test]
async fn structured_documents_are_validated_and_stored_as_yaml() {
    let server = TestServer::start(common::Transport::Memory).await;
    let mut config = server.config();
    let value: serde_json::Value = serde_saphyr::from_str(&document("s1", 7)).unwrap();
    let Some(prost_types::value::Kind::StructValue(structured)) = json_to_proto(value).kind else {
        panic!()
    };
    let stored = config
        .apply_config(pb::ApplyConfigRequest {
            document: Some(pb::apply_config_request::Document::Structured(
                structured.clone(),
            )),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .config
        .unwrap();
    assert_eq!((stored.bridge_id.as_str(), stored.version), ("s1", 1));
    assert!(stored.yaml.contains("max_in_flight: 7"), "{}", stored.yaml);

    let mut broken = structured;
    broken.fields.remove("bridge");
    let status = config
        .apply_config(pb::ApplyConfigRequest {
            document: Some(pb::apply_config_request::Document::Structured(broken)),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("bridge"), "{}", status.message());
    server.stop().await;
}

#[tokio::test]
async fn concurrent_applies_with_the_same_expected_version_exactly_one_wins() {
    let server = TestServer::start(common::Transport::Tcp).await;
    let mut config = server.config();
    config
        .apply_config(apply(&document("cas", 1), &[], Some(0)))
        .await
        .unwrap();
    for round in 0..10u32 {
        let expected = u64::from(round) + 1;
        let attempts = (0..2u32).map(|i| {
            let mut client = server.config();
            let doc = document("cas", 100 + round * 2 + i);
            tokio::spawn(async move { client.apply_config(apply(&doc, &[], Some(expected))).await })
        });
        let results = futures::future::join_all(attempts).await;
        let wins = results
            .iter()
            .filter(|r| r.as_ref().unwrap().is_ok())
            .count();
        assert_eq!(wins, 1, "round {round}");
        for result in results {
            if let Err(status) = result.unwrap() {
                assert_eq!(status.code(), Code::FailedPrecondition);
            }
        }
    }
    let current = config
        .get_config(pb::GetConfigRequest {
            bridge_id: "cas".into(),
            version: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .config
        .unwrap();
    assert_eq!(current.version, 11);
    server.stop().await;
}
