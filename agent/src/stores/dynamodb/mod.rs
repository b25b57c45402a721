//! DynamoDB backends: stores that several agents share, each on a table of
//! its own (`docs/adr/0014-dynamodb-stores.md`).
//!
//! # Tables
//!
//! Every table has the partition key `pk` (string); the outbox's also has
//! the sort key `sk` (number). Attribute names are spelled out below and in
//! `docs/configuration.md`; times are nanoseconds since the Unix epoch
//! (numbers, exact round trips), envelopes and dead letters their binary
//! encodings.
//!
//! - **Outbox** (`pk`, `sk`), per partition `P` (`{bridge}/{route}`):
//!   - `pk = "r:P", sk = 0`: the *fence* item, `hwm` (the fencing
//!     high-water mark);
//!   - `pk = "r:P", sk = seq ≥ 1`: a *record* item per (message, binding):
//!     `msg` / `msg_last` (its message's first and last seq), `id`,
//!     `binding`, `address`, `created_at`, `expires_at`?, the claim
//!     `claim_version`? / `claim_owner`? / `claimed_at`?, `replay_count`,
//!     `first_attempt_at`?, `last_error`?;
//!   - `pk = "m:P", sk = 0`: the *counter* item, `last_seq`;
//!   - `pk = "m:P", sk = first seq ≥ 1`: a *message* item, `last_seq` and
//!     `envelope`: the envelope stored once per message (ADR 0007).
//!
//!   The fixed two-character prefixes keep records and messages of one
//!   partition under their own keys whatever the partition's name, and keep
//!   the counter (written by appends) apart from the fence (read by every
//!   drain call).
//! - **Lease** (`pk` = the lease key): `version`, `rev`, `holder`?,
//!   `acquired_at`?, `expires_at`?.
//! - **DLQ** (`pk` = the entry id): `entry` (the encoded entry) and, for
//!   operators, `bridge_id`, `route_id`, `binding_id`, `reason`,
//!   `dead_lettered_at`.
//!
//! # Invariants
//!
//! 1. **Tables at open.** A store checks that its table exists with its key
//!    schema; with `create_tables` it creates a missing one (on-demand
//!    billing) and waits until it is `ACTIVE`. A missing table otherwise, or
//!    one with another key schema, is `Invalid`, naming the fix.
//! 2. **Every change is a conditional write** whose condition is the state
//!    the store decided on, so that of two agents deciding on the same
//!    state one wins and the other reads again: single items with
//!    `ConditionExpression`, several at once with `TransactWriteItems`
//!    (at most [`MAX_TRANSACTION`] actions, all or nothing, with a client
//!    request token so that the SDK's own retry of a call that did apply is
//!    answered as applied). A lost race is retried from a fresh read a
//!    bounded number of times, with backoff.
//! 3. **Reads that decide are strongly consistent** (`ConsistentRead`).
//! 4. **Errors say what is known.** A call that timed out is `Timeout`;
//!    throttling, 5xx, an unreachable endpoint, refused credentials and a
//!    vanished table are `Unavailable` (the outcome is unknown to the
//!    caller, which keeps its source unacknowledged or its record claimed);
//!    a request the service calls malformed is `Invalid`. An item that
//!    cannot fit the service's 400 KB limit is refused as `Invalid`
//!    ("oversized") before anything is written.
//! 5. The outbox ([`outbox`]) and the lease store ([`lease`]) state how they
//!    keep the stores' invariants (`crate::stores`) under concurrent agents.

mod dlq;
mod lease;
mod outbox;

pub use dlq::DynamoDbDlqStore;
pub use lease::DynamoDbLeaseStore;
pub use outbox::DynamoDbOutboxStore;

use std::collections::HashMap;
use std::error::Error;
use std::fmt::Display;
use std::str::FromStr;
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError;
use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType, KeysAndAttributes,
    ScalarAttributeType, TableStatus, TransactWriteItem, WriteRequest,
};

use super::{StoreError, StoreResult};
use crate::transports::aws::error::classify;
use crate::transports::aws::session::sdk_config;

