//! Who applied each version, the audit events of changes, and who may see a
//! document's secrets: the service called directly, with the principal the
//! authentication layer would have stored in the request.
#![allow(clippy::unwrap_used)]

use ferry_shared::audit::capture;
use ferry_shared::auth::Principal;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::server::TcpConnectInfo;

use super::*;
use crate::services::Options;
use crate::state::sqlite::SqliteStore;

const PASSWORD: &str = "pa55-w0rd-xyz";

fn document(note: &str) -> String {
    format!(
        r#"# {note}
bridge:
  id: b1
sessions:
  - id: conn
    transport: mqtt
    options:
      session:
        broker_url: mqtts://broker.example:8883
        client_id: b1-client
        username: ferry
        password: "{PASSWORD}"
receivers:
  - id: in
    session_id: conn
    topics:
      - topic: "in/{note}/#"
        qos: 1
senders:
  - id: out
    session_id: conn
bindings:
  - id: to-out
    sender_id: out
    address: out/topic
routes:
  - id: main
    receiver_id: in
    delivery_mode: direct_hold
    dispatch_mode: single
    bindings: [to-out]
    policy:
      on_expired: drop
      on_permanent_failure: drop
"#
    )
}

async fn service() -> (ConfigServiceImpl, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("state.db"))
        .await
        .unwrap();
    let ctx = Context::new(
        std::sync::Arc::new(store),
        Options::default(),
        CancellationToken::new(),
    );
    (ConfigServiceImpl::new(ctx), dir)
}

/// A request as the authentication layer hands it on: `name` with `role`,
/// from 192.0.2.7:53122.
fn from<T>(name: &str, role: Role, message: T) -> Request<T> {
    let mut request = Request::new(message);
    request.extensions_mut().insert(Principal {
        name: name.into(),
        role,
        agent_id: None,
    });
    request.extensions_mut().insert(TcpConnectInfo {
        local_addr: None,
        remote_addr: Some("192.0.2.7:53122".parse().unwrap()),
    });
    request
}

fn apply_request(note: &str) -> pb::ApplyConfigRequest {
    pb::ApplyConfigRequest {
        document: Some(pb::apply_config_request::Document::Yaml(
            document(note).into_bytes(),
        )),
        selector: None,
        expected_version: None,
        change_note: String::new(),
    }
}

fn get_request(reveal_secrets: bool) -> pb::GetConfigRequest {
    pb::GetConfigRequest {
        bridge_id: "b1".into(),
        version: 0,
        reveal_secrets,
    }
}

#[tokio::test]
async fn every_version_names_who_applied_it_and_every_change_is_audited() {
    let (captured, _guard) = capture::start();
    let (service, _dir) = service().await;
    let applied = service
        .apply_config(from("alice", Role::Operator, apply_request("one")))
        .await
        .unwrap()
        .into_inner()
        .config
        .unwrap();
    assert_eq!(
        (applied.applied_by.as_str(), applied.client_address.as_str()),
        ("alice", "192.0.2.7:53122")
    );
    service
        .apply_config(from("bob", Role::Admin, apply_request("two")))
        .await
        .unwrap();
    let rollback = pb::RollbackConfigRequest {
        bridge_id: "b1".into(),
        to_version: 1,
        expected_version: None,
    };
    service
        .rollback_config(from("carol", Role::Operator, rollback))
        .await
        .unwrap();
    let history = service
        .list_config_versions(Request::new(pb::ListConfigVersionsRequest {
            bridge_id: "b1".into(),
            page_size: 0,
            page_token: String::new(),
        }))
        .await
        .unwrap()
        .into_inner();
    let authors: Vec<(u64, &str, &str)> = history
        .versions
        .iter()
        .map(|v| (v.version, v.applied_by.as_str(), v.client_address.as_str()))
        .collect();
    assert_eq!(
        authors,
        [
            (3, "carol", "192.0.2.7:53122"),
            (2, "bob", "192.0.2.7:53122"),
            (1, "alice", "192.0.2.7:53122"),
        ]
    );
    let refused = service
        .apply_config(Request::new(pb::ApplyConfigRequest {
            document: None,
            ..apply_request("x")
        }))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    service
        .delete_config(from(
            "dave",
            Role::Operator,
            pb::DeleteConfigRequest {
                bridge_id: "b1".into(),
                expected_version: Some(3),
            },
        ))
        .await
        .unwrap();

    let events: Vec<[String; 6]> = captured
        .events()
        .into_iter()
        .map(|e| {
            ["action", "principal", "role", "client", "bridge", "subject"]
                .map(|field| e[field].clone())
        })
        .collect();
    let client = "192.0.2.7:53122";
    let expected = [
        [
            "config.apply",
            "alice",
            "operator",
            client,
            "b1",
            "version 1",
        ],
        ["config.apply", "bob", "admin", client, "b1", "version 2"],
        [
            "config.rollback",
            "carol",
            "operator",
            client,
            "b1",
            "to version 1, version 3",
        ],
        ["config.apply", "unauthenticated", "viewer", "", "", ""],
        [
            "config.delete",
            "dave",
            "operator",
            client,
            "b1",
            "expected version 3",
        ],
    ]
    .map(|row| row.map(str::to_owned));
    assert_eq!(events, expected);
    let outcomes: Vec<String> = captured
        .events()
        .into_iter()
        .map(|e| e["outcome"].clone())
        .collect();
    assert_eq!(outcomes[..3], ["ok", "ok", "ok"]);
    assert!(outcomes[3].starts_with("error: InvalidArgument: document: must be set"));
    assert_eq!(outcomes[4], "ok");
    assert!(
        captured
            .events()
            .iter()
            .all(|e| e.values().all(|v| !v.contains(PASSWORD))),
        "audit events carry no document"
    );
}

