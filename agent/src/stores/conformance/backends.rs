//! The agent's own backends under the conformance suites.

use std::sync::Arc;

use ferry_tests::moto::Moto;
use ferry_tests::postgres::TestDatabase;

use super::{Guard, Harness, OutboxHarness, STALE};
use crate::stores::dynamodb::{
    DynamoDbDlqStore, DynamoDbLeaseStore, DynamoDbOptions, DynamoDbOutboxStore,
};
use crate::stores::memory::{MemoryDlqStore, MemoryLeaseStore, MemoryOutboxStore};
use crate::stores::postgres::{
    PostgresDlqStore, PostgresLeaseStore, PostgresOptions, PostgresOutboxStore,
};
use crate::stores::sqlite::{
    SqliteDlqStore, SqliteLeaseStore, SqliteOptions, SqliteOutboxStore, Synchronous,
};
use crate::stores::{BoxFuture, OutboxRecord, StoreResult};

pub(crate) fn sqlite_options(dir: &tempfile::TempDir, file: &str) -> SqliteOptions {
    SqliteOptions {
        stale_claim_duration: STALE,
        ..SqliteOptions::new(dir.path().join(file))
    }
}

/// A fresh database on the test server (`ferry_tests::postgres`), dropped
/// with the guard, and the options of a store in it.
pub(crate) async fn postgres_database() -> (PostgresOptions, TestDatabase) {
    let database = TestDatabase::create()
        .await
        .expect("create a test database");
    let options = PostgresOptions {
        stale_claim_duration: STALE,
        ..PostgresOptions::new(database.url().expect("database url"))
    };
    (options, database)
}

/// A client of the shared moto server and the options of a store on a
/// fresh table there (created when the store opens).
pub(crate) async fn dynamodb_table(prefix: &str) -> (aws_sdk_dynamodb::Client, DynamoDbOptions) {
    let moto = Moto::shared().await.expect("moto (set FERRY_VENV)");
    let options = DynamoDbOptions {
        create_tables: true,
        stale_claim_duration: STALE,
        ..DynamoDbOptions::new(ferry_tests::ids::unique(prefix))
    };
    (moto.dynamodb(), options)
}

fn temp_dir() -> tempfile::TempDir {
    tempfile::tempdir().expect("temporary directory")
}

impl Harness for MemoryOutboxStore {
    const DURABLE: bool = false;
    fn reopen(self) -> BoxFuture<'static, Self> {
        Box::pin(async move { self })
    }
}

impl OutboxHarness for MemoryOutboxStore {
    fn dump<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, StoreResult<Vec<OutboxRecord>>> {
        Box::pin(async move { MemoryOutboxStore::dump(self, partition) })
    }

    fn envelopes<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, StoreResult<usize>> {
        // The records of a message hold one `Arc` of its envelope.
        Box::pin(async move {
            let records = MemoryOutboxStore::dump(self, partition)?;
            let mut shared: Vec<_> = records.iter().map(|r| Arc::as_ptr(&r.envelope)).collect();
            shared.sort_unstable();
            shared.dedup();
            Ok(shared.len())
        })
    }
}

impl Harness for SqliteOutboxStore {
    const DURABLE: bool = true;
    fn reopen(self) -> BoxFuture<'static, Self> {
        Box::pin(async move {
            let options = self.options().clone();
            self.close().await;
            SqliteOutboxStore::open(options)
                .await
                .expect("reopen outbox")
        })
    }
}

impl OutboxHarness for SqliteOutboxStore {
    fn dump<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, StoreResult<Vec<OutboxRecord>>> {
        Box::pin(SqliteOutboxStore::dump(self, partition))
    }

    fn envelopes<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, StoreResult<usize>> {
        Box::pin(SqliteOutboxStore::envelopes(self, partition))
    }

    fn broken_invariants<'a>(
        &'a self,
        partition: &'a str,
    ) -> BoxFuture<'a, StoreResult<Vec<String>>> {
        Box::pin(SqliteOutboxStore::broken_invariants(self, partition))
    }
}

