//! The DynamoDB DLQ: an item per entry, keyed by its id.
//!
//! A put is `PutItem` on the condition that the id is not stored yet, so a
//! repeated put (a retry after a lost answer) stores the entry once. Lists,
//! purges and counts read the whole table (a consistent `Scan`) and select
//! in memory with the same code as the memory store: a DLQ is meant to stay
//! small, and a secondary index would be eventually consistent anyway
//! (ADR 0014). A purge deletes in `BatchWriteItem`s.

use aws_sdk_dynamodb::types::{DeleteRequest, WriteRequest};

use super::{
    DynamoDbOptions, Item, Table, b, build_error, check_size, condition_failed, get_b, n, s,
};
use crate::stores::dlq::{page_of, stats_of};
use crate::stores::{
    BoxFuture, DlqEntry, DlqFilter, DlqPage, DlqStats, DlqStore, PageRequest, StoreError,
    StoreResult, unix_nanos,
};

/// Dead letters in a DynamoDB table.
pub struct DynamoDbDlqStore {
    table: Table,
    options: DynamoDbOptions,
}

impl DynamoDbDlqStore {
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
        Ok(DynamoDbDlqStore { table, options })
    }

    /// The options it was opened with.
    pub fn options(&self) -> &DynamoDbOptions {
        &self.options
    }

    /// The client it uses.
    pub fn client(&self) -> &aws_sdk_dynamodb::Client {
        &self.table.client
    }

    /// Every entry, in listing order (`dead_lettered_at`, then id).
    async fn all(&self) -> StoreResult<Vec<DlqEntry>> {
        let mut entries = self
            .table
            .scan_all()
            .await?
            .iter()
            .map(decode)
            .collect::<StoreResult<Vec<_>>>()?;
        entries
            .sort_unstable_by(|a, b| (a.dead_lettered_at, &a.id).cmp(&(b.dead_lettered_at, &b.id)));
        Ok(entries)
    }
}

fn decode(item: &Item) -> StoreResult<DlqEntry> {
    DlqEntry::decode(&get_b(item, "entry")?)
}

fn encode(entry: &DlqEntry) -> StoreResult<Item> {
    Ok(Item::from([
        ("pk".to_owned(), s(&entry.id)),
        ("entry".to_owned(), b(entry.encode())),
        ("bridge_id".to_owned(), s(&entry.bridge_id)),
        ("route_id".to_owned(), s(&entry.route_id)),
        ("binding_id".to_owned(), s(&entry.binding_id)),
        ("reason".to_owned(), n(entry.reason.code())),
        (
            "dead_lettered_at".to_owned(),
            n(unix_nanos(entry.dead_lettered_at)?),
        ),
    ]))
}

impl DlqStore for DynamoDbDlqStore {
    fn put(&self, entry: DlqEntry) -> BoxFuture<'_, StoreResult<bool>> {
        Box::pin(async move {
            entry.validate()?;
            let item = encode(&entry)?;
            check_size(&item, &format!("dlq entry {}", entry.id))?;
            let put = self
                .table
                .client
                .put_item()
                .table_name(&self.table.name)
                .set_item(Some(item))
                .condition_expression("attribute_not_exists(pk)")
                .send()
                .await;
            match put {
                Ok(_) => Ok(true),
                Err(e) if condition_failed(&e) => Ok(false),
                Err(e) => Err(self.table.error("PutItem", &e)),
            }
        })
    }

    fn list<'a>(
        &'a self,
        filter: &'a DlqFilter,
        page: PageRequest,
    ) -> BoxFuture<'a, StoreResult<DlqPage>> {
        Box::pin(async move {
            // A bad token is refused before the table is read.
            page.after()?;
            page_of(self.all().await?.iter(), filter, &page)
        })
    }

    fn get<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<DlqEntry>> {
        Box::pin(async move {
            let out = self
                .table
                .client
                .get_item()
                .table_name(&self.table.name)
                .key("pk", s(id))
                .consistent_read(true)
                .send()
                .await
                .map_err(|e| self.table.error("GetItem", &e))?;
            match out.item() {
                Some(item) => decode(item),
                None => Err(StoreError::NotFound(format!("dlq entry {id}"))),
            }
        })
    }

    fn delete<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(async move {
            let deleted = self
                .table
                .client
                .delete_item()
                .table_name(&self.table.name)
                .key("pk", s(id))
                .condition_expression("attribute_exists(pk)")
                .send()
                .await;
            match deleted {
                Ok(_) => Ok(()),
                Err(e) if condition_failed(&e) => {
                    Err(StoreError::NotFound(format!("dlq entry {id}")))
                }
                Err(e) => Err(self.table.error("DeleteItem", &e)),
            }
        })
    }

    fn purge<'a>(&'a self, filter: &'a DlqFilter) -> BoxFuture<'a, StoreResult<u64>> {
        Box::pin(async move {
            let doomed = self
                .all()
                .await?
                .into_iter()
                .filter(|e| e.matches(filter))
                .map(|e| {
                    let delete = DeleteRequest::builder()
                        .key("pk", s(e.id))
                        .build()
                        .map_err(build_error)?;
                    Ok(WriteRequest::builder().delete_request(delete).build())
                })
                .collect::<StoreResult<Vec<_>>>()?;
            let count = doomed.len() as u64;
            self.table.write_many(doomed).await?;
            Ok(count)
        })
    }

    fn stats<'a>(&'a self, filter: &'a DlqFilter) -> BoxFuture<'a, StoreResult<DlqStats>> {
        Box::pin(async move { Ok(stats_of(self.all().await?.iter(), filter)) })
    }
}