/// Actions in one `TransactWriteItems` at most: the limit moto enforces
/// (AWS accepts 100 since 2022; 25 works on both, ADR 0014).
pub(crate) const MAX_TRANSACTION: usize = 25;
/// Requests in one `BatchWriteItem` at most.
const MAX_BATCH_WRITE: usize = 25;
/// Keys in one `BatchGetItem` at most.
const MAX_BATCH_GET: usize = 100;
/// The service's limit on one item's size (names and values).
pub(crate) const MAX_ITEM_BYTES: usize = 400 * 1024;
/// Bound of one call attempt.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long opening waits for a table to become active.
const ACTIVE_TIMEOUT: Duration = Duration::from_secs(120);
/// How often a decision that keeps losing races is taken again
/// (invariant 2), and how often unprocessed batch items are sent again.
pub(crate) const MAX_ATTEMPTS: u32 = 10;

/// An item: attribute name to value.
pub(crate) type Item = HashMap<String, AttributeValue>;

/// How to open a DynamoDB store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DynamoDbOptions {
    /// The store's table.
    pub table_name: String,
    /// Region; `None`: the SDK's region chain.
    pub region: Option<String>,
    /// Endpoint override (an emulator).
    pub endpoint_url: Option<String>,
    /// Create the table when it is missing (invariant 1).
    pub create_tables: bool,
    /// Outbox only: how old an owner's claim must be before `claim` gives it
    /// back to the same owner (default 30 s).
    pub stale_claim_duration: Duration,
}

impl DynamoDbOptions {
    /// Options for `table_name` with the defaults.
    pub fn new(table_name: impl Into<String>) -> Self {
        DynamoDbOptions {
            table_name: table_name.into(),
            region: None,
            endpoint_url: None,
            create_tables: false,
            stale_claim_duration: Duration::from_secs(30),
        }
    }

    /// A client from the standard credential chain with `region` and
    /// `endpoint_url` on top (the AWS transports' configuration).
    pub async fn client(&self) -> Client {
        Client::new(
            &sdk_config(
                self.region.as_deref(),
                self.endpoint_url.as_deref(),
                ATTEMPT_TIMEOUT,
            )
            .await,
        )
    }
}

/// One store's table and the client that reaches it.
#[derive(Clone, Debug)]
pub(crate) struct Table {
    pub(crate) client: Client,
    pub(crate) name: String,
}

impl Table {
    /// Checks, or creates, the table with key `pk` (string) and, when
    /// `sorted`, sort key `sk` (number): invariant 1.
    pub(crate) async fn open(
        client: Client,
        options: &DynamoDbOptions,
        sorted: bool,
    ) -> StoreResult<Self> {
        let table = Table {
            client,
            name: options.table_name.clone(),
        };
        if table.name.is_empty() {
            return Err(StoreError::Invalid("empty table name".into()));
        }
        let described = table
            .client
            .describe_table()
            .table_name(&table.name)
            .send()
            .await;
        match described {
            Ok(out) => {
                let keys: Vec<(String, KeyType)> = out
                    .table()
                    .map(|t| t.key_schema())
                    .unwrap_or_default()
                    .iter()
                    .map(|k| (k.attribute_name().to_owned(), k.key_type().clone()))
                    .collect();
                let mut want = vec![("pk".to_owned(), KeyType::Hash)];
                if sorted {
                    want.push(("sk".to_owned(), KeyType::Range));
                }
                if keys != want {
                    return Err(StoreError::Invalid(format!(
                        "dynamodb table {} has the key schema {keys:?}, this store needs {want:?}: \
                         give each store a table of its own (docs/configuration.md)",
                        table.name
                    )));
                }
            }
            Err(e)
                if e.as_service_error()
                    .is_some_and(|s| s.is_resource_not_found_exception()) =>
            {
                if !options.create_tables {
                    return Err(StoreError::Invalid(format!(
                        "dynamodb table {} does not exist: create it (docs/configuration.md, \
                         \"dynamodb stores\") or set create_tables: true",
                        table.name
                    )));
                }
                table.create(sorted).await?;
            }
            Err(e) => return Err(table.error("DescribeTable", &e)),
        }
        table.wait_active().await?;
        Ok(table)
    }

