-- SQLite queries, `?` placeholders bound in the order they appear.
-- Times: UTC text from strftime('%Y-%m-%d %H:%M:%f', 'now', <modifier>); a float of
-- seconds becomes a modifier with printf('%+.3f seconds', ?) (NULL counts as 0).
-- SQLite's clock ticks in milliseconds, so "expired" and "older than" are `<=` here:
-- two statements in the same millisecond see the same now, where PostgreSQL's
-- microsecond now() would already have moved on.
-- Lists of seqs, partitions, targets and failures travel as one JSON array read with
-- json_each, so every query has one fixed shape whatever the number of rows.

-- name: insert_one
-- id (uuid text), target, external (0/1), topic, key, partition, type, content_type,
-- payload (bytes), headers (JSON text), correlation_id, causation_id, tenant_id,
-- aggregate_id, occurred_at (UTC text 'YYYY-MM-DD HH:MM:SS.ffffff'), delay seconds.
INSERT INTO {table} (id, target, external, topic, "key", "partition", type, content_type,
    payload, headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at,
    available_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?,
    strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', ?)));

-- name: insert_values
-- Bulk insert: this prefix, then `insert_row` repeated and joined with ", ".
INSERT INTO {table} (id, target, external, topic, "key", "partition", type, content_type,
    payload, headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at,
    available_at)
VALUES;

-- name: insert_row
(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?,
    strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', ?)));

-- name: claim
-- Run inside BEGIN IMMEDIATE, which serializes claims between processes.
-- partitions JSON or NULL, partition count, partitions again, targets JSON or NULL
-- (twice), limit, worker, token, lease seconds. A row's partition is its stored hash
-- modulo the count. Same rule as PostgreSQL: a candidate is dropped when an earlier live
-- row of its (target, key) is not itself a candidate.
-- Rows behind a head that is not due or is leased are skipped inside the scan, so a
-- key with a long blocked backlog never uses up the limit for the other keys.
WITH candidates AS MATERIALIZED (
    SELECT seq, target, "key" FROM {table} o
    WHERE status IN ('pending', 'processing', 'failed')
      AND CASE WHEN status = 'processing'
               THEN locked_until <= strftime('%Y-%m-%d %H:%M:%f', 'now')
               ELSE available_at <= strftime('%Y-%m-%d %H:%M:%f', 'now') END
      AND (? IS NULL OR "partition" % ? IN (SELECT value FROM json_each(?)))
      AND (? IS NULL OR target IN (SELECT value FROM json_each(?)))
      AND ("key" IS NULL OR NOT EXISTS (
          SELECT 1 FROM {table} h
          WHERE h.target = o.target AND h."key" = o."key" AND h.seq < o.seq
            AND h."key" IS NOT NULL AND h.status IN ('pending', 'processing', 'failed')
            AND CASE WHEN h.status = 'processing'
                     THEN h.locked_until > strftime('%Y-%m-%d %H:%M:%f', 'now')
                     ELSE h.available_at > strftime('%Y-%m-%d %H:%M:%f', 'now') END))
    ORDER BY seq
    LIMIT ?
), claimable AS (
    SELECT c.seq FROM candidates c
    WHERE c."key" IS NULL OR NOT EXISTS (
        SELECT 1 FROM {table} e
        WHERE e.target = c.target AND e."key" = c."key" AND e.seq < c.seq
          AND e.status IN ('pending', 'processing', 'failed')
          AND e.seq NOT IN (SELECT x.seq FROM candidates x))
)
UPDATE {table}
SET status = 'processing', locked_by = ?, lock_token = ?,
    locked_until = strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', ?))
WHERE seq IN (SELECT seq FROM claimable)
RETURNING seq, id, target, external, topic, "key", "partition", type, content_type,
    payload, headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at,
    attempts;

-- name: read
-- The owned read of a relay that holds its partitions: due rows, oldest first, that
-- no earlier live row of their (target, key) holds back (waiting, or claimed by a
-- row-lease relay), leaving out what the relay has in flight. Nothing is written.
-- seqs in flight JSON, partitions JSON or NULL, partition count, partitions again,
-- targets JSON or NULL (twice), seqs in flight again, limit.
-- `clock` reads 'now' once: SQLite keeps 'now' only within one sqlite3_step, and each
-- row this SELECT returns is a step of its own. Read per row, a head whose delay ends
-- between two steps was not due when its own row was scanned, yet no longer held its
-- key back when a later row of the key was: that row came out first (found by the
-- conformance suite's random histories; tests/integration/test_sqlite_clock.py).
WITH busy(target, "key") AS MATERIALIZED (
    SELECT target, "key" FROM {table}
    WHERE seq IN (SELECT value FROM json_each(?)) AND "key" IS NOT NULL
), clock(now) AS MATERIALIZED (
    SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')
)
SELECT seq, id, target, external, topic, "key", "partition", type, content_type,
    payload, headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at,
    attempts
FROM {table} o, clock
WHERE status IN ('pending', 'processing', 'failed')
  AND CASE WHEN status = 'processing'
           THEN locked_until <= clock.now
           ELSE available_at <= clock.now END
  AND (? IS NULL OR "partition" % ? IN (SELECT value FROM json_each(?)))
  AND (? IS NULL OR target IN (SELECT value FROM json_each(?)))
  AND ("key" IS NULL OR NOT EXISTS (
      SELECT 1 FROM busy b WHERE b.target = o.target AND b."key" = o."key"))
  AND seq NOT IN (SELECT value FROM json_each(?))
  AND ("key" IS NULL OR NOT EXISTS (
      SELECT 1 FROM {table} h
      WHERE h.target = o.target AND h."key" = o."key" AND h.seq < o.seq
        AND h."key" IS NOT NULL AND h.status IN ('pending', 'processing', 'failed')
        AND CASE WHEN h.status = 'processing'
                 THEN h.locked_until > clock.now
                 ELSE h.available_at > clock.now END))
ORDER BY seq
LIMIT ?;

-- The owned settle: each statement changes only live rows in partitions the worker
-- holds (stored hash modulo the partition count); one transaction runs them all.

-- name: fail_owned
-- failures JSON [[seq, error, retry_in], ...], partition count, worker.
UPDATE {table} AS o
SET status = 'failed', attempts = o.attempts + 1, last_error = f.error,
    available_at = strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', f.retry_in)),
    locked_by = NULL, locked_until = NULL, lock_token = NULL
FROM (SELECT json_extract(value, '$[0]') AS seq, json_extract(value, '$[1]') AS error,
             json_extract(value, '$[2]') AS retry_in
      FROM json_each(?)) AS f
WHERE o.seq = f.seq AND o.status IN ('pending', 'processing', 'failed')
  AND o."partition" % ? IN (SELECT "partition" FROM {table}_partitions WHERE owner = ?);

-- name: abandon_owned
-- failures JSON [[seq, error], ...], partition count, worker.
UPDATE {table} AS o
SET status = 'abandoned', attempts = o.attempts + 1, last_error = f.error,
    abandoned_at = strftime('%Y-%m-%d %H:%M:%f', 'now'),
    locked_by = NULL, locked_until = NULL, lock_token = NULL
FROM (SELECT json_extract(value, '$[0]') AS seq, json_extract(value, '$[1]') AS error
      FROM json_each(?)) AS f
WHERE o.seq = f.seq AND o.status IN ('pending', 'processing', 'failed')
  AND o."partition" % ? IN (SELECT "partition" FROM {table}_partitions WHERE owner = ?);

-- name: delete_owned
-- seqs JSON, partition count, worker.
DELETE FROM {table}
WHERE seq IN (SELECT value FROM json_each(?)) AND status IN ('pending', 'processing', 'failed')
  AND "partition" % ? IN (SELECT "partition" FROM {table}_partitions WHERE owner = ?);

-- name: publish_owned
-- seqs JSON, partition count, worker.
UPDATE {table}
SET status = 'published', published_at = strftime('%Y-%m-%d %H:%M:%f', 'now'),
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq IN (SELECT value FROM json_each(?)) AND status IN ('pending', 'processing', 'failed')
  AND "partition" % ? IN (SELECT "partition" FROM {table}_partitions WHERE owner = ?);

-- name: mark_published
-- seqs JSON, token.
UPDATE {table}
SET status = 'published', published_at = strftime('%Y-%m-%d %H:%M:%f', 'now'),
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq IN (SELECT value FROM json_each(?)) AND lock_token = ? AND status = 'processing';

-- name: delete_published
-- seqs JSON, token.
DELETE FROM {table}
WHERE seq IN (SELECT value FROM json_each(?)) AND lock_token = ? AND status = 'processing';

-- name: mark_failed
-- failures JSON [[seq, error, retry_in], ...], token.
UPDATE {table} AS o
SET status = 'failed', attempts = o.attempts + 1, last_error = f.error,
    available_at = strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', f.retry_in)),
    locked_by = NULL, locked_until = NULL, lock_token = NULL
FROM (SELECT json_extract(value, '$[0]') AS seq, json_extract(value, '$[1]') AS error,
             json_extract(value, '$[2]') AS retry_in
      FROM json_each(?)) AS f
WHERE o.seq = f.seq AND o.lock_token = ? AND o.status = 'processing';

-- name: abandon
-- failures JSON [[seq, error], ...], token.
UPDATE {table} AS o
SET status = 'abandoned', attempts = o.attempts + 1, last_error = f.error,
    abandoned_at = strftime('%Y-%m-%d %H:%M:%f', 'now'),
    locked_by = NULL, locked_until = NULL, lock_token = NULL
FROM (SELECT json_extract(value, '$[0]') AS seq, json_extract(value, '$[1]') AS error
      FROM json_each(?)) AS f
WHERE o.seq = f.seq AND o.lock_token = ? AND o.status = 'processing';

-- name: release
-- seqs JSON, token.
UPDATE {table}
SET status = 'pending', locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq IN (SELECT value FROM json_each(?)) AND lock_token = ? AND status = 'processing';

-- name: renew
-- lease seconds, seqs JSON, token.
UPDATE {table}
SET locked_until = strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', ?))
WHERE seq IN (SELECT value FROM json_each(?)) AND lock_token = ? AND status = 'processing';

-- name: recover_expired
UPDATE {table}
SET status = 'pending', locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE status IN ('pending', 'processing', 'failed') AND status = 'processing'
  AND locked_until <= strftime('%Y-%m-%d %H:%M:%f', 'now');

-- name: purge_published
-- age seconds, batch size.
DELETE FROM {table} WHERE seq IN (
    SELECT seq FROM {table}
    WHERE status = 'published'
      AND published_at <= strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', -?))
    ORDER BY published_at LIMIT ?);

-- name: purge_abandoned
-- age seconds, batch size.
DELETE FROM {table} WHERE seq IN (
    SELECT seq FROM {table}
    WHERE status = 'abandoned'
      AND abandoned_at <= strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', -?))
    ORDER BY abandoned_at LIMIT ?);

-- name: replay
-- seqs JSON.
UPDATE {table}
SET status = 'pending', attempts = 0, available_at = strftime('%Y-%m-%d %H:%M:%f', 'now'),
    abandoned_at = NULL
WHERE status = 'abandoned' AND seq IN (SELECT value FROM json_each(?));

-- name: abandoned
-- Abandoned rows, newest first: seq below which to list (NULL: from the newest), twice;
-- target (NULL: any), twice; limit.
SELECT seq, id, target, topic, "key", type, attempts, last_error, abandoned_at, occurred_at
FROM {table}
WHERE status = 'abandoned' AND (? IS NULL OR seq < ?) AND (? IS NULL OR target = ?)
ORDER BY seq DESC
LIMIT ?;

-- name: count_by_status
SELECT status, count(*) FROM {table} GROUP BY status;

-- name: oldest_pending_age
SELECT (julianday('now') - julianday(min(available_at))) * 86400.0 FROM {table}
WHERE status IN ('pending', 'processing', 'failed') AND status <> 'processing'
  AND available_at <= strftime('%Y-%m-%d %H:%M:%f', 'now');

-- name: active_leases
SELECT count(*) FROM {table}
WHERE status IN ('pending', 'processing', 'failed') AND status = 'processing'
  AND locked_until > strftime('%Y-%m-%d %H:%M:%f', 'now');

-- Partition leases (seed 002). A heartbeat runs members_expire through partitions_take
-- in one BEGIN IMMEDIATE transaction, in this order.

-- name: members_expire
DELETE FROM {table}_members WHERE lease_until <= strftime('%Y-%m-%d %H:%M:%f', 'now');

-- name: member_join
-- worker, lease seconds.
INSERT INTO {table}_members (worker, lease_until)
VALUES (?, strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', ?)))
ON CONFLICT (worker) DO UPDATE SET lease_until = excluded.lease_until;

-- name: partitions_create
-- partitions. `WHERE true` tells the parser that ON CONFLICT is not a join constraint.
WITH RECURSIVE numbers(p) AS (SELECT 0 UNION ALL SELECT p + 1 FROM numbers WHERE p + 1 < ?)
INSERT INTO {table}_partitions ("partition")
SELECT p FROM numbers WHERE true
ON CONFLICT ("partition") DO NOTHING;

-- name: members_live
SELECT count(*) FROM {table}_members
WHERE lease_until > strftime('%Y-%m-%d %H:%M:%f', 'now');

-- name: partitions_renew
-- lease seconds, worker. Returns every partition the worker holds.
UPDATE {table}_partitions
SET lease_until = strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', ?))
WHERE owner = ?
RETURNING "partition";

-- name: partitions_release
-- worker, the partitions it gives back as JSON.
UPDATE {table}_partitions SET owner = NULL, lease_until = NULL
WHERE owner = ? AND "partition" IN (SELECT value FROM json_each(?));

-- name: partitions_take
-- worker, lease seconds, partitions, how many. Free or expired ones, lowest first.
UPDATE {table}_partitions
SET owner = ?, lease_until = strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', ?))
WHERE "partition" IN (
    SELECT "partition" FROM {table}_partitions
    WHERE "partition" < ?
      AND (owner IS NULL OR lease_until <= strftime('%Y-%m-%d %H:%M:%f', 'now'))
    ORDER BY "partition"
    LIMIT ?)
RETURNING "partition";

-- name: partitions_leave
-- worker.
UPDATE {table}_partitions SET owner = NULL, lease_until = NULL WHERE owner = ?;

-- name: member_leave
-- worker.
DELETE FROM {table}_members WHERE worker = ?;
