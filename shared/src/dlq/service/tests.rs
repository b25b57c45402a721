//! Every check and rule of the service, once, over an in-memory backend.

use std::collections::BTreeMap;
use std::sync::Mutex;

use tonic::Code;

use super::*;
use crate::dlq::backend::DlqPage;
use crate::dlq::{DEFAULT_PAGE_SIZE, DlqReason, DlqStat, MAX_PAGE_SIZE};

/// Entries by id (listed in id order); routes named `unroutable` have no
/// runner, bindings named `refusing` refuse every redelivery.
#[derive(Default)]
struct Memory {
    entries: Mutex<BTreeMap<String, pb::DlqEntry>>,
    /// The page sizes the service asked for.
    sizes: Mutex<Vec<u32>>,
    /// Ids redelivered.
    redriven: Mutex<Vec<String>>,
    /// Deletes fail with `Unavailable`.
    broken_delete: bool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().expect("not poisoned")
}

fn selects(f: &DlqFilter, e: &pb::DlqEntry) -> bool {
    let at = e
        .dead_lettered_at
        .and_then(|t| SystemTime::try_from(t).ok())
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let reason = DlqReason::from_code(e.reason).unwrap_or(DlqReason::Expired);
    f.matches(&e.bridge_id, &e.route_id, &e.binding_id, reason, at)
}

#[tonic::async_trait]
impl DlqBackend for Memory {
    async fn write(&self, entry: pb::DlqEntry) -> Result<bool, DlqBackendError> {
        let mut entries = lock(&self.entries);
        if entries.contains_key(&entry.id) {
            return Ok(false);
        }
        entries.insert(entry.id.clone(), entry);
        Ok(true)
    }

    async fn list(
        &self,
        filter: &DlqFilter,
        size: u32,
        token: Option<String>,
    ) -> Result<DlqPage, DlqBackendError> {
        lock(&self.sizes).push(size);
        let entries = lock(&self.entries);
        let mut matching = entries
            .values()
            .filter(|e| token.as_ref().is_none_or(|t| &e.id > t) && selects(filter, e));
        let page: Vec<_> = matching.by_ref().take(size as usize).cloned().collect();
        let next_page_token = matching.next().and(page.last()).map(|last| last.id.clone());
        Ok(DlqPage {
            entries: page,
            next_page_token,
        })
    }

    async fn get(&self, id: &str) -> Result<pb::DlqEntry, DlqBackendError> {
        lock(&self.entries)
            .get(id)
            .cloned()
            .ok_or_else(|| DlqBackendError::NotFound(format!("dead letter {id:?} not found")))
    }

    async fn delete(&self, id: &str) -> Result<(), DlqBackendError> {
        if self.broken_delete {
            return Err(DlqBackendError::Unavailable("store down".into()));
        }
        lock(&self.entries)
            .remove(id)
            .map(drop)
            .ok_or_else(|| DlqBackendError::NotFound(format!("dead letter {id:?} not found")))
    }

    async fn purge(&self, filter: &DlqFilter) -> Result<u64, DlqBackendError> {
        let mut entries = lock(&self.entries);
        let before = entries.len();
        entries.retain(|_, e| !selects(filter, e));
        Ok((before - entries.len()) as u64)
    }

    async fn stats(&self, filter: &DlqFilter) -> Result<Vec<DlqStat>, DlqBackendError> {
        let mut rows: BTreeMap<(String, String, String), DlqStat> = BTreeMap::new();
        for e in lock(&self.entries).values().filter(|e| selects(filter, e)) {
            let key = (
                e.bridge_id.clone(),
                e.route_id.clone(),
                e.binding_id.clone(),
            );
            rows.entry(key)
                .or_insert_with(|| DlqStat {
                    bridge_id: e.bridge_id.clone(),
                    route_id: e.route_id.clone(),
                    binding_id: e.binding_id.clone(),
                    reason: DlqReason::Expired,
                    count: 0,
                    oldest: SystemTime::UNIX_EPOCH,
                })
                .count += 1;
        }
        Ok(rows.into_values().collect())
    }

    async fn redrive(&self, entry: &pb::DlqEntry) -> Result<(), RedriveError> {
        if entry.route_id == "unroutable" {
            return Err(RedriveError::Unroutable(format!(
                "no connected agent runs route {:?}",
                entry.route_id
            )));
        }
        if entry.binding_id == "refusing" {
            return Err(RedriveError::Failed("the binding refused it".into()));
        }
        lock(&self.redriven).push(entry.id.clone());
        Ok(())
    }
}

