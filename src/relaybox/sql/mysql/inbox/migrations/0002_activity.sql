-- Migration 0002: the consumers' activity per minute, for the operator's console
-- (schema.sql is the whole current schema).

-- Consumer activity per consumer and minute (whole minutes since the Unix epoch, UTC),
-- for the operator's console (the PostgreSQL schema explains it).
CREATE TABLE IF NOT EXISTS {table}_activity (
    consumer  VARCHAR(100) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    minute    BIGINT NOT NULL,
    applied   BIGINT NOT NULL DEFAULT 0,
    duplicate BIGINT NOT NULL DEFAULT 0,
    parked    BIGINT NOT NULL DEFAULT 0,
    lag_sum   DOUBLE NOT NULL DEFAULT 0,
    lag_max   DOUBLE NOT NULL DEFAULT 0,
    lag_count BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (consumer, minute)
) ENGINE = InnoDB;
