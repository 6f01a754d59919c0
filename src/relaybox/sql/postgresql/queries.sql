-- name: insert_one
-- Writers of one key take turns: a transaction-scoped advisory lock on the key ($17,
-- computed by the writer; NULL for a keyless message, which the strict function then
-- skips) is taken before the row gets its seq, so a key's seq order is also its commit
-- order: the relay can never see seq 2 of a key committed while seq 1 is in flight.
INSERT INTO {table} (id, target, external, topic, key, partition, type, content_type,
    payload, headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at,
    available_at)
-- In a SELECT list parameters get no type from the target columns: cast every one.
SELECT $1::uuid, $2::text, $3::boolean, $4::text, $5::text, $6::integer, $7::text,
    $8::text, $9::bytea, $10::jsonb, $11::text, $12::text, $13::text, $14::text,
    $15::timestamptz, now() + $16::float8 * interval '1 second'
FROM pg_advisory_xact_lock($17::bigint) AS key_lock;

-- name: insert_one_now
-- The common case, no delay: available_at takes its default. $16 is the key lock.
INSERT INTO {table} (id, target, external, topic, key, partition, type, content_type,
    payload, headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at)
SELECT $1::uuid, $2::text, $3::boolean, $4::text, $5::text, $6::integer, $7::text,
    $8::text, $9::bytea, $10::jsonb, $11::text, $12::text, $13::text, $14::text,
    $15::timestamptz
FROM pg_advisory_xact_lock($16::bigint) AS key_lock;

-- name: insert_many
-- One statement, one shape, whatever the number of rows: arrays unnested, rows kept in
-- the caller's order (so seq follows it), key locks taken in a fixed order.
WITH key_lock AS (
    SELECT pg_advisory_xact_lock(h) FROM (
        SELECT DISTINCT h FROM unnest($17::bigint[]) AS h WHERE h IS NOT NULL ORDER BY 1
    ) AS locks
)
INSERT INTO {table} (id, target, external, topic, key, partition, type, content_type,
    payload, headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at,
    available_at)
SELECT r.id, r.target, r.external, r.topic, r.key, r.partition, r.type, r.content_type,
    r.payload, r.headers::jsonb, r.correlation_id, r.causation_id, r.tenant_id,
    r.aggregate_id, r.occurred_at, now() + r.delay * interval '1 second'
FROM (SELECT count(*) FROM key_lock) AS locked,
    unnest($1::uuid[], $2::text[], $3::boolean[], $4::text[], $5::text[], $6::integer[],
    $7::text[], $8::text[], $9::bytea[], $10::text[], $11::text[], $12::text[],
    $13::text[], $14::text[], $15::timestamptz[], $16::float8[]) WITH ORDINALITY
    AS r(id, target, external, topic, key, partition, type, content_type, payload, headers,
         correlation_id, causation_id, tenant_id, aggregate_id, occurred_at, delay, ord)
ORDER BY r.ord;

-- name: claim
-- $1 worker, $2 limit, $3 partitions or NULL, $4 targets or NULL, $5 token, $6 lease s.
-- A row is claimable when it is due and no earlier live row of its (target, key) stays
-- behind: rows another worker holds (skipped, locked) or that are not due block the key.
-- Rows behind a head that is not due or is leased elsewhere are skipped inside the scan,
-- so a key with a long blocked backlog never uses up the limit for the other keys.
WITH candidates AS (
    SELECT seq, target, key FROM {table} o
    WHERE published_at IS NULL AND abandoned_at IS NULL
      AND CASE WHEN status = 'processing' THEN locked_until < now()
               ELSE available_at <= now() END
      AND ($3::integer[] IS NULL OR partition = ANY($3::integer[]))
      AND ($4::text[] IS NULL OR target = ANY($4::text[]))
      AND (key IS NULL OR NOT EXISTS (
          SELECT 1 FROM {table} h
          WHERE h.target = o.target AND h.key = o.key AND h.seq < o.seq
            AND h.key IS NOT NULL AND h.published_at IS NULL AND h.abandoned_at IS NULL
            AND CASE WHEN h.status = 'processing' THEN h.locked_until >= now()
                     ELSE h.available_at > now() END))
    ORDER BY seq
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), claimable AS (
    SELECT c.seq FROM candidates c
    WHERE c.key IS NULL OR NOT EXISTS (
        SELECT 1 FROM {table} e
        WHERE e.target = c.target AND e.key = c.key AND e.seq < c.seq
          AND e.published_at IS NULL AND e.abandoned_at IS NULL
          AND NOT EXISTS (SELECT 1 FROM candidates x WHERE x.seq = e.seq))
)
UPDATE {table} o
SET status = 'processing', locked_by = $1, lock_token = $5,
    locked_until = now() + $6::float8 * interval '1 second'
