-- Migration 0002: the consumers' activity per minute, for the operator's console
-- (schema.sql is the whole current schema).

-- Consumer activity per consumer and minute (whole minutes since the Unix epoch, UTC),
-- for the operator's console (the PostgreSQL schema explains it).
CREATE TABLE IF NOT EXISTS {table}_activity (
    consumer  TEXT NOT NULL,
    minute    INTEGER NOT NULL,
    applied   INTEGER NOT NULL DEFAULT 0,
    duplicate INTEGER NOT NULL DEFAULT 0,
    parked    INTEGER NOT NULL DEFAULT 0,
    lag_sum   REAL NOT NULL DEFAULT 0,
    lag_max   REAL NOT NULL DEFAULT 0,
    lag_count INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (consumer, minute)
) WITHOUT ROWID;
