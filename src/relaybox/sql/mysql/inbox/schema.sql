-- relaybox's inbox on MySQL and MariaDB (the PostgreSQL schema explains each table).
-- Key columns are VARCHARs in utf8mb4_bin: compared byte for byte, as
-- message ids must be (a case-insensitive collation would merge two ids).
CREATE TABLE IF NOT EXISTS {table} (
    consumer     VARCHAR(100) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    message_id   VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    processed_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    -- Copies seen after the first: the check counts them (see queries.sql, claim_id).
    duplicates   INT NOT NULL DEFAULT 0,
    PRIMARY KEY (consumer, message_id),
    KEY {prefix}_processed_ix (processed_at)
) ENGINE = InnoDB;

CREATE TABLE IF NOT EXISTS {table}_watermarks (
    consumer   VARCHAR(100) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    source     VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    lane       VARCHAR(260) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    sequence   BIGINT NOT NULL,
    updated_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    -- 2,460 bytes in utf8mb4: under InnoDB's 3,072-byte key limit, no prefix index
    -- (a prefix would make two long keys one).
    PRIMARY KEY (consumer, source, lane)
) ENGINE = InnoDB;

-- Parked messages and counted attempts (the PostgreSQL schema explains them). Times are
-- UTC, set by the queries (UTC_TIMESTAMP: a DATETIME default can only be local time).
CREATE TABLE IF NOT EXISTS {table}_parked (
    id           BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    consumer     VARCHAR(100) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    message_id   VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    source       VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    type         VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    topic        VARCHAR(1024) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    message_key  VARCHAR(1024) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    content_type VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    attributes   MEDIUMTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    headers      MEDIUMTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    payload      LONGBLOB NOT NULL,
    reason       VARCHAR(32) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    error        TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    attempts     INT NOT NULL,
    parked_at    DATETIME(6) NOT NULL,
    status       VARCHAR(16) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL DEFAULT 'parked',
    changed_at   DATETIME(6),
    changed_by   VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    note         TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    KEY {prefix}_parked_ix (consumer, status, id)
) ENGINE = InnoDB;

CREATE TABLE IF NOT EXISTS {table}_attempts (
    consumer   VARCHAR(100) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    message_id VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    attempts   INT NOT NULL,
    last_error TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    updated_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (consumer, message_id)
) ENGINE = InnoDB;

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
