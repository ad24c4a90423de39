-- Readiness probe: /readyz writes this row through the writer, so a store that can still be
-- read but not written (disk full, read-only filesystem) reports not ready.
CREATE TABLE IF NOT EXISTS idem_probe (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    at INTEGER NOT NULL
);
