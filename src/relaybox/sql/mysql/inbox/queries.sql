-- Inbox queries, MySQL/MariaDB. Row count 1 = apply; anything else = skip.
-- No INSERT IGNORE: it turns every error into a warning, and drivers fetch and raise
-- warnings (aiomysql makes a round trip for them).

-- name: claim_id
-- consumer, message id. 1 row affected: inserted, apply. 2: an existing row was
-- changed (its duplicates counter), skip. A real change, so the count is 2 whether or
-- not the client set CLIENT_FOUND_ROWS (SQLAlchemy does), where a no-op update would
-- count 0 without it and 1 with it, like an insert.
INSERT INTO {table} (consumer, message_id) VALUES (%s, %s)
ON DUPLICATE KEY UPDATE duplicates = duplicates + 1;

-- name: watermark_row
-- consumer, source, lane. The mark's row, at -1 the first time; its count is not read.
INSERT INTO {table}_watermarks (consumer, source, lane, sequence)
VALUES (%s, %s, %s, -1)
ON DUPLICATE KEY UPDATE sequence = sequence;

-- name: claim_watermark
-- sequence, consumer, source, lane, sequence. An UPDATE, not ON
-- DUPLICATE KEY: its row count is the same with and without CLIENT_FOUND_ROWS (which
-- SQLAlchemy sets), since the WHERE matches only a row it changes.
UPDATE {table}_watermarks SET sequence = %s, updated_at = CURRENT_TIMESTAMP(6)
WHERE consumer = %s AND source = %s AND lane = %s AND sequence < %s;

-- name: purge
-- consumer, seconds of retention, batch size.
DELETE FROM {table}
WHERE consumer = %s AND processed_at < CURRENT_TIMESTAMP(6) - INTERVAL %s SECOND
ORDER BY processed_at LIMIT %s;
