-- Stored answers encrypted at rest: the id of the key that sealed a record's headers and body
-- (never the key). NULL: the answer was stored in clear, before encryption was turned on.
ALTER TABLE idem_keys ADD COLUMN IF NOT EXISTS enc_key TEXT;
