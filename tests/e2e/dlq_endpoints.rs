//! The control plane and a standalone agent's admin listener serve the one shared
//! `DlqService`, so they answer alike where they used to differ: a redrive with neither ids
//! nor a filter is refused by both, and both apply the same default limit to a redrive and
//! the same default page size to a listing.

use ferry_shared::api::v1 as pb;
use ferry_shared::auth::client::AuthChannel;
use ferry_shared::dlq::DEFAULT_PAGE_SIZE;
use ferry_tests::Mosquitto;
use pb::dlq_service_client::DlqServiceClient;
use tonic::Code;

use crate::agent_support::{Bridge, dlq_client};
use crate::control_plane::ControlPlane;

/// More than one default page or redrive.
const MANY: usize = 150;

/// What an endpoint answered to the requests the two used to answer differently.
#[derive(Debug, PartialEq)]
struct Answers {
    /// Code and message of a redrive naming neither ids nor a filter.
    empty_redrive: (Code, String),
    /// Outcomes of a redrive of [`MANY`] unknown ids with no limit, and `truncated`.
    default_redrive: (usize, bool),
    /// Entries of a first page with no page size, and whether a next page was offered.
    default_page: (usize, bool),
}

async fn answers(mut dlq: DlqServiceClient<AuthChannel>) -> anyhow::Result<Answers> {
    let refused = dlq
        .redrive_dlq_entries(pb::RedriveDlqEntriesRequest::default())
        .await
        .expect_err("an empty-filter redrive is refused");
    let unknown = (0..MANY).map(|i| format!("unknown-{i}")).collect();
    let redriven = dlq
        .redrive_dlq_entries(pb::RedriveDlqEntriesRequest {
            ids: unknown,
            filter: None,
            limit: 0,
        })
        .await?
        .into_inner();
    anyhow::ensure!(
        redriven.outcomes.iter().all(|o| !o.ok),
        "unknown ids are per-entry failures: {redriven:?}"
    );
    for i in 0..MANY {
        dlq.write_dlq_entry(pb::WriteDlqEntryRequest {
            entry: Some(entry(i)),
        })
        .await?;
    }
    let page = dlq
        .list_dlq_entries(pb::ListDlqEntriesRequest {
            omit_payload: true,
            ..Default::default()
        })
        .await?
        .into_inner();
    Ok(Answers {
        empty_redrive: (refused.code(), refused.message().to_owned()),
        default_redrive: (redriven.outcomes.len(), redriven.truncated),
        default_page: (page.entries.len(), !page.next_page_token.is_empty()),
    })
}

fn entry(i: usize) -> pb::DlqEntry {
    pb::DlqEntry {
        id: format!("dl-{i:03}"),
        bridge_id: "elsewhere".into(),
        route_id: "main".into(),
        binding_id: "out".into(),
        envelope: Some(pb::Envelope {
            id: format!("m-{i}"),
            payload: b"x".to_vec(),
            source: Some(pb::Source {
                transport: "mqtt".into(),
                session_id: "in".into(),
                address: "in/topic".into(),
                received_at: Some(std::time::SystemTime::now().into()),
            }),
            ..Default::default()
        }),
        reason: pb::DlqReason::PermanentError as i32,
        ..Default::default()
    }
}

#[tokio::test]
async fn agent_and_control_plane_answer_dlq_requests_alike() -> anyhow::Result<()> {
    let broker = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let bridge = Bridge::new(&broker.url(), &broker.url(), dir.path(), &["out"]);
    let agent = bridge.start_agent().await?;
    let cp = ControlPlane::start(None).await?;

    let from_agent = answers(dlq_client(&agent).await?).await?;
    let from_cp = answers(DlqServiceClient::new(cp.channel().await?)).await?;
    assert_eq!(from_agent, from_cp);
    let page = DEFAULT_PAGE_SIZE as usize;
    assert_eq!(from_cp.empty_redrive.0, Code::InvalidArgument);
    assert!(
        from_cp
            .empty_redrive
            .1
            .starts_with("filter: an empty filter is refused for a redrive"),
        "{:?}",
        from_cp.empty_redrive
    );
    assert_eq!(from_cp.default_redrive, (page, true));
    assert_eq!(from_cp.default_page, (page, true));
    Ok(())
}
