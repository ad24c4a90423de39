-- Each account's rate-limit budget (upstreams.X.pace), shared by every replica: a claim of
-- n sends at the database's time, kept for the budget's window. A row per (upstream, scope)
-- in idem_pace orders the claims on one account (each takes its row lock).
CREATE TABLE IF NOT EXISTS idem_pace (
    upstream TEXT NOT NULL,
    scope TEXT NOT NULL,
    PRIMARY KEY (upstream, scope)
);
CREATE TABLE IF NOT EXISTS idem_pace_sends (
    upstream TEXT NOT NULL,
    scope TEXT NOT NULL,
    at BIGINT NOT NULL,
    n INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS idem_pace_sends_scope ON idem_pace_sends (upstream, scope, at);