fn entry(id: &str, route: &str, binding: &str) -> pb::DlqEntry {
    pb::DlqEntry {
        id: id.into(),
        bridge_id: "b".into(),
        route_id: route.into(),
        binding_id: binding.into(),
        envelope: Some(pb::Envelope {
            id: format!("m-{id}"),
            payload: b"payload".to_vec(),
            ..Default::default()
        }),
        reason: DlqReason::PermanentError.code(),
        ..Default::default()
    }
}

/// A service over `memory`, with `count` entries `e000`.. on route `r`,
/// binding `x`.
async fn service(memory: Memory, count: usize) -> (DlqServer, Arc<Memory>) {
    let memory = Arc::new(memory);
    let service = DlqServer::new(memory.clone());
    for i in 0..count {
        write(&service, entry(&format!("e{i:03}"), "r", "x"))
            .await
            .expect("written");
    }
    (service, memory)
}

async fn write(service: &DlqServer, e: pb::DlqEntry) -> Result<bool, Status> {
    let request = Request::new(pb::WriteDlqEntryRequest { entry: Some(e) });
    Ok(service.write_dlq_entry(request).await?.into_inner().created)
}

async fn redrive(
    service: &DlqServer,
    ids: &[&str],
    filter: pb::DlqFilter,
    limit: u32,
) -> Result<pb::RedriveDlqEntriesResponse, Status> {
    let request = Request::new(pb::RedriveDlqEntriesRequest {
        ids: ids.iter().map(|&id| id.to_owned()).collect(),
        filter: Some(filter),
        limit,
    });
    Ok(service.redrive_dlq_entries(request).await?.into_inner())
}

fn by_route(route: &str) -> pb::DlqFilter {
    pb::DlqFilter {
        route_id: route.into(),
        ..Default::default()
    }
}

fn outcomes(r: &pb::RedriveDlqEntriesResponse) -> Vec<(&str, bool)> {
    r.outcomes.iter().map(|o| (o.id.as_str(), o.ok)).collect()
}

#[tokio::test]
async fn write_checks_the_entry_stamps_the_time_and_is_idempotent() {
    let (service, memory) = service(Memory::default(), 0).await;
    let no_binding = pb::DlqEntry {
        binding_id: String::new(),
        ..entry("a", "r", "x")
    };
    let refused = write(&service, no_binding).await.expect_err("refused");
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert_eq!(refused.message(), "entry.binding_id: must not be empty");
    let bad_time = pb::DlqEntry {
        first_attempt_at: Some(prost_types::Timestamp {
            seconds: i64::MIN,
            nanos: 0,
        }),
        ..entry("a", "r", "x")
    };
    let refused = write(&service, bad_time).await.expect_err("refused");
    assert!(refused.message().starts_with("entry.first_attempt_at: "));

    assert!(
        write(&service, entry("a", "r", "x"))
            .await
            .expect("written")
    );
    assert!(!write(&service, entry("a", "r", "x")).await.expect("kept"));
    let stored = lock(&memory.entries)["a"].clone();
    assert!(stored.dead_lettered_at.is_some(), "an unset time is now");
}

#[tokio::test]
async fn listings_use_the_default_and_maximum_page_sizes_and_omit_payloads() {
    let (service, memory) = service(Memory::default(), 150).await;
    let list = |page_size, page_token: &str, omit_payload| {
        service.list_dlq_entries(Request::new(pb::ListDlqEntriesRequest {
            filter: None,
            page_size,
            page_token: page_token.into(),
            omit_payload,
        }))
    };
    let first = list(0, "", true).await.expect("listed").into_inner();
    assert_eq!(first.entries.len(), DEFAULT_PAGE_SIZE as usize);
    assert!(
        first
            .entries
            .iter()
            .all(|e| e.envelope.as_ref().is_some_and(|m| m.payload.is_empty()))
    );
    let rest = list(0, &first.next_page_token, false)
        .await
        .expect("listed")
        .into_inner();
    assert_eq!(rest.entries.len(), 50);
    assert!(rest.next_page_token.is_empty());
    assert_eq!(
        rest.entries[0].envelope.as_ref().expect("set").payload,
        b"payload"
    );
    list(5000, "", false).await.expect("listed");
    assert_eq!(
        *lock(&memory.sizes),
        [DEFAULT_PAGE_SIZE, DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE]
    );
    let bad = service
        .list_dlq_entries(Request::new(pb::ListDlqEntriesRequest {
            filter: Some(pb::DlqFilter {
                reason: 42,
                ..Default::default()
            }),
            ..Default::default()
        }))
        .await
        .expect_err("refused");
    assert_eq!(bad.code(), Code::InvalidArgument);
}

