-- Every first write inserts a key and updates it once, and the update cannot be HOT: each
-- index on idem_keys costs both. The purges use the partial indexes of 0004, so the full
-- expiry index served nothing a first write needs.
DROP INDEX IF EXISTS idem_keys_expires;
