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
