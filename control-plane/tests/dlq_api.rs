//! DlqService over both transports: every RPC and error code, and redrive
//! through a fake agent's Connect stream.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, SystemTime};

use common::{FakeAgent, TRANSPORTS, TestServer, apply, document};
use ferry_shared::api::v1 as pb;
use pb::agent_message::Message as Up;
use pb::control_message::Message as Down;
use tonic::Code;

fn entry(id: &str, bridge: &str, route: &str, reason: pb::DlqReason, at_secs: u64) -> pb::DlqEntry {
    pb::DlqEntry {
        id: id.into(),
        bridge_id: bridge.into(),
        route_id: route.into(),
        binding_id: "to-out".into(),
        envelope: Some(pb::Envelope {
            id: format!("msg-{id}"),
            payload: b"payload".to_vec(),
            ..Default::default()
        }),
        reason: reason.into(),
        last_error: "refused".into(),
        attempts: 3,
        first_attempt_at: None,
        last_attempt_at: None,
        dead_lettered_at: Some(
            (SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000 + at_secs)).into(),
        ),
        agent_id: "agent-1".into(),
        address: "out/topic".into(),
    }
}

fn write(e: pb::DlqEntry) -> pb::WriteDlqEntryRequest {
    pb::WriteDlqEntryRequest { entry: Some(e) }
}

fn filter(bridge: &str) -> Option<pb::DlqFilter> {
    Some(pb::DlqFilter {
        bridge_id: bridge.into(),
        ..Default::default()
    })
}

