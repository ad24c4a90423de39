-- Retention purges look for completed keys past expiry and released keys past retention; these
-- partial indexes hold just the rows each purge can delete.
CREATE INDEX IF NOT EXISTS idem_keys_completed_expiry ON idem_keys (expires_at) WHERE state = 'completed';
CREATE INDEX IF NOT EXISTS idem_keys_released_updated ON idem_keys (updated_at) WHERE state = 'released';
