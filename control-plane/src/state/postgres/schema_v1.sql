-- Ferry control-plane state, schema version 1 (PostgreSQL).
-- Times are BIGINT nanoseconds since the Unix epoch.

CREATE TABLE IF NOT EXISTS configs (
    bridge_id TEXT PRIMARY KEY NOT NULL,
    version   BIGINT NOT NULL
);

CREATE TABLE IF NOT EXISTS config_versions (
    bridge_id   TEXT NOT NULL,
    version     BIGINT NOT NULL,
    yaml        TEXT NOT NULL,
    selector    TEXT NOT NULL,
    change_note TEXT NOT NULL,
    digest      TEXT NOT NULL,
    created_at  BIGINT NOT NULL,
    PRIMARY KEY (bridge_id, version)
);

CREATE TABLE IF NOT EXISTS agents (
    agent_id        TEXT PRIMARY KEY NOT NULL,
    labels          TEXT NOT NULL,
    build_version   TEXT NOT NULL,
    capabilities    TEXT NOT NULL,
    connected       BOOLEAN NOT NULL,
    connected_at    BIGINT NOT NULL,
    last_seen       BIGINT NOT NULL,
    disconnected_at BIGINT
);

CREATE TABLE IF NOT EXISTS agent_bridges (
    agent_id       TEXT NOT NULL REFERENCES agents (agent_id) ON DELETE CASCADE,
    bridge_id      TEXT NOT NULL,
    pushed_version BIGINT,
    pushed_nonce   TEXT,
    pushed_at      BIGINT,
    acked_version  BIGINT,
    acked_at       BIGINT,
    nack_version   BIGINT,
    nack_error     TEXT,
    nack_details   TEXT,
    nack_at        BIGINT,
    PRIMARY KEY (agent_id, bridge_id)
);

-- One row per key, never deleted: `version` is the fencing counter.
CREATE TABLE IF NOT EXISTS leases (
    lease_key   TEXT PRIMARY KEY NOT NULL,
    holder      TEXT,
    version     BIGINT NOT NULL,
    acquired_at BIGINT NOT NULL,
    expires_at  BIGINT NOT NULL
);

CREATE TABLE IF NOT EXISTS dlq_entries (
    id               TEXT PRIMARY KEY NOT NULL,
    bridge_id        TEXT NOT NULL,
    route_id         TEXT NOT NULL,
    binding_id       TEXT NOT NULL,
    reason           TEXT NOT NULL,
    last_error       TEXT NOT NULL,
    attempts         BIGINT NOT NULL,
    first_attempt_at BIGINT,
    last_attempt_at  BIGINT,
    dead_lettered_at BIGINT NOT NULL,
    agent_id         TEXT NOT NULL,
    address          TEXT NOT NULL,
    envelope         BYTEA NOT NULL
);

CREATE INDEX IF NOT EXISTS dlq_entries_by_time ON dlq_entries (dead_lettered_at, id);

CREATE TABLE IF NOT EXISTS metrics_snapshots (
    agent_id    TEXT PRIMARY KEY NOT NULL,
    captured_at BIGINT NOT NULL,
    snapshot    BYTEA NOT NULL
);
