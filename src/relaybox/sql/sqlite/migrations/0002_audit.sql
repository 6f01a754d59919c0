-- Migration 0002: the audit of operators' changes (schema.sql is the whole current
-- schema; tests/migration holds the two to each other).

-- The operator's changes, one record per message changed: who, when, what and why.
-- Written in the transaction of the change itself, read newest first (by id).
CREATE TABLE IF NOT EXISTS {table}_audit (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    at         TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    actor      TEXT NOT NULL,
    action     TEXT NOT NULL,
    reason     TEXT,
    seq        INTEGER NOT NULL,
    message_id TEXT NOT NULL,
    target     TEXT NOT NULL,
    "key"      TEXT
);