    async fn create(&self, sorted: bool) -> StoreResult<()> {
        let mut keys = vec![key("pk", KeyType::Hash)?];
        let mut attributes = vec![attribute("pk", ScalarAttributeType::S)?];
        if sorted {
            keys.push(key("sk", KeyType::Range)?);
            attributes.push(attribute("sk", ScalarAttributeType::N)?);
        }
        let created = self
            .client
            .create_table()
            .table_name(&self.name)
            .billing_mode(BillingMode::PayPerRequest)
            .set_key_schema(Some(keys))
            .set_attribute_definitions(Some(attributes))
            .send()
            .await;
        match created {
            Ok(_) => {
                tracing::info!(table = %self.name, "created the DynamoDB table");
                Ok(())
            }
            // Another agent created it meanwhile.
            Err(e)
                if e.as_service_error()
                    .is_some_and(|s| s.is_resource_in_use_exception()) =>
            {
                Ok(())
            }
            Err(e) => Err(self.error("CreateTable", &e)),
        }
    }

    async fn wait_active(&self) -> StoreResult<()> {
        let started = Instant::now();
        loop {
            let out = self
                .client
                .describe_table()
                .table_name(&self.name)
                .send()
                .await
                .map_err(|e| self.error("DescribeTable", &e))?;
            if out.table().and_then(|t| t.table_status()) == Some(&TableStatus::Active) {
                return Ok(());
            }
            if started.elapsed() > ACTIVE_TIMEOUT {
                return Err(StoreError::Timeout(format!(
                    "dynamodb table {} is not active after {ACTIVE_TIMEOUT:?}",
                    self.name
                )));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Maps a failed call (invariant 4).
    pub(crate) fn error<E>(&self, operation: &str, e: &SdkError<E>) -> StoreError
    where
        E: ProvideErrorMetadata + Error + Send + Sync + 'static,
    {
        let classified = classify(operation, e);
        let text = format!("dynamodb table {}: {}", self.name, classified.error);
        if matches!(e, SdkError::TimeoutError(_)) {
            StoreError::Timeout(text)
        } else if matches!(
            classified.code.as_deref(),
            Some("ValidationException" | "SerializationException")
        ) {
            StoreError::Invalid(text)
        } else {
            StoreError::Unavailable(text)
        }
    }

    /// Runs `actions` as one transaction. `Ok(Err(codes))` when the service
    /// cancelled it: one reason code per action (`"None"` for those that
    /// did not cause it).
    pub(crate) async fn transact(
        &self,
        actions: Vec<TransactWriteItem>,
    ) -> StoreResult<Result<(), Vec<String>>> {
        let sent = self
            .client
            .transact_write_items()
            .set_transact_items(Some(actions))
            .client_request_token(uuid::Uuid::now_v7().to_string())
            .send()
            .await;
        match sent {
            Ok(_) => Ok(Ok(())),
            Err(e) => match e.as_service_error() {
                Some(TransactWriteItemsError::TransactionCanceledException(c)) => Ok(Err(c
                    .cancellation_reasons()
                    .iter()
                    .map(|r| r.code().unwrap_or("None").to_owned())
                    .collect())),
                _ => Err(self.error("TransactWriteItems", &e)),
            },
        }
    }

    /// Reads `keys` with strong consistency (unordered), sending unprocessed
    /// keys again with backoff.
    pub(crate) async fn get_many(&self, keys: Vec<Item>) -> StoreResult<Vec<Item>> {
        let mut found = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(MAX_BATCH_GET) {
            let mut pending = Some(
                KeysAndAttributes::builder()
                    .set_keys(Some(chunk.to_vec()))
                    .consistent_read(true)
                    .build()
                    .map_err(build_error)?,
            );
            let mut attempt = 0;
            while let Some(request) = pending.take() {
                let out = self
                    .client
                    .batch_get_item()
                    .request_items(&self.name, request)
                    .send()
                    .await
                    .map_err(|e| self.error("BatchGetItem", &e))?;
                if let Some(items) = out.responses().and_then(|r| r.get(&self.name)) {
                    found.extend(items.iter().cloned());
                }
                pending = out
                    .unprocessed_keys()
                    .and_then(|u| u.get(&self.name))
                    .filter(|k| !k.keys().is_empty())
                    .cloned();
                if pending.is_some() {
                    attempt += 1;
                    self.pause(attempt, "BatchGetItem left keys unprocessed")
                        .await?;
                }
            }
        }
        Ok(found)
    }

    /// Writes `requests` in batches, sending unprocessed ones again with
    /// backoff.
    pub(crate) async fn write_many(&self, requests: Vec<WriteRequest>) -> StoreResult<()> {
        for chunk in requests.chunks(MAX_BATCH_WRITE) {
            let mut pending = chunk.to_vec();
            let mut attempt = 0;
            while !pending.is_empty() {
                let out = self
                    .client
                    .batch_write_item()
                    .request_items(&self.name, pending)
                    .send()
                    .await
                    .map_err(|e| self.error("BatchWriteItem", &e))?;
                pending = out
                    .unprocessed_items()
                    .and_then(|u| u.get(&self.name))
                    .cloned()
                    .unwrap_or_default();
                if !pending.is_empty() {
                    attempt += 1;
                    self.pause(attempt, "BatchWriteItem left items unprocessed")
                        .await?;
                }
            }
        }
        Ok(())
    }

    /// Every item of the table, strongly consistent.
    pub(crate) async fn scan_all(&self) -> StoreResult<Vec<Item>> {
        let mut items = Vec::new();
        let mut start: Option<Item> = None;
        loop {
            let out = self
                .client
                .scan()
                .table_name(&self.name)
                .consistent_read(true)
                .set_exclusive_start_key(start.take())
                .send()
                .await
                .map_err(|e| self.error("Scan", &e))?;
            items.extend(out.items().iter().cloned());
            match out.last_evaluated_key() {
                Some(k) if !k.is_empty() => start = Some(k.clone()),
                _ => return Ok(items),
            }
        }
    }

    /// Visits, in `sk` order and strongly consistent, the items of `pk` with
    /// `from <= sk <= to`, `page` at a time, until `visit` returns false.
    pub(crate) async fn query(
        &self,
        pk: &str,
        (from, to): (u64, u64),
        page: i32,
        mut visit: impl FnMut(Item) -> StoreResult<bool>,
    ) -> StoreResult<()> {
        let mut start: Option<Item> = None;
        loop {
            let out = self
                .client
                .query()
                .table_name(&self.name)
                .consistent_read(true)
                .key_condition_expression("pk = :pk AND sk BETWEEN :from AND :to")
                .expression_attribute_values(":pk", s(pk))
                .expression_attribute_values(":from", n(from))
                .expression_attribute_values(":to", n(to))
                .limit(page)
                .set_exclusive_start_key(start.take())
                .send()
                .await
                .map_err(|e| self.error("Query", &e))?;
            for item in out.items() {
                if !visit(item.clone())? {
                    return Ok(());
                }
            }
            match out.last_evaluated_key() {
                Some(k) if !k.is_empty() => start = Some(k.clone()),
                _ => return Ok(()),
            }
        }
    }

    /// Waits before attempt `attempt` of something that lost a race or was
    /// throttled; `Unavailable` once the attempts are spent (invariant 2).
    pub(crate) async fn pause(&self, attempt: u32, what: &str) -> StoreResult<()> {
        if attempt >= MAX_ATTEMPTS {
            return Err(StoreError::Unavailable(format!(
                "dynamodb table {}: {what} {attempt} times",
                self.name
            )));
        }
        tokio::time::sleep(backoff(attempt)).await;
        Ok(())
    }
}

/// 20 ms doubling per attempt up to about 1.3 s, with up to half of it added
/// at random (a UUIDv7's last byte is random) so that racing agents do not
/// retry in step.
fn backoff(attempt: u32) -> Duration {
    let base = 20u64 << attempt.min(6);
    let jitter = u64::from(uuid::Uuid::now_v7().as_bytes()[15]) * base / 512;
    Duration::from_millis(base + jitter)
}

fn key(name: &str, kind: KeyType) -> StoreResult<KeySchemaElement> {
    KeySchemaElement::builder()
        .attribute_name(name)
        .key_type(kind)
        .build()
        .map_err(build_error)
}

fn attribute(name: &str, kind: ScalarAttributeType) -> StoreResult<AttributeDefinition> {
    AttributeDefinition::builder()
        .attribute_name(name)
        .attribute_type(kind)
        .build()
        .map_err(build_error)
}

/// A request the SDK refused to build (a required field left out).
pub(crate) fn build_error(e: aws_sdk_dynamodb::error::BuildError) -> StoreError {
    StoreError::Invalid(format!("dynamodb request: {e}"))
}

/// True when a single-item write was refused by its condition.
pub(crate) fn condition_failed<E: ProvideErrorMetadata>(e: &SdkError<E>) -> bool {
    e.as_service_error()
        .and_then(ProvideErrorMetadata::code)
        .is_some_and(|c| c == "ConditionalCheckFailedException")
}

/// True when a transaction was cancelled by something other than a
/// condition (a concurrent transaction, throttling): worth running again
/// as it is.
pub(crate) fn transient_cancel(codes: &[String]) -> bool {
    codes.iter().any(|c| {
        matches!(
            c.as_str(),
            "TransactionConflict" | "ThrottlingError" | "ProvisionedThroughputExceeded"
        )
    })
}

/// A string value.
pub(crate) fn s(v: impl Into<String>) -> AttributeValue {
    AttributeValue::S(v.into())
}

/// A number value.
pub(crate) fn n(v: impl Display) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

/// A binary value.
pub(crate) fn b(v: Vec<u8>) -> AttributeValue {
    AttributeValue::B(Blob::new(v))
}

fn corrupt(item: &Item, name: &str, what: &str) -> StoreError {
    let pk = item.get("pk").and_then(|v| v.as_s().ok());
    StoreError::Corrupt(format!("dynamodb item {pk:?}: attribute {name} {what}"))
}

/// A string attribute; `None` when absent.
pub(crate) fn opt_s(item: &Item, name: &str) -> StoreResult<Option<String>> {
    item.get(name)
        .map(|v| {
            v.as_s()
                .cloned()
                .map_err(|_| corrupt(item, name, "is not a string"))
        })
        .transpose()
}

/// A required string attribute.
pub(crate) fn get_s(item: &Item, name: &str) -> StoreResult<String> {
    opt_s(item, name)?.ok_or_else(|| corrupt(item, name, "is missing"))
}

/// A number attribute; `None` when absent.
pub(crate) fn opt_n<T: FromStr>(item: &Item, name: &str) -> StoreResult<Option<T>> {
    item.get(name)
        .map(|v| {
            v.as_n()
                .ok()
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| corrupt(item, name, "is not a number of the expected range"))
        })
        .transpose()
}

/// A required number attribute.
pub(crate) fn get_n<T: FromStr>(item: &Item, name: &str) -> StoreResult<T> {
    opt_n(item, name)?.ok_or_else(|| corrupt(item, name, "is missing"))
}

/// A required binary attribute.
pub(crate) fn get_b(item: &Item, name: &str) -> StoreResult<Vec<u8>> {
    match item.get(name) {
        Some(AttributeValue::B(blob)) => Ok(blob.as_ref().to_vec()),
        Some(_) => Err(corrupt(item, name, "is not binary")),
        None => Err(corrupt(item, name, "is missing")),
    }
}

/// An item's size as the service counts it, rounded up (names plus values;
/// a number counted as its decimal text).
pub(crate) fn item_size(item: &Item) -> usize {
    item.iter()
        .map(|(name, value)| {
            name.len()
                + match value {
                    AttributeValue::S(v) | AttributeValue::N(v) => v.len(),
                    AttributeValue::B(v) => v.as_ref().len(),
                    _ => 1,
                }
        })
        .sum()
}

/// `Invalid` ("oversized") when `item` cannot be stored (invariant 4).
pub(crate) fn check_size(item: &Item, what: &str) -> StoreResult<()> {
    let size = item_size(item);
    if size > MAX_ITEM_BYTES {
        return Err(StoreError::Invalid(format!(
            "oversized: {what} takes {size} bytes, a DynamoDB item at most {MAX_ITEM_BYTES}"
        )));
    }
    Ok(())
}
