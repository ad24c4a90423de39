-- Facts about the store itself, e.g. which scope secret keyed its credential hashes (its id,
-- never the secret).
CREATE TABLE IF NOT EXISTS idem_meta (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;
