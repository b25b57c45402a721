//! Leases (`LeaseService`): `ferryctl get leases`; and how one is shown.

use ferry_shared::api::v1 as pb;
use ferry_shared::auth::client::AuthChannel;
use pb::lease_service_client::LeaseServiceClient;
use serde::Serialize;

use crate::output::{self, Format, Row, timestamp};
use crate::paging::all_pages;

/// `ferryctl get leases`: every lease whose key starts with `prefix`, held or
/// not, with its fencing version.
pub async fn list(channel: AuthChannel, out: Format, prefix: String) -> anyhow::Result<()> {
    let client = LeaseServiceClient::new(channel);
    let leases = all_pages(|page_token| {
        let (mut client, key_prefix) = (client.clone(), prefix.clone());
        async move {
            client
                .list_leases(pb::ListLeasesRequest {
                    key_prefix,
                    page_size: 0,
                    page_token,
                })
                .await
        }
    })
    .await?;
    let rows: Vec<LeaseView> = leases.into_iter().map(Into::into).collect();
    output::list(out, &rows)
}

/// One lease.
#[derive(Debug, Serialize)]
struct LeaseView {
    key: String,
    holder: String,
    version: u64,
    expires_at: String,
    acquired_at: String,
}

impl From<pb::Lease> for LeaseView {
    fn from(l: pb::Lease) -> Self {
        LeaseView {
            key: l.key,
            holder: l.holder,
            version: l.version,
            expires_at: timestamp(l.expires_at.as_ref()),
            acquired_at: timestamp(l.acquired_at.as_ref()),
        }
    }
}

impl Row for LeaseView {
    const HEADERS: &'static [&'static str] = &["KEY", "HOLDER", "VERSION", "EXPIRES"];
    fn cells(&self) -> Vec<String> {
        vec![
            self.key.clone(),
            self.holder.clone(),
            self.version.to_string(),
            self.expires_at.clone(),
        ]
    }
}
