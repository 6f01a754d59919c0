-- The outbox: one row per (message, target). Times are UTC (DATETIME(6) has no zone).
-- MariaDB and MySQL have no partial indexes: the claim's index leads with status (one
-- range per live status) and the key index holds live_key, NULL once a row is finished,
-- so neither walks the published rows that retention keeps.
CREATE TABLE IF NOT EXISTS {table} (
    seq            BIGINT NOT NULL AUTO_INCREMENT,
    status         VARCHAR(10) NOT NULL DEFAULT 'pending',
    attempts       INT NOT NULL DEFAULT 0,
    available_at   DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    locked_by      VARCHAR(255) NULL,
    locked_until   DATETIME(6) NULL,
    lock_token     CHAR(36) NULL,
    published_at   DATETIME(6) NULL,
    abandoned_at   DATETIME(6) NULL,
    last_error     MEDIUMTEXT NULL,
    id             CHAR(36) NOT NULL,
    target         VARCHAR(64) NOT NULL,
    external       BOOL NOT NULL DEFAULT FALSE,
    topic          VARCHAR(255) NOT NULL,
    `key`          VARCHAR(255) NULL,
    `partition`    INT NOT NULL,
    type           VARCHAR(255) NOT NULL,
    content_type   VARCHAR(255) NOT NULL,
    payload        LONGBLOB NOT NULL,
    headers        JSON NOT NULL DEFAULT ('{}'),
    correlation_id VARCHAR(255) NULL,
    causation_id   VARCHAR(255) NULL,
    tenant_id      VARCHAR(255) NULL,
    aggregate_id   VARCHAR(255) NULL,
    occurred_at    DATETIME(6) NOT NULL,
    created_at     DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    -- `key` while the row is live, NULL once it is finished: a partial index by hand.
    live_key       VARCHAR(255) GENERATED ALWAYS AS (
        CASE WHEN status IN ('pending', 'processing', 'failed') THEN `key` END) STORED,
    PRIMARY KEY (seq),
    -- The claim walks each live status in sequence order (one range per status);
    -- available_at rides along (it changes only with status) for the oldest-age stat.
    KEY {prefix}_live_ix (status, seq, available_at),
    -- Per-key order: "is there an earlier live row of this (target, key)?" One range
    -- per key, finished rows out of the way, untouched by pending <-> processing.
    KEY {prefix}_key_ix (target, live_key, seq),
    -- Retention purges. Only published rows have published_at and only abandoned rows
    -- abandoned_at, so these entries change once per row, not at every status change.
    KEY {prefix}_published_ix (published_at),
    KEY {prefix}_abandoned_ix (abandoned_at),
    CONSTRAINT {prefix}_status_ck
        CHECK (status IN ('pending', 'processing', 'published', 'failed', 'abandoned'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