impl Harness for PostgresOutboxStore {
    const DURABLE: bool = true;
    fn reopen(self) -> BoxFuture<'static, Self> {
        Box::pin(async move {
            let options = self.options().clone();
            drop(self);
            PostgresOutboxStore::open(options)
                .await
                .expect("reopen outbox")
        })
    }
}

impl OutboxHarness for PostgresOutboxStore {
    fn dump<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, StoreResult<Vec<OutboxRecord>>> {
        Box::pin(PostgresOutboxStore::dump(self, partition))
    }

    fn envelopes<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, StoreResult<usize>> {
        Box::pin(PostgresOutboxStore::envelopes(self, partition))
    }
}

/// Reopens a DynamoDB store on the same table with the same client.
macro_rules! dynamodb_harness {
    ($store:ident) => {
        impl Harness for $store {
            const DURABLE: bool = true;
            fn reopen(self) -> BoxFuture<'static, Self> {
                Box::pin(async move {
                    let (client, options) = (self.client().clone(), self.options().clone());
                    drop(self);
                    $store::open_with(client, options).await.expect("reopen")
                })
            }
        }
    };
}
dynamodb_harness!(DynamoDbOutboxStore);
dynamodb_harness!(DynamoDbLeaseStore);
dynamodb_harness!(DynamoDbDlqStore);

impl OutboxHarness for DynamoDbOutboxStore {
    fn dump<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, StoreResult<Vec<OutboxRecord>>> {
        Box::pin(DynamoDbOutboxStore::dump(self, partition))
    }

    fn envelopes<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, StoreResult<usize>> {
        Box::pin(DynamoDbOutboxStore::envelopes(self, partition))
    }
}

impl Harness for PostgresLeaseStore {
    const DURABLE: bool = true;
    fn reopen(self) -> BoxFuture<'static, Self> {
        Box::pin(async move {
            let options = self.options().clone();
            drop(self);
            PostgresLeaseStore::open(options)
                .await
                .expect("reopen leases")
        })
    }
}

impl Harness for PostgresDlqStore {
    const DURABLE: bool = true;
    fn reopen(self) -> BoxFuture<'static, Self> {
        Box::pin(async move {
            let options = self.options().clone();
            drop(self);
            PostgresDlqStore::open(options).await.expect("reopen dlq")
        })
    }
}

impl Harness for MemoryLeaseStore {
    const DURABLE: bool = false;
    fn reopen(self) -> BoxFuture<'static, Self> {
        Box::pin(async move { self })
    }
}

impl Harness for SqliteLeaseStore {
    const DURABLE: bool = true;
    fn reopen(self) -> BoxFuture<'static, Self> {
        Box::pin(async move {
            let options = self.options().clone();
            self.close().await;
            SqliteLeaseStore::open(options)
                .await
                .expect("reopen leases")
        })
    }
}

impl Harness for MemoryDlqStore {
    const DURABLE: bool = false;
    fn reopen(self) -> BoxFuture<'static, Self> {
        Box::pin(async move { self })
    }
}

impl Harness for SqliteDlqStore {
    const DURABLE: bool = true;
    fn reopen(self) -> BoxFuture<'static, Self> {
        Box::pin(async move {
            let options = self.options().clone();
            self.close().await;
            SqliteDlqStore::open(options).await.expect("reopen dlq")
        })
    }
}

pub(crate) async fn memory_outbox() -> (MemoryOutboxStore, Guard) {
    (MemoryOutboxStore::new(STALE), Box::new(()))
}

pub(crate) async fn sqlite_outbox() -> (SqliteOutboxStore, Guard) {
    let dir = temp_dir();
    let store = SqliteOutboxStore::open(sqlite_options(&dir, "outbox.db"))
        .await
        .expect("open outbox");
    (store, Box::new(dir))
}

