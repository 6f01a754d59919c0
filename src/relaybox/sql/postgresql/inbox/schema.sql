-- relaybox's inbox on PostgreSQL: what a consumer has applied, written in the
-- consumer's own transaction together with the handler's effects.
-- By id: one row per (consumer, message id) until the retention window purges it. The
-- primary key is the check: a second copy's INSERT waits on the first copy's
-- uncommitted row, then finds it (skip) or finds it gone with a rollback (apply).
CREATE TABLE IF NOT EXISTS {table} (
    consumer     text NOT NULL,
    message_id   text NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS {prefix}_processed_ix ON {table} (processed_at);

-- By sequence watermark: one row per (consumer, source, lane), the highest sequence
-- applied. A lane is a partition ('p/3') or a key ('k/order-7'), by the inbox's scope:
-- as many rows as partitions (or keys), however many messages. Nothing to purge.
CREATE TABLE IF NOT EXISTS {table}_watermarks (
    consumer   text NOT NULL,
    source     text NOT NULL,
    lane       text NOT NULL,
    sequence   bigint NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, source, lane)
);

-- Parked messages: those a consumer gave up on (a handler that failed on every attempt,
-- a payload that does not validate, a type with no handler), kept whole with why. The
-- inbox records the message in the same transaction, so a copy that comes again is a
-- duplicate: a parked message is applied only when an operator asks for it (status
-- 'replay'), once, by a consumer of this name (status 'replayed'); or it is
-- 'discarded'. attributes and headers are JSON objects; payload the bytes received.
CREATE TABLE IF NOT EXISTS {table}_parked (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer     text NOT NULL,
    message_id   text NOT NULL,
    source       text NOT NULL,
    type         text NOT NULL,
    topic        text NOT NULL,
    message_key  text,
    content_type text,
    attributes   text NOT NULL,
    headers      text NOT NULL,
    payload      bytea NOT NULL,
    reason       text NOT NULL,
    error        text NOT NULL,
    attempts     integer NOT NULL,
    parked_at    timestamptz NOT NULL DEFAULT now(),
    status       text NOT NULL DEFAULT 'parked',
    changed_at   timestamptz,
    changed_by   text,
    note         text
);
CREATE INDEX IF NOT EXISTS {prefix}_parked_ix ON {table}_parked (consumer, status, id);

-- Attempts counted here where the broker counts no deliveries (Kafka, MQTT, webhooks,
-- a classic RabbitMQ queue's redeliveries): one row per message that failed, or that
-- came again without a count, until it is parked or the retention purges it.
CREATE TABLE IF NOT EXISTS {table}_attempts (
    consumer   text NOT NULL,
    message_id text NOT NULL,
    attempts   integer NOT NULL,
    last_error text,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);

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
