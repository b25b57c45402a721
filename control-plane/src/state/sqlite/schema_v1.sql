-- Ferry control-plane state, schema version 1 (SQLite).
-- Times are INTEGER nanoseconds since the Unix epoch.

CREATE TABLE IF NOT EXISTS configs (
    bridge_id TEXT PRIMARY KEY NOT NULL,
    version   INTEGER NOT NULL
);

CREATE TABLE IF NOT EXISTS config_versions (
    bridge_id   TEXT NOT NULL,
    version     INTEGER NOT NULL,
    yaml        TEXT NOT NULL,
    selector    TEXT NOT NULL,
    change_note TEXT NOT NULL,
    digest      TEXT NOT NULL,
    created_at  INTEGER NOT NULL,
    PRIMARY KEY (bridge_id, version)
);

CREATE TABLE IF NOT EXISTS agents (
    agent_id        TEXT PRIMARY KEY NOT NULL,
    labels          TEXT NOT NULL,
    build_version   TEXT NOT NULL,
    capabilities    TEXT NOT NULL,
    connected       INTEGER NOT NULL,
    connected_at    INTEGER NOT NULL,
    last_seen       INTEGER NOT NULL,
    disconnected_at INTEGER
);

CREATE TABLE IF NOT EXISTS agent_bridges (
    agent_id       TEXT NOT NULL REFERENCES agents (agent_id) ON DELETE CASCADE,
    bridge_id      TEXT NOT NULL,
    pushed_version INTEGER,
    pushed_nonce   TEXT,
    pushed_at      INTEGER,
    acked_version  INTEGER,
    acked_at       INTEGER,
    nack_version   INTEGER,
    nack_error     TEXT,
    nack_details   TEXT,
    nack_at        INTEGER,
    PRIMARY KEY (agent_id, bridge_id)
);

-- One row per key, never deleted: `version` is the fencing counter.
CREATE TABLE IF NOT EXISTS leases (
    lease_key   TEXT PRIMARY KEY NOT NULL,
    holder      TEXT,
    version     INTEGER NOT NULL,
    acquired_at INTEGER NOT NULL,
    expires_at  INTEGER NOT NULL
);

CREATE TABLE IF NOT EXISTS dlq_entries (
    id               TEXT PRIMARY KEY NOT NULL,
    bridge_id        TEXT NOT NULL,
    route_id         TEXT NOT NULL,
    binding_id       TEXT NOT NULL,
    reason           TEXT NOT NULL,
    last_error       TEXT NOT NULL,
    attempts         INTEGER NOT NULL,
    first_attempt_at INTEGER,
    last_attempt_at  INTEGER,
    dead_lettered_at INTEGER NOT NULL,
    agent_id         TEXT NOT NULL,
    address          TEXT NOT NULL,
    envelope         BLOB NOT NULL
);

CREATE INDEX IF NOT EXISTS dlq_entries_by_time ON dlq_entries (dead_lettered_at, id);

CREATE TABLE IF NOT EXISTS metrics_snapshots (
    agent_id    TEXT PRIMARY KEY NOT NULL,
    captured_at INTEGER NOT NULL,
    snapshot    BLOB NOT NULL
);