FROM claimable
WHERE o.seq = claimable.seq
RETURNING o.seq, o.id, o.target, o.external, o.topic, o.key, o.partition, o.type,
    o.content_type, o.payload, o.headers::text, o.correlation_id, o.causation_id,
    o.tenant_id, o.aggregate_id, o.occurred_at, o.created_at, o.attempts;

-- name: mark_published
UPDATE {table}
SET status = 'published', published_at = now(),
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq = ANY($1::bigint[]) AND lock_token = $2 AND status = 'processing';

-- name: delete_published
DELETE FROM {table}
WHERE seq = ANY($1::bigint[]) AND lock_token = $2 AND status = 'processing';

-- name: mark_failed
UPDATE {table} o
SET status = 'failed', attempts = o.attempts + 1, last_error = f.error,
    available_at = now() + f.retry_in * interval '1 second',
    locked_by = NULL, locked_until = NULL, lock_token = NULL
FROM unnest($1::bigint[], $2::text[], $3::float8[]) AS f(seq, error, retry_in)
WHERE o.seq = f.seq AND o.lock_token = $4 AND o.status = 'processing';

-- name: abandon
UPDATE {table} o
SET status = 'abandoned', attempts = o.attempts + 1, last_error = f.error,
    abandoned_at = now(), locked_by = NULL, locked_until = NULL, lock_token = NULL
FROM unnest($1::bigint[], $2::text[]) AS f(seq, error)
WHERE o.seq = f.seq AND o.lock_token = $3 AND o.status = 'processing';

-- name: release
UPDATE {table}
SET status = 'pending', locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq = ANY($1::bigint[]) AND lock_token = $2 AND status = 'processing';

-- name: renew
UPDATE {table}
SET locked_until = now() + $3::float8 * interval '1 second'
WHERE seq = ANY($1::bigint[]) AND lock_token = $2 AND status = 'processing';

-- name: recover_expired
UPDATE {table}
SET status = 'pending', locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE published_at IS NULL AND abandoned_at IS NULL
  AND status = 'processing' AND locked_until < now();

-- name: purge_published
DELETE FROM {table} WHERE seq IN (
    SELECT seq FROM {table}
    WHERE published_at < now() - $1::float8 * interval '1 second'
    ORDER BY published_at LIMIT $2);

-- name: purge_abandoned
DELETE FROM {table} WHERE seq IN (
    SELECT seq FROM {table}
    WHERE abandoned_at < now() - $1::float8 * interval '1 second'
    ORDER BY abandoned_at LIMIT $2);

-- name: replay
UPDATE {table}
SET status = 'pending', attempts = 0, available_at = now(), abandoned_at = NULL
WHERE status = 'abandoned' AND seq = ANY($1::bigint[]);

-- name: count_by_status
SELECT status, count(*) FROM {table} GROUP BY status;

-- name: oldest_pending_age
SELECT extract(epoch FROM now() - min(available_at))::float8 FROM {table}
WHERE published_at IS NULL AND abandoned_at IS NULL
  AND status IN ('pending', 'failed') AND available_at <= now();

-- name: active_leases
SELECT count(*) FROM {table}
WHERE published_at IS NULL AND abandoned_at IS NULL
  AND status = 'processing' AND locked_until >= now();
