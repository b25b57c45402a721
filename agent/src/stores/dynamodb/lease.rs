//! The DynamoDB lease store: an item per key, never deleted, so its version
//! only grows, across releases, restarts and agents.
//!
//! Every call reads the key's item (strongly consistent), decides with the
//! shared rules ([`ferry_shared::lease`]) and writes the result on the
//! condition that the item is still what it read: absent, or at the same
//! `rev`, a counter every write raises. Of two agents acquiring one key at
//! once, one write fails its condition; that agent reads again and decides
//! on the winner's grant: at most one unexpired holder, and every grant at
//! `last version + 1`. A decision that changes nothing (held by another, a
//! repeated release) writes nothing.

use std::time::{Duration, SystemTime};

use super::{DynamoDbOptions, Item, Table, condition_failed, get_n, get_s, n, opt_n, opt_s, s};
use crate::stores::lease::{self, Grant, LeaseState};
use crate::stores::{
    Acquired, BoxFuture, Lease, LeaseStore, StoreResult, from_unix_nanos, unix_nanos,
};

/// Leases in a DynamoDB table.
pub struct DynamoDbLeaseStore {
    table: Table,
    options: DynamoDbOptions,
}

impl DynamoDbLeaseStore {
    /// Opens the store with a client from the standard credential chain.
    pub async fn open(options: DynamoDbOptions) -> StoreResult<Self> {
        let client = options.client().await;
        Self::open_with(client, options).await
    }

    /// Opens the store with `client`.
    pub async fn open_with(
        client: aws_sdk_dynamodb::Client,
        options: DynamoDbOptions,
    ) -> StoreResult<Self> {
        let table = Table::open(client, &options, false).await?;
        Ok(DynamoDbLeaseStore { table, options })
    }

    /// The options it was opened with.
    pub fn options(&self) -> &DynamoDbOptions {
        &self.options
    }

    /// The client it uses.
    pub fn client(&self) -> &aws_sdk_dynamodb::Client {
        &self.table.client
    }
}

/// A key's state and the `rev` it was read at.
fn decode(item: &Item) -> StoreResult<(LeaseState, u64)> {
    let grant = match (
        opt_s(item, "holder")?,
        opt_n::<i64>(item, "acquired_at")?,
        opt_n::<i64>(item, "expires_at")?,
    ) {
        (Some(holder), Some(acquired), Some(expires)) => Some(Grant {
            holder,
            acquired_at: from_unix_nanos(acquired)?,
            expires_at: from_unix_nanos(expires)?,
        }),
        _ => None,
    };
    let state = LeaseState {
        key: get_s(item, "pk")?,
        version: get_n(item, "version")?,
        grant,
    };
    Ok((state, get_n(item, "rev")?))
}

fn encode(state: &LeaseState, rev: u64) -> StoreResult<Item> {
    let mut item = Item::from([
        ("pk".to_owned(), s(&state.key)),
        ("version".to_owned(), n(state.version)),
        ("rev".to_owned(), n(rev)),
    ]);
    if let Some(g) = &state.grant {
        item.insert("holder".to_owned(), s(&g.holder));
        item.insert("acquired_at".to_owned(), n(unix_nanos(g.acquired_at)?));
        item.insert("expires_at".to_owned(), n(unix_nanos(g.expires_at)?));
    }
    Ok(item)
}

impl DynamoDbLeaseStore {
    /// Runs a shared rule on `key`'s current state and stores the result on
    /// the condition that the state is unchanged; reads again when it was
    /// not.
    async fn apply<T, R>(&self, key: &str, rule: R) -> StoreResult<T>
    where
        R: Fn(Option<LeaseState>) -> StoreResult<(LeaseState, T)>,
    {
        let mut attempt = 0;
        loop {
            let read = self
                .table
                .client
                .get_item()
                .table_name(&self.table.name)
                .key("pk", s(key))
                .consistent_read(true)
                .send()
                .await
                .map_err(|e| self.table.error("GetItem", &e))?;
            let (current, rev) = match read.item() {
                Some(item) => {
                    let (state, rev) = decode(item)?;
                    (Some(state), Some(rev))
                }
                None => (None, None),
            };
            let (state, out) = rule(current.clone())?;
            if current.as_ref() == Some(&state) {
                return Ok(out);
            }
            let write = self
                .table
                .client
                .put_item()
                .table_name(&self.table.name)
                .set_item(Some(encode(&state, rev.map_or(1, |r| r + 1))?));
            let write = match rev {
                Some(rev) => write
                    .condition_expression("rev = :rev")
                    .expression_attribute_values(":rev", n(rev)),
                None => write.condition_expression("attribute_not_exists(pk)"),
            };
            match write.send().await {
                Ok(_) => return Ok(out),
                Err(e) if condition_failed(&e) => {
                    attempt += 1;
                    self.table
                        .pause(attempt, &format!("lease {key} changed while deciding"))
                        .await?;
                }
                Err(e) => return Err(self.table.error("PutItem", &e)),
            }
        }
    }
}

impl LeaseStore for DynamoDbLeaseStore {
    fn acquire<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        ttl: Duration,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Acquired>> {
        Box::pin(self.apply(key, move |current| {
            lease::acquire(current, key, holder, ttl, now)
        }))
    }

    fn renew<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
        ttl: Duration,
        now: SystemTime,
    ) -> BoxFuture<'a, StoreResult<Lease>> {
        Box::pin(self.apply(key, move |current| {
            lease::renew(current, key, holder, version, ttl, now)
        }))
    }

    fn release<'a>(
        &'a self,
        key: &'a str,
        holder: &'a str,
        version: u64,
    ) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(self.apply(key, move |current| {
            lease::release(current, key, holder, version).map(|state| (state, ()))
        }))
    }

    fn list(&self) -> BoxFuture<'_, StoreResult<Vec<LeaseState>>> {
        Box::pin(async move {
            let mut states = self
                .table
                .scan_all()
                .await?
                .iter()
                .map(|item| decode(item).map(|(state, _)| state))
                .collect::<StoreResult<Vec<_>>>()?;
            // Byte order, as every backend lists keys.
            states.sort_unstable_by(|a, b| a.key.as_bytes().cmp(b.key.as_bytes()));
            Ok(states)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::stores::conformance::{dynamodb_table, t};

    /// Agents acquiring one free key at once: exactly one is granted, and
    /// the others see its grant (the `rev` condition decides the race).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn agents_racing_for_a_key_get_one_grant() {
        let (client, options) = dynamodb_table("lease").await;
        let mut stores = Vec::new();
        for _ in 0..4 {
            let store = DynamoDbLeaseStore::open_with(client.clone(), options.clone())
                .await
                .expect("open");
            stores.push(Arc::new(store));
        }
        let calls: Vec<_> = stores
            .iter()
            .enumerate()
            .map(|(i, store)| {
                let store = Arc::clone(store);
                tokio::spawn(async move {
                    store
                        .acquire("k", &format!("agent-{i}"), Duration::from_secs(10), t(0))
                        .await
                })
            })
            .collect();
        let mut granted = Vec::new();
        for call in calls {
            match call.await.expect("task").expect("acquire") {
                Acquired::Granted(lease) => granted.push(lease),
                Acquired::HeldByOther(lease) => assert_eq!(lease.version, 1),
            }
        }
        assert_eq!(granted.len(), 1, "{granted:?}");
        assert_eq!(granted[0].version, 1);
    }
}
