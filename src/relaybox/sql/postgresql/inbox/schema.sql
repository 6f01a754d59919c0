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
