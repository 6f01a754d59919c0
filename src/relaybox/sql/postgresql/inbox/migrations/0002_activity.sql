-- Migration 0002: the consumers' activity per minute, for the operator's console
-- (schema.sql is the whole current schema).

-- Consumer activity, for the operator's console: per consumer and minute (whole minutes
-- since the Unix epoch, UTC, on the database's clock), how many messages were applied,
-- skipped as duplicates and parked, and the seconds from each applied message's time
-- (when its writer created it) to the commit of its effects. Every process of a
-- consumer adds what it counted since its last write every few seconds (an upsert that
-- adds), in a short transaction of its own. Rows older than the activity retention
-- (two hours) are purged with the inbox's expired ids.
CREATE TABLE IF NOT EXISTS {table}_activity (
    consumer  text NOT NULL,
    minute    bigint NOT NULL,
    applied   bigint NOT NULL DEFAULT 0,
    duplicate bigint NOT NULL DEFAULT 0,
    parked    bigint NOT NULL DEFAULT 0,
    lag_sum   float8 NOT NULL DEFAULT 0,
    lag_max   float8 NOT NULL DEFAULT 0,
    lag_count bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (consumer, minute)
);
