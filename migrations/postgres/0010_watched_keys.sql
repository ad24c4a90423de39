-- Set by a request that is about to wait for a key another request has in flight (in any
-- replica): only a watched key's outcome is NOTIFYed. A NOTIFY for every stored outcome reached
-- every replica's LISTEN connection, so each replica handled every other replica's first
-- writes, waited for or not. With a constant default the column is added without rewriting
-- the table.
ALTER TABLE idem_keys ADD COLUMN IF NOT EXISTS watched BOOLEAN NOT NULL DEFAULT false;