#[tokio::test]
async fn get_and_delete_need_an_id_and_say_not_found() {
    let (service, _) = service(Memory::default(), 1).await;
    let get =
        |id: &str| service.get_dlq_entry(Request::new(pb::GetDlqEntryRequest { id: id.into() }));
    let delete = |id: &str| {
        service.delete_dlq_entry(Request::new(pb::DeleteDlqEntryRequest { id: id.into() }))
    };
    assert_eq!(
        get(" ").await.expect_err("refused").code(),
        Code::InvalidArgument
    );
    assert_eq!(
        delete("").await.expect_err("refused").code(),
        Code::InvalidArgument
    );
    assert_eq!(
        get("nope").await.expect_err("absent").code(),
        Code::NotFound
    );
    assert_eq!(
        delete("nope").await.expect_err("absent").code(),
        Code::NotFound
    );
    get("e000").await.expect("found");
    delete("e000").await.expect("deleted");
    assert_eq!(get("e000").await.expect_err("gone").code(), Code::NotFound);
}

#[tokio::test]
async fn purge_needs_confirm_and_an_empty_filter_purges_everything() {
    let (service, memory) = service(Memory::default(), 3).await;
    write(&service, entry("other", "r2", "x"))
        .await
        .expect("written");
    let purge = |filter, confirm| {
        service.purge_dlq_entries(Request::new(pb::PurgeDlqEntriesRequest { filter, confirm }))
    };
    let refused = purge(None, false).await.expect_err("refused");
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(refused.message().starts_with("confirm: "));
    assert_eq!(lock(&memory.entries).len(), 4, "nothing purged");
    let purged = purge(Some(by_route("r2")), true).await.expect("purged");
    assert_eq!(purged.into_inner().purged, 1);
    let purged = purge(None, true).await.expect("purged");
    assert_eq!(purged.into_inner().purged, 3);
}

#[tokio::test]
async fn stats_total_the_rows() {
    let (service, _) = service(Memory::default(), 3).await;
    write(&service, entry("other", "r2", "x"))
        .await
        .expect("written");
    let stats = service
        .get_dlq_stats(Request::new(pb::GetDlqStatsRequest { filter: None }))
        .await
        .expect("counted")
        .into_inner();
    assert_eq!((stats.stats.len(), stats.total), (2, 4));
}

#[tokio::test]
async fn a_redrive_needs_ids_or_a_filter() {
    let (service, memory) = service(Memory::default(), 3).await;
    let refused = redrive(&service, &[], pb::DlqFilter::default(), 0)
        .await
        .expect_err("refused");
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(
        refused
            .message()
            .starts_with("filter: an empty filter is refused")
    );
    let refused = redrive(&service, &["e000", " "], pb::DlqFilter::default(), 0)
        .await
        .expect_err("refused");
    assert_eq!(refused.message(), "ids[1]: must not be empty");
    assert!(lock(&memory.redriven).is_empty(), "nothing redriven");
}

#[tokio::test]
async fn a_redrive_deletes_only_what_was_redelivered_and_reports_the_rest() {
    let (service, memory) = service(Memory::default(), 1).await;
    write(&service, entry("refused", "r", "refusing"))
        .await
        .expect("written");
    write(&service, entry("stray", "unroutable", "x"))
        .await
        .expect("written");
    let response = redrive(
        &service,
        &["e000", "nope", "refused", "stray"],
        pb::DlqFilter::default(),
        0,
    )
    .await
    .expect("redriven");
    assert_eq!(
        outcomes(&response),
        [
            ("e000", true),
            ("nope", false),
            ("refused", false),
            ("stray", false)
        ]
    );
    assert!(response.outcomes[1].error.contains("not found"));
    assert_eq!(response.outcomes[2].error, "the binding refused it");
    assert!(response.outcomes[3].error.contains("no connected agent"));
    let kept: Vec<_> = lock(&memory.entries).keys().cloned().collect();
    assert_eq!(kept, ["refused", "stray"]);
}

#[tokio::test]
async fn a_redrive_that_routes_nothing_fails_the_call() {
    let (service, memory) = service(Memory::default(), 0).await;
    write(&service, entry("stray", "unroutable", "x"))
        .await
        .expect("written");
    let refused = redrive(&service, &[], by_route("unroutable"), 0)
        .await
        .expect_err("refused");
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert_eq!(
        refused.message(),
        "nothing redriven: no connected agent runs route \"unroutable\""
    );
    assert_eq!(lock(&memory.entries).len(), 1, "kept");
}

