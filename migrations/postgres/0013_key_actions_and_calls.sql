-- Which action a key's record stands for: the epoch of the reservation that began it. A
-- takeover of an unknown or abandoned outcome continues the action (the same write, sent
-- again or reconciled); a reservation of a released or expired key begins a new one. A route
-- that stamps the key into the body (`stamp`) stamps the action's value, so a reconcile
-- read finds this action's object, never the one an earlier action created.
ALTER TABLE idem_keys ADD COLUMN action BIGINT NOT NULL DEFAULT 1;

-- How long the call of the reservation that stands may run (the upstream's timeout it was sent
-- under, in ms). A retry that finds the record abandoned waits until the call could no longer
-- be running before it reads the real system, by this, not by its own configuration, which a
-- reload or another replica may have made shorter. NULL on records written before.
ALTER TABLE idem_keys ADD COLUMN call_ms BIGINT;
