-- Migration 0003: the relays' activity and status per target, for the operator's
-- console (schema.sql is the whole current schema).

-- Relay activity, for the operator's console (the PostgreSQL schema explains it):
-- per target, minute (whole minutes since the Unix epoch, UTC) and relay process.
CREATE TABLE IF NOT EXISTS {table}_activity (
    target    VARCHAR(64) NOT NULL,
    minute    BIGINT NOT NULL,
    worker    VARCHAR(255) NOT NULL,
    published BIGINT NOT NULL DEFAULT 0,
    failed    BIGINT NOT NULL DEFAULT 0,
    abandoned BIGINT NOT NULL DEFAULT 0,
    lag_sum   DOUBLE NOT NULL DEFAULT 0,
    lag_max   DOUBLE NOT NULL DEFAULT 0,
    lag_count BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (target, minute, worker)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Each relay's circuit state and last error per target; times are UTC.
CREATE TABLE IF NOT EXISTS {table}_relay_status (
    worker     VARCHAR(255) NOT NULL,
    target     VARCHAR(64) NOT NULL,
    circuit    VARCHAR(16) NOT NULL,
    last_error TEXT NULL,
    updated_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (worker, target)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