#[tokio::test]
async fn a_redrive_reports_an_entry_it_could_not_delete() {
    let broken = Memory {
        broken_delete: true,
        ..Memory::default()
    };
    let (service, memory) = service(broken, 1).await;
    let response = redrive(&service, &["e000"], pb::DlqFilter::default(), 0)
        .await
        .expect("redriven");
    assert_eq!(outcomes(&response), [("e000", false)]);
    assert!(
        response.outcomes[0]
            .error
            .starts_with("redelivered, but the entry could not be deleted"),
        "{}",
        response.outcomes[0].error
    );
    assert_eq!(*lock(&memory.redriven), ["e000"]);
}

#[tokio::test]
async fn a_redrive_takes_the_default_limit_and_says_when_it_truncated() {
    let (service, memory) = service(Memory::default(), 150).await;
    let response = redrive(&service, &[], by_route("r"), 0)
        .await
        .expect("redriven");
    assert_eq!(response.outcomes.len(), DEFAULT_PAGE_SIZE as usize);
    assert!(response.truncated);
    assert_eq!(lock(&memory.entries).len(), 50);
    let response = redrive(
        &service,
        &["e100", "e101", "e102"],
        pb::DlqFilter::default(),
        2,
    )
    .await
    .expect("redriven");
    assert_eq!(outcomes(&response), [("e100", true), ("e101", true)]);
    assert!(response.truncated);
    let response = redrive(&service, &[], by_route("r"), 5000)
        .await
        .expect("redriven");
    assert_eq!(response.outcomes.len(), 48);
    assert!(!response.truncated);
    assert_eq!(lock(&memory.sizes).last(), Some(&MAX_PAGE_SIZE));
}

#[tokio::test]
async fn redrive_delete_and_purge_each_write_one_audit_event() {
    let (captured, _guard) = crate::audit::capture::start();
    let (service, _memory) = service(Memory::default(), 3).await;
    let request = as_alice(pb::RedriveDlqEntriesRequest {
        ids: vec!["e000".into()],
        filter: None,
        limit: 0,
    });
    service
        .redrive_dlq_entries(request)
        .await
        .expect("redriven");
    let request = as_alice(pb::DeleteDlqEntryRequest { id: "e001".into() });
    service.delete_dlq_entry(request).await.expect("deleted");
    let refused = service
        .purge_dlq_entries(Request::new(pb::PurgeDlqEntriesRequest {
            filter: Some(pb::DlqFilter {
                bridge_id: "b".into(),
                ..by_route("r")
            }),
            confirm: false,
        }))
        .await;
    assert!(refused.is_err());
    service
        .purge_dlq_entries(Request::new(pb::PurgeDlqEntriesRequest {
            filter: Some(by_route("r")),
            confirm: true,
        }))
        .await
        .expect("purged");
    // Reads and agents' writes are not audited.
    write(&service, entry("e009", "r", "x"))
        .await
        .expect("written");
    get_dlq_stats(&service).await;

    let events = captured.events();
    let summary: Vec<[&str; 5]> = events
        .iter()
        .map(|e| {
            [
                e["action"].as_str(),
                e["principal"].as_str(),
                e["bridge"].as_str(),
                e["subject"].as_str(),
                e["outcome"].as_str(),
            ]
        })
        .collect();
    assert_eq!(
        summary,
        [
            [
                "dlq.redrive",
                "alice",
                "",
                "ids e000: 1 redriven, 0 failed",
                "ok"
            ],
            ["dlq.delete", "alice", "", "id e001", "ok"],
            [
                "dlq.purge",
                "unauthenticated",
                "b",
                "filter bridge=b route=r",
                "error: InvalidArgument: confirm: must be true; a purge deletes entries for good"
            ],
            [
                "dlq.purge",
                "unauthenticated",
                "",
                "filter route=r: 1 purged",
                "ok"
            ],
        ]
    );
    assert!(
        events
            .iter()
            .all(|e| !e["role"].is_empty() && e.contains_key("client"))
    );
}

/// A request the authentication layer attributed to operator `alice`.
fn as_alice<T>(message: T) -> Request<T> {
    let mut request = Request::new(message);
    request.extensions_mut().insert(crate::auth::Principal {
        name: "alice".into(),
        role: crate::auth::Role::Operator,
        agent_id: None,
    });
    request
}

async fn get_dlq_stats(service: &DlqServer) {
    service
        .get_dlq_stats(Request::new(pb::GetDlqStatsRequest { filter: None }))
        .await
        .expect("stats");
}