#[tokio::test]
async fn documents_are_masked_unless_an_admin_asks_for_secrets() {
    let (captured, _guard) = capture::start();
    let (service, _dir) = service().await;
    let applied = service
        .apply_config(from("alice", Role::Operator, apply_request("one")))
        .await
        .unwrap()
        .into_inner()
        .config
        .unwrap();
    assert!(
        !applied.yaml.contains(PASSWORD),
        "the apply echoes no secret"
    );
    assert!(applied.yaml.contains("password: '***'") || applied.yaml.contains("password: \"***\""));

    for role in [Role::Viewer, Role::Operator, Role::Agent, Role::Admin] {
        let masked = service
            .get_config(from("someone", role, get_request(false)))
            .await
            .unwrap()
            .into_inner()
            .config
            .unwrap();
        assert!(!masked.yaml.contains(PASSWORD), "{role}");
        assert!(masked.yaml.contains("***"), "{role}");
    }
    let listed = service
        .list_configs(from(
            "someone",
            Role::Admin,
            pb::ListConfigsRequest::default(),
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(!listed.configs[0].yaml.contains(PASSWORD));

    for role in [Role::Viewer, Role::Operator, Role::Agent] {
        let refused = service
            .get_config(from("olga", role, get_request(true)))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), Code::PermissionDenied, "{role}");
        assert_eq!(
            refused.message(),
            format!("reveal_secrets needs the admin role; olga has the {role} role")
        );
        let refused = service
            .list_configs(from(
                "olga",
                role,
                pb::ListConfigsRequest {
                    reveal_secrets: true,
                    ..Default::default()
                },
            ))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), Code::PermissionDenied, "{role}");
    }
    let refused = service
        .get_config(Request::new(get_request(true)))
        .await
        .unwrap_err();
    assert_eq!(
        refused.code(),
        Code::PermissionDenied,
        "no principal is no admin"
    );

    let revealed = service
        .get_config(from("root", Role::Admin, get_request(true)))
        .await
        .unwrap()
        .into_inner()
        .config
        .unwrap();
    assert_eq!(
        revealed.yaml,
        document("one"),
        "as stored, comments and all"
    );

    let reveals: Vec<(String, String)> = captured
        .events()
        .into_iter()
        .filter(|e| e["action"] == "config.reveal_secrets")
        .map(|e| (e["principal"].clone(), e["outcome"].clone()))
        .collect();
    assert_eq!(reveals.len(), 8);
    assert_eq!(reveals[7], ("root".to_owned(), "ok".to_owned()));
    assert!(
        reveals[..7]
            .iter()
            .all(|(_, o)| o.starts_with("error: PermissionDenied"))
    );
}
