-- Partition leases (seed 002): which relay processes are alive, and which of them owns
-- each partition of the keys, until when. Every heartbeat renews both (queries.sql).
-- Times are UTC, as in the outbox table.
CREATE TABLE IF NOT EXISTS {table}_members (
    worker      VARCHAR(255) NOT NULL,
    lease_until DATETIME(6) NOT NULL,
    joined_at   DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (worker)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE TABLE IF NOT EXISTS {table}_partitions (
    `partition` INT NOT NULL,
    owner       VARCHAR(255) NULL,
    lease_until DATETIME(6) NULL,
    PRIMARY KEY (`partition`),
    CONSTRAINT {prefix}_partitions_lease_ck CHECK ((owner IS NULL) = (lease_until IS NULL))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
