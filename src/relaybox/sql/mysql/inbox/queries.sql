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

-- name: recorded_id
-- consumer, message id. Run after the handler, in its transaction: the record the check
-- made is still there unless the transaction failed meanwhile.
SELECT 1 FROM {table} WHERE consumer = %s AND message_id = %s;

-- name: recorded_watermark
-- consumer, source, lane, sequence. As recorded_id, for the watermark the check moved.
SELECT 1 FROM {table}_watermarks
WHERE consumer = %s AND source = %s AND lane = %s AND sequence >= %s;

-- name: purge
-- consumer, seconds of retention, batch size.
DELETE FROM {table}
WHERE consumer = %s AND processed_at < CURRENT_TIMESTAMP(6) - INTERVAL %s SECOND
ORDER BY processed_at LIMIT %s;

-- Parked messages (see the schema). Each statement that moves a row from one status to
-- another names the status it expects: its row count says whether it did.

-- name: park
-- consumer, message id, source, type, topic, key, content type, attributes, headers,
-- payload, reason, error, attempts.
INSERT INTO {table}_parked (consumer, message_id, source, type, topic, message_key,
    content_type, attributes, headers, payload, reason, error, attempts, parked_at)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, UTC_TIMESTAMP(6));

-- name: count_attempt
-- consumer, message id, error, error again (NULL: an attempt begun, its outcome not
-- known yet). Not VALUES(): MySQL 8 warns that it is deprecated.
INSERT INTO {table}_attempts (consumer, message_id, attempts, last_error)
VALUES (%s, %s, 1, %s)
ON DUPLICATE KEY UPDATE attempts = attempts + 1, last_error = COALESCE(%s, last_error),
    updated_at = CURRENT_TIMESTAMP(6);

-- name: attempts
-- consumer, message id.
SELECT attempts, last_error FROM {table}_attempts WHERE consumer = %s AND message_id = %s;

-- name: forget_attempts
-- consumer, message id.
DELETE FROM {table}_attempts WHERE consumer = %s AND message_id = %s;

-- name: purge_attempts
-- consumer, seconds of retention, batch size.
DELETE FROM {table}_attempts
WHERE consumer = %s AND updated_at < CURRENT_TIMESTAMP(6) - INTERVAL %s SECOND
ORDER BY updated_at LIMIT %s;

-- name: parked
-- id.
SELECT id, consumer, message_id, source, type, topic, message_key, content_type, attributes,
       headers, payload, reason, error, attempts, parked_at, status, changed_at, changed_by,
       note
FROM {table}_parked WHERE id = %s;

-- name: requested
-- consumer, batch size: the messages whose replay was asked for, oldest first.
SELECT id, consumer, message_id, source, type, topic, message_key, content_type, attributes,
       headers, payload, reason, error, attempts, parked_at, status, changed_at, changed_by,
       note
FROM {table}_parked WHERE consumer = %s AND status = 'replay' ORDER BY id LIMIT %s;

-- name: listing
-- status, consumer (NULL: any), type (NULL: any), before id (NULL: from the newest),
-- limit: newest first.
SELECT id, consumer, message_id, source, type, topic, message_key, content_type, attributes,
       headers, payload, reason, error, attempts, parked_at, status, changed_at, changed_by,
       note
FROM {table}_parked
WHERE status = %s AND consumer = COALESCE(%s, consumer) AND type = COALESCE(%s, type)
  AND id < COALESCE(%s, id + 1)
ORDER BY id DESC LIMIT %s;

-- name: parked_counts
-- (none): per consumer, how many of its messages are parked now.
SELECT consumer, count(*) FROM {table}_parked
WHERE status = 'parked'
GROUP BY consumer ORDER BY consumer;

-- name: resolve
-- new status ('replay' or 'discarded'), by whom, note, id: only a parked message.
UPDATE {table}_parked SET status = %s, changed_at = UTC_TIMESTAMP(6), changed_by = %s, note = %s
WHERE id = %s AND status = 'parked';

-- name: claim_replay
-- id: the replay's check, in the transaction of its effects, as the inbox's is.
UPDATE {table}_parked SET status = 'replayed', changed_at = UTC_TIMESTAMP(6)
WHERE id = %s AND status = 'replay';

-- name: replay_failed
-- reason, error, id: parked again, with one more attempt.
UPDATE {table}_parked SET status = 'parked', reason = %s, error = %s,
    attempts = attempts + 1, changed_at = UTC_TIMESTAMP(6)
WHERE id = %s AND status = 'replay';

-- Activity per consumer and minute, for the operator's console (see the schema).

-- name: activity_add
-- consumer, applied, duplicates, parked, lag sum, lag max, lag count, then applied,
-- duplicates, parked, lag sum, lag max, lag count again: added to the row of the
-- database's current minute. Not VALUES(): MySQL 8 warns that it is deprecated.
INSERT INTO {table}_activity
    (consumer, minute, applied, duplicate, parked, lag_sum, lag_max, lag_count)
VALUES (%s, FLOOR(UNIX_TIMESTAMP() / 60), %s, %s, %s, %s, %s, %s)
ON DUPLICATE KEY UPDATE
    applied = applied + %s, duplicate = duplicate + %s, parked = parked + %s,
    lag_sum = lag_sum + %s, lag_max = GREATEST(lag_max, %s), lag_count = lag_count + %s;

-- name: activity_since
-- the first minute.
SELECT consumer, minute, applied, duplicate, parked, lag_sum, lag_max, lag_count
FROM {table}_activity
WHERE minute >= %s
ORDER BY consumer, minute;

-- name: activity_purge
-- seconds of retention, batch size.
DELETE FROM {table}_activity
WHERE minute < FLOOR((UNIX_TIMESTAMP() - %s) / 60)
ORDER BY minute LIMIT %s;
