-- Idempotency keys: one row per (upstream, credential scope, key).
CREATE TABLE IF NOT EXISTS idem_keys (
    upstream    TEXT    NOT NULL,
    scope       TEXT    NOT NULL,  -- hex SHA-256 of the credential headers, never the credentials
    key         TEXT    NOT NULL,
    fingerprint TEXT    NOT NULL,
    route       TEXT    NOT NULL,
    entities    TEXT    NOT NULL DEFAULT '[]',  -- JSON array
    state       TEXT    NOT NULL,  -- in_flight | completed | released | unknown
    owner       TEXT,
    lease_until INTEGER NOT NULL DEFAULT 0,      -- ms since epoch
    epoch       INTEGER NOT NULL DEFAULT 0,      -- fencing token, bumped on every reservation
    attempts    INTEGER NOT NULL DEFAULT 0,
    status      INTEGER,
    headers     BLOB,
    body        BLOB,
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL,
    expires_at  INTEGER,
    PRIMARY KEY (upstream, scope, key)
) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS idem_keys_key ON idem_keys (key);
CREATE INDEX IF NOT EXISTS idem_keys_expires ON idem_keys (expires_at);
CREATE INDEX IF NOT EXISTS idem_keys_state ON idem_keys (state);
