-- Who a request came from and why an operator acted, for the console's timelines: the
-- credential scope as a short id (16 hex: not the credentials, and not enough of the keyed
-- hash to test guesses against), the workflow id header when the request carried one
-- (`server.workflow_header`), and an operator's note on `released_by_operator` and
-- `completed_by_operator` rows.
ALTER TABLE idem_audit ADD COLUMN IF NOT EXISTS scope TEXT;
ALTER TABLE idem_audit ADD COLUMN IF NOT EXISTS workflow TEXT;
ALTER TABLE idem_audit ADD COLUMN IF NOT EXISTS note TEXT;
