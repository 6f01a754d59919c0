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

-- name: purge
-- consumer, seconds of retention, batch size.
DELETE FROM {table}
WHERE consumer = ? AND message_id IN (
    SELECT message_id FROM {table}
    WHERE consumer = ?
      AND processed_at < strftime('%Y-%m-%d %H:%M:%f', 'now', printf('-%.3f seconds', ?))
    LIMIT ?);
