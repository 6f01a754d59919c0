-- Inbox queries, PostgreSQL. Each check's row count says it all: 1 = apply, 0 = skip.

-- name: claim_id
-- consumer, message id.
INSERT INTO {table} (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING;

-- name: claim_watermark
-- consumer, source, lane, sequence. Moves the mark only forward; a copy at or below
-- it updates nothing. A concurrent copy waits on the row lock, then re-reads it.
INSERT INTO {table}_watermarks AS w (consumer, source, lane, sequence)
VALUES ($1, $2, $3, $4)
ON CONFLICT (consumer, source, lane)
DO UPDATE SET sequence = excluded.sequence, updated_at = now()
WHERE w.sequence < excluded.sequence;

-- name: recorded_id
-- consumer, message id. Run after the handler, in its transaction: the record the check
-- made is still there unless the transaction failed meanwhile.
SELECT 1 FROM {table} WHERE consumer = $1 AND message_id = $2;

-- name: recorded_watermark
-- consumer, source, lane, sequence. As recorded_id, for the watermark the check moved.
SELECT 1 FROM {table}_watermarks
WHERE consumer = $1 AND source = $2 AND lane = $3 AND sequence >= $4;

-- name: purge
-- consumer, seconds of retention, batch size.
DELETE FROM {table}
WHERE consumer = $1 AND message_id = ANY (ARRAY(
    SELECT message_id FROM {table}
    WHERE consumer = $1 AND processed_at < now() - $2 * interval '1 second'
    LIMIT $3));

-- Parked messages (see the schema). Each statement that moves a row from one status to
-- another names the status it expects: its row count says whether it did.

-- name: park
-- consumer, message id, source, type, topic, key, content type, attributes, headers,
-- payload, reason, error, attempts.
INSERT INTO {table}_parked (consumer, message_id, source, type, topic, message_key,
    content_type, attributes, headers, payload, reason, error, attempts, parked_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, now());

-- name: count_attempt
-- consumer, message id, error (NULL: an attempt begun, its outcome not known yet).
INSERT INTO {table}_attempts AS a (consumer, message_id, attempts, last_error)
VALUES ($1, $2, 1, $3)
ON CONFLICT (consumer, message_id)
DO UPDATE SET attempts = a.attempts + 1, last_error = COALESCE(excluded.last_error, a.last_error),
              updated_at = now();

-- name: attempts
-- consumer, message id.
SELECT attempts, last_error FROM {table}_attempts WHERE consumer = $1 AND message_id = $2;

-- name: forget_attempts
-- consumer, message id.
DELETE FROM {table}_attempts WHERE consumer = $1 AND message_id = $2;

-- name: purge_attempts
-- consumer, seconds of retention, batch size.
DELETE FROM {table}_attempts
WHERE consumer = $1 AND message_id = ANY (ARRAY(
    SELECT message_id FROM {table}_attempts
    WHERE consumer = $1 AND updated_at < now() - $2 * interval '1 second'
    LIMIT $3));

-- name: parked
-- id.
SELECT id, consumer, message_id, source, type, topic, message_key, content_type, attributes,
       headers, payload, reason, error, attempts, parked_at, status, changed_at, changed_by,
       note
FROM {table}_parked WHERE id = $1;

-- name: requested
-- consumer, batch size: the messages whose replay was asked for, oldest first.
SELECT id, consumer, message_id, source, type, topic, message_key, content_type, attributes,
       headers, payload, reason, error, attempts, parked_at, status, changed_at, changed_by,
       note
FROM {table}_parked WHERE consumer = $1 AND status = 'replay' ORDER BY id LIMIT $2;

-- name: listing
-- status, consumer (NULL: any), type (NULL: any), before id (NULL: from the newest),
-- limit: newest first.
SELECT id, consumer, message_id, source, type, topic, message_key, content_type, attributes,
       headers, payload, reason, error, attempts, parked_at, status, changed_at, changed_by,
       note
FROM {table}_parked
WHERE status = $1 AND consumer = COALESCE($2, consumer) AND type = COALESCE($3, type)
  AND id < COALESCE($4, id + 1)
ORDER BY id DESC LIMIT $5;

-- name: parked_counts
-- (none): per consumer, how many of its messages are parked now.
SELECT consumer, count(*) FROM {table}_parked
WHERE status = 'parked'
GROUP BY consumer ORDER BY consumer;

-- name: resolve
-- new status ('replay' or 'discarded'), by whom, note, id: only a parked message.
UPDATE {table}_parked SET status = $1, changed_at = now(), changed_by = $2, note = $3
WHERE id = $4 AND status = 'parked';

-- name: claim_replay
-- id: the replay's check, in the transaction of its effects, as the inbox's is.
UPDATE {table}_parked SET status = 'replayed', changed_at = now()
WHERE id = $1 AND status = 'replay';

-- name: replay_failed
-- reason, error, id: parked again, with one more attempt.
UPDATE {table}_parked SET status = 'parked', reason = $1, error = $2,
    attempts = attempts + 1, changed_at = now()
WHERE id = $3 AND status = 'replay';

-- Activity per consumer and minute, for the operator's console (see the schema).

-- name: activity_add
-- consumer, applied, duplicates, parked, lag sum, lag max, lag count: added to the row
-- of the database's current minute.
INSERT INTO {table}_activity AS a
    (consumer, minute, applied, duplicate, parked, lag_sum, lag_max, lag_count)
VALUES ($1, floor(extract(epoch FROM now()) / 60)::bigint, $2::bigint, $3::bigint,
        $4::bigint, $5::float8, $6::float8, $7::bigint)
ON CONFLICT (consumer, minute) DO UPDATE SET
    applied = a.applied + excluded.applied,
    duplicate = a.duplicate + excluded.duplicate,
    parked = a.parked + excluded.parked,
    lag_sum = a.lag_sum + excluded.lag_sum,
    lag_max = greatest(a.lag_max, excluded.lag_max),
    lag_count = a.lag_count + excluded.lag_count;

-- name: activity_since
-- the first minute.
SELECT consumer, minute, applied, duplicate, parked, lag_sum, lag_max, lag_count
FROM {table}_activity
WHERE minute >= $1::bigint
ORDER BY consumer, minute;

-- name: activity_purge
-- seconds of retention, batch size.
DELETE FROM {table}_activity WHERE (consumer, minute) IN (
    SELECT consumer, minute FROM {table}_activity
    WHERE minute < floor((extract(epoch FROM now()) - $1::float8) / 60)
    ORDER BY minute LIMIT $2::integer);
