-- Migration 0002: the audit of operators' changes (schema.sql is the whole current
-- schema; tests/migration holds the two to each other).

-- The operator's changes, one record per message changed: who, when, what and why.
-- Written in the transaction of the change itself, read newest first (by id).
CREATE TABLE IF NOT EXISTS {table}_audit (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at         timestamptz NOT NULL DEFAULT now(),
    actor      text NOT NULL,
    action     text NOT NULL,
    reason     text,
    seq        bigint NOT NULL,
    message_id uuid NOT NULL,
    target     text COLLATE "C" NOT NULL,
    key        text COLLATE "C"
);

-- A search of one (target, key) among finished rows, in seq order, as {prefix}_keyed_ix
-- serves it among live ones. Only rows kept under a retention enter it.
CREATE INDEX IF NOT EXISTS {prefix}_keyed_done_ix ON {table}_done (target, key, seq)
    WHERE key IS NOT NULL;
