-- Per-entity state of ordered persistence: the last accepted version and the claim.
CREATE TABLE IF NOT EXISTS idem_entities (
    entity         TEXT    PRIMARY KEY,
    version        INTEGER,          -- last version accepted with a 2xx answer
    claim_upstream TEXT,             -- the claim's owner: a scoped key
    claim_scope    TEXT,
    claim_key      TEXT,
    claim_until    INTEGER,          -- ms since epoch; the claim lapses after this
    updated_at     INTEGER NOT NULL
) WITHOUT ROWID;

-- One row per protected request.
CREATE TABLE IF NOT EXISTS idem_audit (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    at              INTEGER NOT NULL,  -- ms since epoch
    upstream        TEXT    NOT NULL,
    route           TEXT    NOT NULL,
    entities        TEXT    NOT NULL DEFAULT '[]',  -- JSON array
    key             TEXT,
    fingerprint     TEXT,
    decision        TEXT    NOT NULL,  -- forwarded | replayed | released | unknown | <error type>
    upstream_status INTEGER,
    total_ms        INTEGER NOT NULL,
    lock_wait_ms    INTEGER NOT NULL DEFAULT 0,
    upstream_ms     INTEGER,
    expires_at      INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS idem_audit_key ON idem_audit (key);
CREATE INDEX IF NOT EXISTS idem_audit_expires ON idem_audit (expires_at);