/// The outbox on `synchronous=NORMAL`, for the many short-lived stores of
/// the property test (the durability tests use the default `FULL`).
pub(crate) async fn sqlite_outbox_normal() -> (SqliteOutboxStore, Guard) {
    let dir = temp_dir();
    let options = SqliteOptions {
        synchronous: Synchronous::Normal,
        ..sqlite_options(&dir, "outbox.db")
    };
    let store = SqliteOutboxStore::open(options).await.expect("open outbox");
    (store, Box::new(dir))
}

pub(crate) async fn memory_lease() -> (MemoryLeaseStore, Guard) {
    (MemoryLeaseStore::new(), Box::new(()))
}

pub(crate) async fn sqlite_lease() -> (SqliteLeaseStore, Guard) {
    let dir = temp_dir();
    let store = SqliteLeaseStore::open(sqlite_options(&dir, "lease.db"))
        .await
        .expect("open leases");
    (store, Box::new(dir))
}

pub(crate) async fn memory_dlq() -> (MemoryDlqStore, Guard) {
    (MemoryDlqStore::new(), Box::new(()))
}

pub(crate) async fn sqlite_dlq() -> (SqliteDlqStore, Guard) {
    let dir = temp_dir();
    let store = SqliteDlqStore::open(sqlite_options(&dir, "dlq.db"))
        .await
        .expect("open dlq");
    (store, Box::new(dir))
}

pub(crate) async fn postgres_outbox() -> (PostgresOutboxStore, Guard) {
    let (options, database) = postgres_database().await;
    let store = PostgresOutboxStore::open(options)
        .await
        .expect("open outbox");
    (store, Box::new(database))
}

pub(crate) async fn postgres_lease() -> (PostgresLeaseStore, Guard) {
    let (options, database) = postgres_database().await;
    let store = PostgresLeaseStore::open(options)
        .await
        .expect("open leases");
    (store, Box::new(database))
}

pub(crate) async fn postgres_dlq() -> (PostgresDlqStore, Guard) {
    let (options, database) = postgres_database().await;
    let store = PostgresDlqStore::open(options).await.expect("open dlq");
    (store, Box::new(database))
}

pub(crate) async fn dynamodb_outbox() -> (DynamoDbOutboxStore, Guard) {
    let (client, options) = dynamodb_table("outbox").await;
    let store = DynamoDbOutboxStore::open_with(client, options)
        .await
        .expect("open outbox");
    (store, Box::new(()))
}

pub(crate) async fn dynamodb_lease() -> (DynamoDbLeaseStore, Guard) {
    let (client, options) = dynamodb_table("lease").await;
    let store = DynamoDbLeaseStore::open_with(client, options)
        .await
        .expect("open leases");
    (store, Box::new(()))
}

pub(crate) async fn dynamodb_dlq() -> (DynamoDbDlqStore, Guard) {
    let (client, options) = dynamodb_table("dlq").await;
    let store = DynamoDbDlqStore::open_with(client, options)
        .await
        .expect("open dlq");
    (store, Box::new(()))
}

super::outbox::outbox_conformance!(memory_outbox, memory_outbox);
super::outbox::outbox_conformance!(dynamodb_outbox, dynamodb_outbox);
crate::lease_conformance!(dynamodb_lease, dynamodb_lease);
crate::dlq_conformance!(dynamodb_dlq, dynamodb_dlq);
super::outbox::outbox_conformance!(postgres_outbox, postgres_outbox);
crate::lease_conformance!(postgres_lease, postgres_lease);
crate::dlq_conformance!(postgres_dlq, postgres_dlq);
super::outbox::outbox_conformance!(sqlite_outbox, sqlite_outbox);
crate::lease_conformance!(memory_lease, memory_lease);
crate::lease_conformance!(sqlite_lease, sqlite_lease);
crate::dlq_conformance!(memory_dlq, memory_dlq);
crate::dlq_conformance!(sqlite_dlq, sqlite_dlq);
