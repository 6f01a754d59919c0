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

-- name: purge
-- consumer, seconds of retention, batch size.
DELETE FROM {table}
WHERE consumer = $1 AND message_id = ANY (ARRAY(
    SELECT message_id FROM {table}
    WHERE consumer = $1 AND processed_at < now() - $2 * interval '1 second'
    LIMIT $3));
