-- The GIN indexes on `entities` served no query: listing keys or audit rows by entity matches
-- entity variants (`name@<16 hex>`) with `jsonb_array_elements_text`, which a GIN index cannot
-- answer. Each cost every first write a GIN insert (and its pending-list flushes).
DROP INDEX IF EXISTS idem_keys_entities;
DROP INDEX IF EXISTS idem_audit_entities;
