-- Set by a request that is about to wait for an entity another replica's request holds: only
-- a watched lease's release is NOTIFYed, as only a watched key's outcome is (0010). A NOTIFY
-- for every release made every releasing commit take the cluster's notification lock and woke
-- every replica's LISTEN connection, for waits across replicas that are rare (within one
-- replica, requests for an entity queue in the process before its lease is asked for). Taking
-- the lease clears the mark: a waiter marked it while an earlier holder had it, and that
-- holder's release woke it to ask again. With a constant default the column is added without
-- rewriting the table.
ALTER TABLE idem_entity_leases ADD COLUMN IF NOT EXISTS watched BOOLEAN NOT NULL DEFAULT false;
-- Every protected request on an entity route takes its entity's lease and releases it: two
-- updates of one row. The partial index of free leases (0007, for the purge) covers `owner` and
-- `lease_until`, which both updates change, so neither could be a HOT update: each added an
-- entry to that index and to the primary key, and a busy entity's entries piled up behind its
-- row. Without it both are HOT (no index changes) when the row's page has room, which a fill
-- factor of 50 leaves. The purge of free leases walks the table instead, stopping at its batch
-- size: leases are released far more often than they are purged.
DROP INDEX IF EXISTS idem_entity_leases_free;
ALTER TABLE idem_entity_leases SET (fillfactor = 50);
