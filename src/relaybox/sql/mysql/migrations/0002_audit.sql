-- Migration 0002: the audit of operators' changes (schema.sql is the whole current
-- schema; tests/migration holds the two to each other).

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
