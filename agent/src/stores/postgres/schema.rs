//! The tables of the PostgreSQL stores, as migration steps: step `i` brings
//! a component's tables from version `i` to `i + 1`; a step once released
//! never changes (a new layout is a new step).

/// The outbox (`docs/adr/0007-outbox-layout.md`): a row per partition, per
/// message and per (message, binding).
pub(super) const OUTBOX: &[&str] = &["
CREATE TABLE ferry_outbox_partitions (
    pid       BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    partition TEXT   NOT NULL UNIQUE,
    -- the fencing high-water mark: raised only under FOR UPDATE of this row
    hwm       BIGINT NOT NULL,
    -- the last seq assigned; never decreases
    last_seq  BIGINT NOT NULL
);
CREATE TABLE ferry_outbox_messages (
    pid       BIGINT NOT NULL,
    -- the seqs of the message's records: first_seq..=last_seq
    first_seq BIGINT NOT NULL,
    last_seq  BIGINT NOT NULL,
    envelope  BYTEA  NOT NULL,
    PRIMARY KEY (pid, first_seq)
);
CREATE TABLE ferry_outbox_records (
    pid                 BIGINT  NOT NULL,
    seq                 BIGINT  NOT NULL,
    -- the message's first_seq
    msg                 BIGINT  NOT NULL,
    id                  TEXT    NOT NULL,
    binding             TEXT    NOT NULL,
    address             TEXT    NOT NULL,
    created_at_ns       BIGINT  NOT NULL,
    expires_at_ns       BIGINT,
    -- NULL: pending; otherwise claimed under this version (the partition's hwm)
    claim_version       BIGINT,
    claim_owner         TEXT,
    claimed_at_ns       BIGINT,
    replay_count        INTEGER NOT NULL DEFAULT 0,
    first_attempt_at_ns BIGINT,
    last_error          TEXT,
    PRIMARY KEY (pid, seq)
) WITH (
    -- A queue: every record is inserted, updated and deleted within
    -- seconds, and claims scan the pending index from its oldest entry, past
    -- the dead ones until a vacuum removes them. Vacuum it after every few
    -- thousand changes rather than after a fifth of the table.
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 5000
);
CREATE INDEX ferry_outbox_records_pending ON ferry_outbox_records (pid, seq)
    WHERE claim_version IS NULL;
CREATE INDEX ferry_outbox_records_claimed ON ferry_outbox_records (pid, seq)
    WHERE claim_version IS NOT NULL;
CREATE INDEX ferry_outbox_records_expiry ON ferry_outbox_records (pid, expires_at_ns)
    WHERE claim_version IS NULL AND expires_at_ns IS NOT NULL;
"];

/// Leases: a key's row is never deleted, so its version only grows.
pub(super) const LEASE: &[&str] = &[r#"
CREATE TABLE ferry_leases (
    -- byte order, as every backend lists keys
    key            TEXT   COLLATE "C" PRIMARY KEY,
    -- the last version granted; 0: a row created to be locked, never granted
    version        BIGINT NOT NULL,
    -- NULL after a release
    holder         TEXT,
    acquired_at_ns BIGINT,
    expires_at_ns  BIGINT
);
"#];

/// Dead letters: the filterable columns beside the encoded entry.
pub(super) const DLQ: &[&str] = &[r#"
CREATE TABLE ferry_dlq_entries (
    -- byte order, as every backend pages by (time, id)
    id                  TEXT    COLLATE "C" PRIMARY KEY,
    bridge_id           TEXT    COLLATE "C" NOT NULL,
    route_id            TEXT    COLLATE "C" NOT NULL,
    binding_id          TEXT    COLLATE "C" NOT NULL,
    reason              INTEGER NOT NULL,
    dead_lettered_at_ns BIGINT  NOT NULL,
    -- the whole entry, DlqEntry::encode
    entry               BYTEA   NOT NULL
);
CREATE INDEX ferry_dlq_entries_order ON ferry_dlq_entries (dead_lettered_at_ns, id);
"#];
