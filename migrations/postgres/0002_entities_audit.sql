-- Per-entity state of ordered persistence: the last accepted version and the claim.
CREATE TABLE IF NOT EXISTS idem_entities (
    entity         TEXT    PRIMARY KEY,
    version        BIGINT,
    claim_upstream TEXT,
    claim_scope    TEXT,
    claim_key      TEXT,
    claim_until    BIGINT,
    updated_at     BIGINT  NOT NULL
);

-- One row per protected request.
CREATE TABLE IF NOT EXISTS idem_audit (
    id              BIGSERIAL PRIMARY KEY,
    at              BIGINT  NOT NULL,
    upstream        TEXT    NOT NULL,
    route           TEXT    NOT NULL,
    entities        JSONB   NOT NULL DEFAULT '[]',
    key             TEXT,
    fingerprint     TEXT,
    decision        TEXT    NOT NULL,
    upstream_status INTEGER,
    total_ms        BIGINT  NOT NULL,
    lock_wait_ms    BIGINT  NOT NULL DEFAULT 0,
    upstream_ms     BIGINT,
    expires_at      BIGINT  NOT NULL
);
CREATE INDEX IF NOT EXISTS idem_audit_key ON idem_audit (key);
CREATE INDEX IF NOT EXISTS idem_audit_expires ON idem_audit (expires_at);
CREATE INDEX IF NOT EXISTS idem_audit_entities ON idem_audit USING GIN (entities);
