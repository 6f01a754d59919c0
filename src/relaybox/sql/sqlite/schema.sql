-- relaybox's outbox on SQLite: the whole schema, as the migrations build it.
-- `relaybox schema --dialect sqlite --table NAME` prints it for a table.

-- The outbox: one row per (message, target). Finished rows (published under a
-- retention, abandoned) stay here with their status; partial indexes keep them out of
-- the relay's way.
-- Times are UTC text 'YYYY-MM-DD HH:MM:SS.SSS' from strftime('%Y-%m-%d %H:%M:%f', 'now'),
-- so they compare correctly as strings. AUTOINCREMENT: a seq is never reused after a
-- delete, so sequence order stays write order across purges.
CREATE TABLE IF NOT EXISTS {table} (
    seq            INTEGER PRIMARY KEY AUTOINCREMENT,
    status         TEXT NOT NULL DEFAULT 'pending',
    attempts       INTEGER NOT NULL DEFAULT 0,
    available_at   TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    locked_by      TEXT,
    locked_until   TEXT,
    lock_token     TEXT,
    published_at   TEXT,
    abandoned_at   TEXT,
    last_error     TEXT,
    id             TEXT NOT NULL,
    target         TEXT NOT NULL,
    external       INTEGER NOT NULL DEFAULT 0,
    topic          TEXT NOT NULL,
    "key"          TEXT,
    "partition"    INTEGER NOT NULL,
    type           TEXT NOT NULL,
    content_type   TEXT NOT NULL,
    payload        BLOB NOT NULL,
    headers        TEXT NOT NULL DEFAULT '{}',
    correlation_id TEXT,
    causation_id   TEXT,
    tenant_id      TEXT,
    aggregate_id   TEXT,
    occurred_at    TEXT NOT NULL,
    created_at     TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    CONSTRAINT {prefix}_status_ck
        CHECK (status IN ('pending', 'processing', 'published', 'failed', 'abandoned')),
    -- PostgreSQL's jsonb refuses malformed headers at insert; so does this check.
    CONSTRAINT {prefix}_headers_ck CHECK (json_valid(headers))
);

-- The claim walks live rows in sequence order; finished rows are not in this index.
-- SQLite uses a partial index only when the query repeats its WHERE terms, so every
-- query over live rows spells out this exact IN list.
CREATE INDEX IF NOT EXISTS {prefix}_live_ix ON {table} (seq)
    WHERE status IN ('pending', 'processing', 'failed');

-- Per-key order: "is there an earlier live row of this (target, key)?"
CREATE INDEX IF NOT EXISTS {prefix}_key_ix ON {table} (target, "key", seq)
    WHERE "key" IS NOT NULL AND status IN ('pending', 'processing', 'failed');

-- Retention purges.
CREATE INDEX IF NOT EXISTS {prefix}_published_ix ON {table} (published_at)
    WHERE status = 'published';
CREATE INDEX IF NOT EXISTS {prefix}_abandoned_ix ON {table} (abandoned_at)
    WHERE status = 'abandoned';

-- Partition leases, per target: which relay processes are alive and which targets each
-- serves, and which of them owns each partition of a target's keys, until when. Each
-- target's partitions are shared among the relays that serve it, so relays serving
-- different targets never strand each other's rows. Every heartbeat renews both
-- (queries.sql).
CREATE TABLE IF NOT EXISTS {table}_members (
    worker      TEXT NOT NULL,
    target      TEXT NOT NULL,
    lease_until TEXT NOT NULL,
    joined_at   TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    PRIMARY KEY (worker, target)
);

CREATE TABLE IF NOT EXISTS {table}_partitions (
    target      TEXT NOT NULL,
    "partition" INTEGER NOT NULL,
    owner       TEXT,
    lease_until TEXT,
    PRIMARY KEY (target, "partition"),
    CONSTRAINT {prefix}_partitions_lease_ck CHECK ((owner IS NULL) = (lease_until IS NULL))
);

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

-- Relay activity, for the operator's console (the PostgreSQL schema explains it):
-- per target, minute (whole minutes since the Unix epoch, UTC) and relay process.
CREATE TABLE IF NOT EXISTS {table}_activity (
    target    TEXT NOT NULL,
    minute    INTEGER NOT NULL,
    worker    TEXT NOT NULL,
    published INTEGER NOT NULL DEFAULT 0,
    failed    INTEGER NOT NULL DEFAULT 0,
    abandoned INTEGER NOT NULL DEFAULT 0,
    lag_sum   REAL NOT NULL DEFAULT 0,
    lag_max   REAL NOT NULL DEFAULT 0,
    lag_count INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (target, minute, worker)
);

-- Each relay's circuit state and last error per target.
CREATE TABLE IF NOT EXISTS {table}_relay_status (
    worker     TEXT NOT NULL,
    target     TEXT NOT NULL,
    circuit    TEXT NOT NULL,
    last_error TEXT,
    updated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    PRIMARY KEY (worker, target)
);
