-- Migration 0003: the relays' activity and status per target, for the operator's
-- console (schema.sql is the whole current schema).

-- Relay activity, for the operator's console, which reads it from another process:
-- per target, minute and relay process (worker), what the relay's deliveries came to.
-- Each relay adds what it counted since its last write every few seconds (an upsert
-- that adds), so a row holds the sums of its minute. minute counts whole minutes since
-- the Unix epoch, UTC, on the database's clock. lag_* are seconds from a message's
-- creation to the broker's confirmation, one observation per publish call. Rows older
-- than the relay's activity retention are purged by its housekeeping.
CREATE TABLE IF NOT EXISTS {table}_activity (
    target    text COLLATE "C" NOT NULL,
    minute    bigint NOT NULL,
    worker    text NOT NULL,
    published bigint NOT NULL DEFAULT 0,
    failed    bigint NOT NULL DEFAULT 0,
    abandoned bigint NOT NULL DEFAULT 0,
    lag_sum   float8 NOT NULL DEFAULT 0,
    lag_max   float8 NOT NULL DEFAULT 0,
    lag_count bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (target, minute, worker)
);

-- Each relay's view of each target it serves, written with its activity: the target's
-- circuit state and the last error a publish to it met (secrets masked). A row updated
-- lately is a live relay's.
CREATE TABLE IF NOT EXISTS {table}_relay_status (
    worker     text NOT NULL,
    target     text COLLATE "C" NOT NULL,
    circuit    text NOT NULL,
    last_error text,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (worker, target)
);
