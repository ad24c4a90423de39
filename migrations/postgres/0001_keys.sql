-- Idempotency keys: one row per (upstream, credential scope, key).
CREATE TABLE IF NOT EXISTS idem_keys (
    upstream    TEXT    NOT NULL,
    scope       TEXT    NOT NULL,  -- hex SHA-256 of the credential headers, never the credentials
    key         TEXT    NOT NULL,
    fingerprint TEXT    NOT NULL,
    route       TEXT    NOT NULL,
    entities    JSONB   NOT NULL DEFAULT '[]',
    state       TEXT    NOT NULL,  -- in_flight | completed | released | unknown
    owner       TEXT,
    lease_until BIGINT  NOT NULL DEFAULT 0,      -- ms since epoch, database clock
    epoch       BIGINT  NOT NULL DEFAULT 0,      -- fencing token, bumped on every reservation
    attempts    BIGINT  NOT NULL DEFAULT 0,
    status      INTEGER,
    headers     BYTEA,
    body        BYTEA,
    created_at  BIGINT  NOT NULL,
    updated_at  BIGINT  NOT NULL,
    expires_at  BIGINT,
    PRIMARY KEY (upstream, scope, key)
);

CREATE INDEX IF NOT EXISTS idem_keys_key ON idem_keys (key);
CREATE INDEX IF NOT EXISTS idem_keys_expires ON idem_keys (expires_at);
CREATE INDEX IF NOT EXISTS idem_keys_entities ON idem_keys USING GIN (entities);

-- Entity leases: at most one protected request per entity at the upstream, across replicas.
-- A row is held while owner is set and lease_until (database clock, ms) is in the future; the
-- epoch is bumped on every acquisition and fences the holder's later writes.
CREATE TABLE IF NOT EXISTS idem_entity_leases (
    entity      TEXT    PRIMARY KEY,
    owner       TEXT,
    epoch       BIGINT  NOT NULL DEFAULT 0,
    lease_until BIGINT  NOT NULL DEFAULT 0
);
