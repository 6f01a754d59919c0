-- Migration 0003: the relays' activity and status per target, for the operator's
-- console (schema.sql is the whole current schema).

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
