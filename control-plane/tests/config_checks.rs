//! ConfigService document checks: refused documents (empty ids, unknown
//! references, invalid YAML, wrong types, unset variables, 10 MiB) get
//! INVALID_ARGUMENT naming the problem and store nothing; structured
//! documents; concurrent compare-and-swap.
#![allow(clippy::unwrap_used)]

mod common;

use common::{TestServer, apply, document};
use ferry_shared::api::v1 as pb;
use tonic::Code;

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
            reveal_secrets: false,
        })
        .await
        .unwrap()
        .into_inner()
        .config
        .unwrap();
    assert_eq!(current.version, 11);
    server.stop().await;
}
