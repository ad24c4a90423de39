-- The purge's entity statements scanned every entity (and lease) row. These partial indexes
-- hold only the rows each statement can touch.
CREATE INDEX IF NOT EXISTS idem_entities_claimed ON idem_entities (claim_until) WHERE claim_until IS NOT NULL;
CREATE INDEX IF NOT EXISTS idem_entities_empty ON idem_entities (entity) WHERE version IS NULL AND claim_key IS NULL;
CREATE INDEX IF NOT EXISTS idem_entity_leases_free ON idem_entity_leases (lease_until) WHERE owner IS NULL;
