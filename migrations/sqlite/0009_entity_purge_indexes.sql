-- The purge's two entity statements walked every entity row on the single writer (about
-- 75 ms each at a million versioned entities, once per purge). These partial indexes hold only
-- the rows each statement can touch: entities with a claim, and entities with nothing left.
CREATE INDEX IF NOT EXISTS idem_entities_claimed ON idem_entities (claim_until) WHERE claim_until IS NOT NULL;
CREATE INDEX IF NOT EXISTS idem_entities_empty ON idem_entities (entity) WHERE version IS NULL AND claim_key IS NULL;
