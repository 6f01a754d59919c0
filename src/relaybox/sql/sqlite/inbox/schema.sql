-- relaybox's inbox on SQLite (the PostgreSQL schema explains each table).
CREATE TABLE IF NOT EXISTS {table} (
    consumer     TEXT NOT NULL,
    message_id   TEXT NOT NULL,
    processed_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    PRIMARY KEY (consumer, message_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS {prefix}_processed_ix ON {table} (processed_at);

CREATE TABLE IF NOT EXISTS {table}_watermarks (
    consumer   TEXT NOT NULL,
    source     TEXT NOT NULL,
    lane       TEXT NOT NULL,
    sequence   INTEGER NOT NULL,
    updated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    PRIMARY KEY (consumer, source, lane)
) WITHOUT ROWID;

-- Parked messages and counted attempts (the PostgreSQL schema explains them).
CREATE TABLE IF NOT EXISTS {table}_parked (
    id           INTEGER PRIMARY KEY,
    consumer     TEXT NOT NULL,
    message_id   TEXT NOT NULL,
    source       TEXT NOT NULL,
    type         TEXT NOT NULL,
    topic        TEXT NOT NULL,
    message_key  TEXT,
    content_type TEXT,
    attributes   TEXT NOT NULL,
    headers      TEXT NOT NULL,
    payload      BLOB NOT NULL,
    reason       TEXT NOT NULL,
    error        TEXT NOT NULL,
    attempts     INTEGER NOT NULL,
    parked_at    TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    status       TEXT NOT NULL DEFAULT 'parked',
    changed_at   TEXT,
    changed_by   TEXT,
    note         TEXT
);
CREATE INDEX IF NOT EXISTS {prefix}_parked_ix ON {table}_parked (consumer, status, id);

CREATE TABLE IF NOT EXISTS {table}_attempts (
    consumer   TEXT NOT NULL,
    message_id TEXT NOT NULL,
    attempts   INTEGER NOT NULL,
    last_error TEXT,
    updated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    PRIMARY KEY (consumer, message_id)
) WITHOUT ROWID;

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
