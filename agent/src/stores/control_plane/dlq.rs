//! [`DlqStore`] over the control plane's `DlqService`. `put` returns only
//! after `WriteDlqEntry` answered OK, which the control plane sends once the
//! entry is durable: a dead letter is never settled on an unconfirmed write.

use ferry_shared::api::v1 as pb;
use ferry_shared::auth::client::{AuthChannel, ClientAuth};
use ferry_shared::config::store::ControlPlaneOptions;
use pb::dlq_service_client::DlqServiceClient;

use super::{Service, channel, store_error, time};
use crate::stores::{
    BoxFuture, DlqEntry, DlqFilter, DlqPage, DlqReason, DlqStat, DlqStats, DlqStore, PageRequest,
    StoreError, StoreResult,
};

/// Dead letters kept by the control plane.
#[derive(Clone, Debug)]
pub struct ControlPlaneDlqStore {
    client: DlqServiceClient<AuthChannel>,
}

impl ControlPlaneDlqStore {
    /// A store over the endpoint of `options`; connects on first use.
    /// `Invalid` when the endpoint is unset or malformed.
    pub fn open(options: &ControlPlaneOptions, client: &ClientAuth) -> StoreResult<Self> {
        Ok(Self {
            client: DlqServiceClient::new(channel("dlq", options, client)?),
        })
    }
}

fn err(status: tonic::Status) -> StoreError {
    store_error(Service::Dlq, &status)
}

/// An entry the control plane returned; one that does not decode is corrupt.
fn entry(e: Option<pb::DlqEntry>) -> StoreResult<DlqEntry> {
    let e = e.ok_or_else(|| StoreError::Corrupt("control plane: entry missing".into()))?;
    DlqEntry::try_from(e).map_err(|e| StoreError::Corrupt(format!("control plane: {e}")))
}

fn stat(s: pb::DlqStat) -> StoreResult<DlqStat> {
    Ok(DlqStat {
        reason: DlqReason::from_code(s.reason).ok_or_else(|| {
            StoreError::Corrupt(format!("control plane: unknown dlq reason {}", s.reason))
        })?,
        oldest: time("stat.oldest", s.oldest)?,
        bridge_id: s.bridge_id,
        route_id: s.route_id,
        binding_id: s.binding_id,
        count: s.count,
    })
}

impl DlqStore for ControlPlaneDlqStore {
    fn put(&self, e: DlqEntry) -> BoxFuture<'_, StoreResult<bool>> {
        Box::pin(async move {
            // Refused here, not retried against an unreachable control plane.
            e.validate()?;
            let request = pb::WriteDlqEntryRequest {
                entry: Some(pb::DlqEntry::from(&e)),
            };
            let response = self
                .client
                .clone()
                .write_dlq_entry(request)
                .await
                .map_err(err)?;
            Ok(response.into_inner().created)
        })
    }

    fn list<'a>(
        &'a self,
        filter: &'a DlqFilter,
        page: PageRequest,
    ) -> BoxFuture<'a, StoreResult<DlqPage>> {
        Box::pin(async move {
            let request = pb::ListDlqEntriesRequest {
                filter: Some(pb::DlqFilter::from(filter)),
                page_size: u32::try_from(page.size).unwrap_or(u32::MAX),
                page_token: page.token.unwrap_or_default(),
                omit_payload: false,
            };
            let response = self
                .client
                .clone()
                .list_dlq_entries(request)
                .await
                .map_err(err)?
                .into_inner();
            Ok(DlqPage {
                entries: response
                    .entries
                    .into_iter()
                    .map(|e| entry(Some(e)))
                    .collect::<StoreResult<_>>()?,
                next_page_token: Some(response.next_page_token).filter(|t| !t.is_empty()),
            })
        })
    }

    fn get<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<DlqEntry>> {
        Box::pin(async move {
            let request = pb::GetDlqEntryRequest { id: id.to_owned() };
            let response = self
                .client
                .clone()
                .get_dlq_entry(request)
                .await
                .map_err(err)?;
            entry(response.into_inner().entry)
        })
    }

    fn delete<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(async move {
            let request = pb::DeleteDlqEntryRequest { id: id.to_owned() };
            self.client
                .clone()
                .delete_dlq_entry(request)
                .await
                .map_err(err)?;
            Ok(())
        })
    }

    fn purge<'a>(&'a self, filter: &'a DlqFilter) -> BoxFuture<'a, StoreResult<u64>> {
        Box::pin(async move {
            let request = pb::PurgeDlqEntriesRequest {
                filter: Some(pb::DlqFilter::from(filter)),
                confirm: true,
            };
            let response = self
                .client
                .clone()
                .purge_dlq_entries(request)
                .await
                .map_err(err)?;
            Ok(response.into_inner().purged)
        })
    }

    fn stats<'a>(&'a self, filter: &'a DlqFilter) -> BoxFuture<'a, StoreResult<DlqStats>> {
        Box::pin(async move {
            let request = pb::GetDlqStatsRequest {
                filter: Some(pb::DlqFilter::from(filter)),
            };
            let response = self
                .client
                .clone()
                .get_dlq_stats(request)
                .await
                .map_err(err)?
                .into_inner();
            let mut rows = response
                .stats
                .into_iter()
                .map(stat)
                .collect::<StoreResult<Vec<_>>>()?;
            // The control plane orders reasons by name; the trait by reason.
            rows.sort_by(|a, b| {
                (&a.bridge_id, &a.route_id, &a.binding_id, a.reason).cmp(&(
                    &b.bridge_id,
                    &b.route_id,
                    &b.binding_id,
                    b.reason,
                ))
            });
            Ok(DlqStats {
                rows,
                total: response.total,
            })
        })
    }
}
