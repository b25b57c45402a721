//! Stores: options that must be set, volatile stores that must be acknowledged, and the
//! lease/outbox pairing.

use super::super::route::DeliveryMode;
use super::super::store::{
    DlqStoreConfig, LeaseStoreConfig, MemoryOptions, OutboxStoreConfig, SQLITE_MIN_MAX_SIZE,
};
use super::{Validator, syntax};

impl Validator<'_> {
    pub(super) fn stores(&mut self) {
        let stores = &self.config.stores;
        if let Some(outbox) = &stores.outbox {
            self.outbox(outbox);
        }
        if let Some(lease) = &stores.lease {
            self.lease(lease);
        }
        if let Some(dlq) = &stores.dlq {
            self.dlq(dlq);
        }
        if let (Some(LeaseStoreConfig::Memory(_)), Some(outbox)) = (&stores.lease, &stores.outbox)
            && outbox.is_durable()
        {
            self.error(
                "stores.lease.type",
                format!(
                    "a memory lease cannot back a durable {} outbox: memory fencing versions restart at zero after a restart, so every claim falls below the outbox's durable high-water mark, is rejected as stale, and the partition never drains again; use a durable lease (sqlite, postgres, dynamodb or control_plane)",
                    outbox.type_name()
                ),
            );
        }
        if let (Some(LeaseStoreConfig::Sqlite(_)), Some(outbox)) = (&stores.lease, &stores.outbox)
            && outbox.is_shared()
        {
            self.error(
                "stores.lease.type",
                format!(
                    "a sqlite lease cannot back a shared {} outbox: every agent running the bridge would keep its own lease, with versions from its own file, so two agents would drain one partition at once and fence each other out at random; and a node replaced with an empty file starts below the outbox's high-water mark and never drains again; use a shared lease (postgres, dynamodb or control_plane)",
                    outbox.type_name()
                ),
            );
        }
        self.dynamodb_tables_apart();
    }

    /// Two `dynamodb` stores on one table (name, region and endpoint) would
    /// read each other's items as their own (the lease and DLQ tables even
    /// share a key schema).
    fn dynamodb_tables_apart(&mut self) {
        let stores = &self.config.stores;
        let tables = [
            (
                "outbox",
                stores.outbox.as_ref().and_then(|o| match o {
                    OutboxStoreConfig::Dynamodb(o) => {
                        Some((&o.table_name, &o.region, &o.endpoint_url))
                    }
                    _ => None,
                }),
            ),
            (
                "lease",
                stores.lease.as_ref().and_then(|o| match o {
                    LeaseStoreConfig::Dynamodb(o) => {
                        Some((&o.table_name, &o.region, &o.endpoint_url))
                    }
                    _ => None,
                }),
            ),
            (
                "dlq",
                stores.dlq.as_ref().and_then(|o| match o {
                    DlqStoreConfig::Dynamodb(o) => {
                        Some((&o.table_name, &o.region, &o.endpoint_url))
                    }
                    _ => None,
                }),
            ),
        ];
        let mut clashes = Vec::new();
        for (i, (store, table)) in tables.iter().enumerate() {
            let Some(table) = table.filter(|(name, _, _)| !name.is_empty()) else {
                continue;
            };
            if let Some((earlier, _)) = tables[..i].iter().find(|(_, t)| *t == Some(table)) {
                let table = table.0;
                clashes.push((
                    format!("stores.{store}.options.table_name"),
                    format!(
                        "the {earlier} store uses the table {table:?} already; give each dynamodb store a table of its own"
                    ),
                ));
            }
        }
        for (path, message) in clashes {
            self.error(path, message);
        }
    }

    /// A DynamoDB table name: 3 to 255 of `A-Z a-z 0-9 _ - .`.
    fn dynamodb_table(&mut self, path: String, name: &str) {
        if name.trim().is_empty() {
            self.error(path, "must not be empty");
        } else if !(3..=255).contains(&name.len())
            || !name
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.'))
        {
            self.error(
                path,
                format!("{name:?} is not a DynamoDB table name: 3 to 255 of A-Z a-z 0-9 _ - ."),
            );
        }
    }

    fn volatile(&mut self, store: &str, o: &MemoryOptions, what: &str) {
        if !o.acknowledge_volatile {
            self.error(
                format!("stores.{store}.options.acknowledge_volatile"),
                format!(
                    "a memory {store} loses its {what} on restart, after their sources were acknowledged; set acknowledge_volatile: true to accept that (development only)"
                ),
            );
        }
    }

    fn outbox(&mut self, outbox: &OutboxStoreConfig) {
        let base = "stores.outbox.options";
        match outbox {
            OutboxStoreConfig::Memory(o) => self.volatile("outbox", o, "records"),
            OutboxStoreConfig::Sqlite(o) => {
                self.non_empty(format!("{base}.path"), &o.path);
                self.positive(format!("{base}.busy_timeout"), o.busy_timeout);
                self.sqlite_max_size(format!("{base}.max_size_bytes"), o.max_size_bytes);
            }
            OutboxStoreConfig::Dynamodb(o) => {
                self.dynamodb_table(format!("{base}.table_name"), &o.table_name);
                self.optional_http(format!("{base}.endpoint_url"), o.endpoint_url.as_deref());
            }
            OutboxStoreConfig::Postgres(o) => {
                self.postgres(base, o.url.expose(), &o.schema);
            }
        }
        let Some(stale) = outbox.stale_claim_duration() else {
            return;
        };
        let path = format!("{base}.stale_claim_duration");
        if stale.is_zero() {
            self.error(path, "must be greater than zero");
            return;
        }
        for (i, route) in self.config.routes.iter().enumerate() {
            if route.delivery_mode == DeliveryMode::SharedOutbox
                && stale <= route.policy.send_timeout
            {
                self.error(
                    path.clone(),
                    format!(
                        "stale_claim_duration ({stale}) must exceed routes[{i}].policy.send_timeout ({}), or a record still being sent would be claimed again",
                        route.policy.send_timeout
                    ),
                );
            }
        }
    }

    fn lease(&mut self, lease: &LeaseStoreConfig) {
        let base = "stores.lease.options";
        match lease {
            LeaseStoreConfig::Memory(_) => {}
            LeaseStoreConfig::Sqlite(o) => {
                self.non_empty(format!("{base}.path"), &o.path);
                self.positive(format!("{base}.busy_timeout"), o.busy_timeout);
                self.sqlite_max_size(format!("{base}.max_size_bytes"), o.max_size_bytes);
            }
            LeaseStoreConfig::Dynamodb(o) => {
                self.dynamodb_table(format!("{base}.table_name"), &o.table_name);
                self.optional_http(format!("{base}.endpoint_url"), o.endpoint_url.as_deref());
            }
            LeaseStoreConfig::Postgres(o) => self.postgres(base, o.url.expose(), &o.schema),
            LeaseStoreConfig::ControlPlane(o) => {
                self.optional_http(format!("{base}.endpoint"), o.endpoint.as_deref());
            }
        }
    }

    fn dlq(&mut self, dlq: &DlqStoreConfig) {
        let base = "stores.dlq.options";
        match dlq {
            DlqStoreConfig::Memory(o) => self.volatile("dlq", o, "entries"),
            DlqStoreConfig::Sqlite(o) => {
                self.non_empty(format!("{base}.path"), &o.path);
                self.positive(format!("{base}.busy_timeout"), o.busy_timeout);
                self.sqlite_max_size(format!("{base}.max_size_bytes"), o.max_size_bytes);
            }
            DlqStoreConfig::Dynamodb(o) => {
                self.dynamodb_table(format!("{base}.table_name"), &o.table_name);
                self.optional_http(format!("{base}.endpoint_url"), o.endpoint_url.as_deref());
            }
            DlqStoreConfig::Postgres(o) => self.postgres(base, o.url.expose(), &o.schema),
            DlqStoreConfig::ControlPlane(o) => {
                self.optional_http(format!("{base}.endpoint"), o.endpoint.as_deref());
            }
        }
    }

    fn sqlite_max_size(&mut self, path: String, max_size_bytes: Option<u64>) {
        if let Some(bytes) = max_size_bytes
            && bytes < SQLITE_MIN_MAX_SIZE
        {
            self.error(
                path,
                format!("must be at least {SQLITE_MIN_MAX_SIZE} (16 pages), got {bytes}"),
            );
        }
    }

    fn non_empty(&mut self, path: String, value: &str) {
        if value.trim().is_empty() {
            self.error(path, "must not be empty");
        }
    }

    fn optional_http(&mut self, path: String, value: Option<&str>) {
        if let Some(v) = value
            && let Err(e) = syntax::http_url(v)
        {
            self.error(path, e);
        }
    }

    /// A `postgres` store's `url` and `schema`.
    fn postgres(&mut self, base: &str, url: &str, schema: &str) {
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            self.error(
                format!("{base}.url"),
                "must be a postgres:// or postgresql:// URL",
            );
        }
        self.sql_identifier(format!("{base}.schema"), schema);
    }

    fn sql_identifier(&mut self, path: String, value: &str) {
        if !crate::postgres::is_identifier(value) {
            self.error(
                path,
                format!("\"{value}\" is not a plain SQL identifier (letters, digits and '_', at most 63)"),
            );
        }
    }
}
