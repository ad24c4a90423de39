-- Every first write inserts a key and updates it once; each index on idem_keys costs both.
-- The purges use the partial indexes of 0006, so the full state and expiry indexes only served
-- rare scans (start-up, `keys list`), which can walk the table.
DROP INDEX IF EXISTS idem_keys_state;
DROP INDEX IF EXISTS idem_keys_expires;
