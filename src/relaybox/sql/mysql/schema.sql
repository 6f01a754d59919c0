-- relaybox's outbox on MySQL 8 and MariaDB 10.6+: the whole schema, as the migrations
-- build it. `relaybox schema --dialect mysql --table NAME` prints it for a table.

-- Each statement is idempotent: MySQL commits every DDL statement on its own, so a run
-- cut short can simply run again.

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

-- Writers of one key take turns. Sequences are assigned at insert, not at commit: if
-- two transactions wrote one key concurrently, seq 2 could commit (and be published)
-- while seq 1 was still in flight. So before inserting, a writer locks its keys' slots
-- in this table (SELECT ... FOR UPDATE, held to its commit). 4096 fixed slots: no
-- growth, no writes, and two keys share a slot with probability 1/4096.
CREATE TABLE IF NOT EXISTS {table}_key_locks (
    slot INT NOT NULL PRIMARY KEY
) ENGINE=InnoDB;

INSERT IGNORE INTO {table}_key_locks (slot)
SELECT a.n * 256 + b.n * 16 + c.n
FROM (SELECT 0 AS n UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9 UNION ALL SELECT 10 UNION ALL SELECT 11 UNION ALL SELECT 12 UNION ALL SELECT 13 UNION ALL SELECT 14 UNION ALL SELECT 15) AS a
CROSS JOIN (SELECT 0 AS n UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9 UNION ALL SELECT 10 UNION ALL SELECT 11 UNION ALL SELECT 12 UNION ALL SELECT 13 UNION ALL SELECT 14 UNION ALL SELECT 15) AS b
CROSS JOIN (SELECT 0 AS n UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9 UNION ALL SELECT 10 UNION ALL SELECT 11 UNION ALL SELECT 12 UNION ALL SELECT 13 UNION ALL SELECT 14 UNION ALL SELECT 15) AS c;

-- Partition leases, per target: which relay processes are alive and which targets each
-- serves, and which of them owns each partition of a target's keys, until when. Each
-- target's partitions are shared among the relays that serve it, so relays serving
-- different targets never strand each other's rows. Every heartbeat renews both
-- (queries.sql).
-- Times are UTC, as in the outbox table.
CREATE TABLE IF NOT EXISTS {table}_members (
    worker      VARCHAR(255) NOT NULL,
    target      VARCHAR(64) NOT NULL,
    lease_until DATETIME(6) NOT NULL,
    joined_at   DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (worker, target)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE TABLE IF NOT EXISTS {table}_partitions (
    target      VARCHAR(64) NOT NULL,
    `partition` INT NOT NULL,
    owner       VARCHAR(255) NULL,
    lease_until DATETIME(6) NULL,
    PRIMARY KEY (target, `partition`),
    CONSTRAINT {prefix}_partitions_lease_ck CHECK ((owner IS NULL) = (lease_until IS NULL))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- The operator's changes, one record per message changed: who, when, what and why.
-- Written in the transaction of the change itself, read newest first (by id).
CREATE TABLE IF NOT EXISTS {table}_audit (
    id         BIGINT NOT NULL AUTO_INCREMENT,
    at         DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    actor      VARCHAR(255) NOT NULL,
    action     VARCHAR(16) NOT NULL,
    reason     TEXT NULL,
    seq        BIGINT NOT NULL,
    message_id CHAR(36) NOT NULL,
    target     VARCHAR(64) NOT NULL,
    `key`      VARCHAR(255) NULL,
    PRIMARY KEY (id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Backfills: retained messages copied again, in seq order, as new messages to a target.
-- cursor_seq is the seq of the last source message copied; it moves in the transaction
-- that writes the copies, so a backfill stopped anywhere goes on from there.
CREATE TABLE IF NOT EXISTS {table}_backfills (
    name        VARCHAR(200) NOT NULL,
    source      TEXT NOT NULL,
    target      VARCHAR(64) NOT NULL,
    external    BOOLEAN NOT NULL,
    cursor_seq  BIGINT NOT NULL DEFAULT 0,
    copied      BIGINT NOT NULL DEFAULT 0,
    actor       VARCHAR(255) NOT NULL,
    reason      TEXT NULL,
    created_at  DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    updated_at  DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    finished_at DATETIME(6) NULL,
    PRIMARY KEY (name)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

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
