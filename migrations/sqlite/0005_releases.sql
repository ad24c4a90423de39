-- Operator releases, in order: how a release made by another process (the CLI) reaches the
-- serving process's replay cache. The serving process reads new rows and records what it has
-- seen in idem_meta ('releases_seen'), which the releasing process waits for.
CREATE TABLE IF NOT EXISTS idem_releases (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT    NOT NULL,
    at  INTEGER NOT NULL
);
