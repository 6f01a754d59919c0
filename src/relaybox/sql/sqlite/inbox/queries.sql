-- Inbox queries, SQLite. Row counts: 1 = apply, 0 = skip. SQLite has one writer at a
-- time, so a second copy's check waits (busy timeout) until the first commits.

-- name: claim_id
-- consumer, message id.
INSERT INTO {table} (consumer, message_id) VALUES (?, ?)
ON CONFLICT (consumer, message_id) DO NOTHING;

-- name: claim_watermark
-- consumer, source, lane, sequence.
INSERT INTO {table}_watermarks (consumer, source, lane, sequence)
VALUES (?, ?, ?, ?)
ON CONFLICT (consumer, source, lane)
DO UPDATE SET sequence = excluded.sequence,
              updated_at = strftime('%Y-%m-%d %H:%M:%f', 'now')
WHERE sequence < excluded.sequence;

-- name: recorded_id
-- consumer, message id. Run after the handler, in its transaction: the record the check
-- made is still there unless the transaction failed meanwhile.
SELECT 1 FROM {table} WHERE consumer = ? AND message_id = ?;

-- name: recorded_watermark
-- consumer, source, lane, sequence. As recorded_id, for the watermark the check moved.
SELECT 1 FROM {table}_watermarks
WHERE consumer = ? AND source = ? AND lane = ? AND sequence >= ?;

-- name: purge
-- consumer, seconds of retention, batch size.
DELETE FROM {table}
WHERE consumer = ? AND message_id IN (
    SELECT message_id FROM {table}
    WHERE consumer = ?
      AND processed_at < strftime('%Y-%m-%d %H:%M:%f', 'now', printf('-%.3f seconds', ?))
    LIMIT ?);

-- Parked messages (see the schema). Each statement that moves a row from one status to
-- another names the status it expects: its row count says whether it did.

-- name: park
-- consumer, message id, source, type, topic, key, content type, attributes, headers,
-- payload, reason, error, attempts.
INSERT INTO {table}_parked (consumer, message_id, source, type, topic, message_key,
    content_type, attributes, headers, payload, reason, error, attempts, parked_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, strftime('%Y-%m-%d %H:%M:%f', 'now'));

-- name: count_attempt
-- consumer, message id, error (NULL: an attempt begun, its outcome not known yet).
INSERT INTO {table}_attempts (consumer, message_id, attempts, last_error)
VALUES (?, ?, 1, ?)
ON CONFLICT (consumer, message_id)
DO UPDATE SET attempts = attempts + 1, last_error = COALESCE(excluded.last_error, last_error),
              updated_at = strftime('%Y-%m-%d %H:%M:%f', 'now');

-- name: attempts
-- consumer, message id.
SELECT attempts, last_error FROM {table}_attempts WHERE consumer = ? AND message_id = ?;

-- name: forget_attempts
-- consumer, message id.
DELETE FROM {table}_attempts WHERE consumer = ? AND message_id = ?;

-- name: purge_attempts
-- consumer, seconds of retention, batch size.
DELETE FROM {table}_attempts
WHERE consumer = ? AND message_id IN (
    SELECT message_id FROM {table}_attempts
    WHERE consumer = ?
      AND updated_at < strftime('%Y-%m-%d %H:%M:%f', 'now', printf('-%.3f seconds', ?))
    LIMIT ?);

-- name: parked
-- id.
SELECT id, consumer, message_id, source, type, topic, message_key, content_type, attributes,
       headers, payload, reason, error, attempts, parked_at, status, changed_at, changed_by,
       note
FROM {table}_parked WHERE id = ?;

-- name: requested
-- consumer, batch size: the messages whose replay was asked for, oldest first.
SELECT id, consumer, message_id, source, type, topic, message_key, content_type, attributes,
       headers, payload, reason, error, attempts, parked_at, status, changed_at, changed_by,
       note
FROM {table}_parked WHERE consumer = ? AND status = 'replay' ORDER BY id LIMIT ?;

-- name: listing
-- status, consumer (NULL: any), type (NULL: any), before id (NULL: from the newest),
-- limit: newest first.
SELECT id, consumer, message_id, source, type, topic, message_key, content_type, attributes,
       headers, payload, reason, error, attempts, parked_at, status, changed_at, changed_by,
       note
FROM {table}_parked
WHERE status = ? AND consumer = COALESCE(?, consumer) AND type = COALESCE(?, type)
  AND id < COALESCE(?, id + 1)
ORDER BY id DESC LIMIT ?;

-- name: parked_counts
-- (none): per consumer, how many of its messages are parked now.
SELECT consumer, count(*) FROM {table}_parked
WHERE status = 'parked'
GROUP BY consumer ORDER BY consumer;

-- name: resolve
-- new status ('replay' or 'discarded'), by whom, note, id: only a parked message.
UPDATE {table}_parked SET status = ?, changed_at = strftime('%Y-%m-%d %H:%M:%f', 'now'), changed_by = ?, note = ?
WHERE id = ? AND status = 'parked';

-- name: claim_replay
-- id: the replay's check, in the transaction of its effects, as the inbox's is.
UPDATE {table}_parked SET status = 'replayed', changed_at = strftime('%Y-%m-%d %H:%M:%f', 'now')
WHERE id = ? AND status = 'replay';

-- name: replay_failed
-- reason, error, id: parked again, with one more attempt.
UPDATE {table}_parked SET status = 'parked', reason = ?, error = ?,
    attempts = attempts + 1, changed_at = strftime('%Y-%m-%d %H:%M:%f', 'now')
WHERE id = ? AND status = 'replay';

-- Activity per consumer and minute, for the operator's console (see the schema).

-- name: activity_add
-- consumer, applied, duplicates, parked, lag sum, lag max, lag count: added to the row
-- of the current minute.
INSERT INTO {table}_activity
    (consumer, minute, applied, duplicate, parked, lag_sum, lag_max, lag_count)
VALUES (?, CAST(strftime('%s', 'now') AS INTEGER) / 60, ?, ?, ?, ?, ?, ?)
ON CONFLICT (consumer, minute) DO UPDATE SET
    applied = applied + excluded.applied,
    duplicate = duplicate + excluded.duplicate,
    parked = parked + excluded.parked,
    lag_sum = lag_sum + excluded.lag_sum,
    lag_max = max(lag_max, excluded.lag_max),
    lag_count = lag_count + excluded.lag_count;

-- name: activity_since
-- the first minute.
SELECT consumer, minute, applied, duplicate, parked, lag_sum, lag_max, lag_count
FROM {table}_activity
WHERE minute >= ?
ORDER BY consumer, minute;

-- name: activity_purge
-- seconds of retention, batch size.
DELETE FROM {table}_activity WHERE (consumer, minute) IN (
    SELECT consumer, minute FROM {table}_activity
    WHERE minute < (CAST(strftime('%s', 'now') AS INTEGER) - ?) / 60
    ORDER BY minute LIMIT ?);