#[tokio::test]
async fn every_dlq_rpc_and_error_code() {
    for transport in TRANSPORTS {
        let server = TestServer::start(transport).await;
        let mut dlq = server.dlq();
        assert!(
            dlq.write_dlq_entry(write(entry(
                "e1",
                "b1",
                "main",
                pb::DlqReason::PermanentError,
                1
            )))
            .await
            .unwrap()
            .into_inner()
            .created
        );
        assert!(
            !dlq.write_dlq_entry(write(entry(
                "e1",
                "b1",
                "main",
                pb::DlqReason::PermanentError,
                1
            )))
            .await
            .unwrap()
            .into_inner()
            .created,
            "idempotent by id"
        );
        dlq.write_dlq_entry(write(entry("e2", "b1", "main", pb::DlqReason::Expired, 2)))
            .await
            .unwrap();
        dlq.write_dlq_entry(write(entry(
            "e3",
            "b2",
            "main",
            pb::DlqReason::ReplayExhausted,
            3,
        )))
        .await
        .unwrap();

        let page = dlq
            .list_dlq_entries(pb::ListDlqEntriesRequest {
                filter: None,
                page_size: 2,
                page_token: String::new(),
                omit_payload: true,
            })
            .await
            .unwrap()
            .into_inner();
        let ids: Vec<_> = page.entries.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(ids, ["e1", "e2"], "oldest first");
        assert!(
            page.entries[0]
                .envelope
                .as_ref()
                .unwrap()
                .payload
                .is_empty(),
            "payload omitted"
        );
        let rest = dlq
            .list_dlq_entries(pb::ListDlqEntriesRequest {
                filter: None,
                page_size: 2,
                page_token: page.next_page_token,
                omit_payload: false,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(rest.entries.len(), 1);
        let expired = dlq
            .list_dlq_entries(pb::ListDlqEntriesRequest {
                filter: Some(pb::DlqFilter {
                    reason: pb::DlqReason::Expired.into(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(expired.entries.len(), 1);
        let since = dlq
            .list_dlq_entries(pb::ListDlqEntriesRequest {
                filter: Some(pb::DlqFilter {
                    since: Some(
                        (SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_002)).into(),
                    ),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(since.entries.len(), 2);

        let got = dlq
            .get_dlq_entry(pb::GetDlqEntryRequest { id: "e1".into() })
            .await
            .unwrap()
            .into_inner()
            .entry
            .unwrap();
        assert_eq!(got.envelope.unwrap().payload, b"payload");
        assert_eq!(got.reason, i32::from(pb::DlqReason::PermanentError));

        let stats = dlq
            .get_dlq_stats(pb::GetDlqStatsRequest { filter: None })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((stats.total, stats.stats.len()), (3, 3));
        let b1 = dlq
            .get_dlq_stats(pb::GetDlqStatsRequest {
                filter: filter("b1"),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(b1.total, 2);

        dlq.delete_dlq_entry(pb::DeleteDlqEntryRequest { id: "e2".into() })
            .await
            .unwrap();
        let status = dlq
            .get_dlq_entry(pb::GetDlqEntryRequest { id: "e2".into() })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::NotFound);
        let status = dlq
            .delete_dlq_entry(pb::DeleteDlqEntryRequest { id: "e2".into() })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::NotFound);

        let status = dlq
            .purge_dlq_entries(pb::PurgeDlqEntriesRequest {
                filter: filter("b2"),
                confirm: false,
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(status.message().contains("confirm"));
        let purged = dlq
            .purge_dlq_entries(pb::PurgeDlqEntriesRequest {
                filter: filter("b2"),
                confirm: true,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(purged.purged, 1);

        // Malformed writes name the missing field; nothing is stored.
        let mut cases: Vec<(&str, pb::WriteDlqEntryRequest)> =
            vec![("entry", pb::WriteDlqEntryRequest { entry: None })];
        for field in [
            "entry.id",
            "entry.bridge_id",
            "entry.route_id",
            "entry.binding_id",
            "entry.envelope",
            "entry.reason",
        ] {
            let mut e = entry("bad", "b1", "main", pb::DlqReason::Expired, 9);
            match field {
                "entry.id" => e.id.clear(),
                "entry.bridge_id" => e.bridge_id.clear(),
                "entry.route_id" => e.route_id.clear(),
                "entry.binding_id" => e.binding_id.clear(),
                "entry.envelope" => e.envelope = None,
                _ => e.reason = pb::DlqReason::Unspecified.into(),
            }
            cases.push((field, write(e)));
        }
        for (field, request) in cases {
            let status = dlq.write_dlq_entry(request).await.unwrap_err();
            assert_eq!(status.code(), Code::InvalidArgument, "{field}");
            assert!(
                status.message().contains(field),
                "{field}: {}",
                status.message()
            );
        }
        for status in [
            dlq.get_dlq_entry(pb::GetDlqEntryRequest { id: String::new() })
                .await
                .map(drop)
                .unwrap_err(),
            dlq.delete_dlq_entry(pb::DeleteDlqEntryRequest { id: String::new() })
                .await
                .map(drop)
                .unwrap_err(),
            dlq.list_dlq_entries(pb::ListDlqEntriesRequest {
                page_token: "zz".into(),
                ..Default::default()
            })
            .await
            .map(drop)
            .unwrap_err(),
            dlq.list_dlq_entries(pb::ListDlqEntriesRequest {
                filter: Some(pb::DlqFilter {
                    reason: 42,
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .map(drop)
            .unwrap_err(),
            dlq.redrive_dlq_entries(pb::RedriveDlqEntriesRequest::default())
                .await
                .map(drop)
                .unwrap_err(),
        ] {
            assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        }
        assert_eq!(
            dlq.get_dlq_stats(pb::GetDlqStatsRequest { filter: None })
                .await
                .unwrap()
                .into_inner()
                .total,
            1
        );
        server.stop().await;
    }
}

#[tokio::test]
async fn redrive_goes_through_the_agent_running_the_route() {
    for transport in TRANSPORTS {
        let server = TestServer::start(transport).await;
        server
            .config()
            .apply_config(apply(&document("b1", 10), &[], None))
            .await
            .unwrap();
        let mut dlq = server.dlq();
        for (id, route) in [
            ("r1", "main"),
            ("r2", "main"),
            ("r3", "main"),
            ("gone", "no-such-route"),
        ] {
            dlq.write_dlq_entry(write(entry(
                id,
                "b1",
                route,
                pb::DlqReason::PermanentError,
                1,
            )))
            .await
            .unwrap();
        }

        // Nobody runs b1 yet.
        let status = dlq
            .redrive_dlq_entries(pb::RedriveDlqEntriesRequest {
                ids: vec!["r1".into()],
                filter: None,
                limit: 0,
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
        assert!(
            status.message().contains("no connected agent"),
            "{}",
            status.message()
        );

        let mut agent = FakeAgent::connect(server.channel.clone(), "runner", &[], &[])
            .await
            .unwrap();
        let push = agent.next_push().await;
        agent.ack(&push).await;
        common::eventually("the agent runs b1", || async {
            !server.ctx.agents.runners("b1").is_empty()
        })
        .await;

        // The agent confirms r1 and refuses r2; limit 2 leaves r3 for later.
        let call = {
            let mut dlq = dlq.clone();
            tokio::spawn(async move {
                dlq.redrive_dlq_entries(pb::RedriveDlqEntriesRequest {
                    ids: vec![],
                    filter: Some(pb::DlqFilter {
                        route_id: "main".into(),
                        ..Default::default()
                    }),
                    limit: 2,
                })
                .await
            })
        };
        for _ in 0..2 {
            let Some(Down::Command(command)) = agent.next().await.unwrap() else {
                panic!("expected a command")
            };
            let Some(pb::command::Kind::Redrive(redrive)) = command.kind else {
                panic!()
            };
            let entry = redrive.entry.unwrap();
            assert_eq!(
                entry.envelope.unwrap().payload,
                b"payload",
                "the whole envelope"
            );
            let ok = entry.id == "r1";
            agent
                .send(Up::CommandResult(pb::CommandResult {
                    command_id: command.command_id,
                    ok,
                    error: if ok {
                        String::new()
                    } else {
                        "binding refused".into()
                    },
                }))
                .await;
        }
        let response = call.await.unwrap().unwrap().into_inner();
        assert!(response.truncated);
        let outcomes: Vec<_> = response
            .outcomes
            .iter()
            .map(|o| (o.id.as_str(), o.ok))
            .collect();
        assert_eq!(outcomes, [("r1", true), ("r2", false)]);
        assert!(response.outcomes[1].error.contains("binding refused"));
        assert_eq!(
            dlq.get_dlq_entry(pb::GetDlqEntryRequest { id: "r1".into() })
                .await
                .unwrap_err()
                .code(),
            Code::NotFound,
            "deleted after the agent confirmed"
        );
        dlq.get_dlq_entry(pb::GetDlqEntryRequest { id: "r2".into() })
            .await
            .expect("a refused redrive keeps the entry");

        // An unknown id and a route the agent's configuration lacks are per-entry failures.
        let call = {
            let mut dlq = dlq.clone();
            tokio::spawn(async move {
                dlq.redrive_dlq_entries(pb::RedriveDlqEntriesRequest {
                    ids: vec!["nope".into(), "gone".into(), "r3".into()],
                    filter: None,
                    limit: 0,
                })
                .await
            })
        };
        let Some(Down::Command(command)) = agent.next().await.unwrap() else {
            panic!("expected a command")
        };
        agent
            .send(Up::CommandResult(pb::CommandResult {
                command_id: command.command_id,
                ok: true,
                error: String::new(),
            }))
            .await;
        let response = call.await.unwrap().unwrap().into_inner();
        let outcomes: Vec<_> = response
            .outcomes
            .iter()
            .map(|o| (o.id.as_str(), o.ok))
            .collect();
        assert_eq!(outcomes, [("nope", false), ("gone", false), ("r3", true)]);
        assert!(
            response.outcomes[1]
                .error
                .contains("no connected agent runs route"),
            "{}",
            response.outcomes[1].error
        );

        // An agent that never answers: the entry is kept after the timeout.
        let started = std::time::Instant::now();
        let response = dlq
            .redrive_dlq_entries(pb::RedriveDlqEntriesRequest {
                ids: vec!["r2".into()],
                filter: None,
                limit: 0,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(!response.outcomes[0].ok);
        assert!(
            response.outcomes[0].error.contains("did not answer"),
            "{}",
            response.outcomes[0].error
        );
        assert!(started.elapsed() >= Duration::from_secs(2));
        dlq.get_dlq_entry(pb::GetDlqEntryRequest { id: "r2".into() })
            .await
            .unwrap();
        server.stop().await;
    }
}
