-- How many requests an audit row stands for: 1, or a run of one key's requests that ended
-- alike within one audit batch (a retry storm's replays), folded by the auditor into one row.
-- A replay storm of one key wrote a row per request, and those rows were a fifth of a replay's
-- cost.
ALTER TABLE idem_audit ADD COLUMN requests INTEGER NOT NULL DEFAULT 1;
