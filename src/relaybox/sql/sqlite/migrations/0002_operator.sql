-- Migration 0002: the audit of operators' changes and backfills (schema.sql is the whole current
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

-- Backfills: retained messages copied again, in seq order, as new messages to a target.
-- cursor_seq is the seq of the last source message copied; it moves in the transaction
-- that writes the copies, so a backfill stopped anywhere goes on from there.
CREATE TABLE IF NOT EXISTS {table}_backfills (
    name        TEXT PRIMARY KEY,
    source      TEXT NOT NULL,
    target      TEXT NOT NULL,
    external    INTEGER NOT NULL,
    cursor_seq  INTEGER NOT NULL DEFAULT 0,
    copied      INTEGER NOT NULL DEFAULT 0,
    actor       TEXT NOT NULL,
    reason      TEXT,
    created_at  TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    updated_at  TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    finished_at TEXT
);
