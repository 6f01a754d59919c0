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
