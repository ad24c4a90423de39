-- How many requests an audit row stands for: 1, or a run of one key's requests that ended
-- alike within one audit batch (a retry storm's replays), folded by the auditor into one row.
-- With a constant default the column is added without rewriting the table, and a replica not
-- yet upgraded still writes rows of one request each.
ALTER TABLE idem_audit ADD COLUMN IF NOT EXISTS requests BIGINT NOT NULL DEFAULT 1;
