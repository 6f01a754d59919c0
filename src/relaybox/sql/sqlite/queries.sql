-- relaybox's named queries on SQLite. The writer's inserts take `?` placeholders in the
-- order they appear (a bulk insert repeats insert_row); every other query numbers its
-- parameters (?1 ...), as on PostgreSQL.
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
-- The row-lease claim. Run inside BEGIN IMMEDIATE, which serializes claims between
-- processes. ?1 partitions JSON or NULL, ?2 partition count, ?3 targets JSON or NULL,
-- ?4 limit, ?5 worker, ?6 token, ?7 lease seconds, ?8 the byte budget, ?9 whether a
-- first payload over it goes alone. A row's partition is its stored hash modulo the
-- count. A candidate is dropped when an earlier live row of its (target, key) is not
-- itself a candidate. Rows behind a head that is not due or is leased are skipped
-- inside the scan, so a key with a long blocked backlog never uses up the limit for the
-- other keys. Last, the byte budget: the claimable rows go in seq order while their
-- payloads together stay within ?8 (length() of a blob reads no blob); the running sum
-- (a window function, dearer than the plain sum) only when their total is over it.
-- The rows are walked in the live index, named (INDEXED BY): see `read`.
WITH candidates AS MATERIALIZED (
    SELECT seq, target, "key", length(payload) AS size
    FROM {table} o INDEXED BY {prefix}_live_ix
    WHERE status IN ('pending', 'processing', 'failed')
      AND CASE WHEN status = 'processing'
               THEN locked_until <= strftime('%Y-%m-%d %H:%M:%f', 'now')
               ELSE available_at <= strftime('%Y-%m-%d %H:%M:%f', 'now') END
      AND (?1 IS NULL OR "partition" % ?2 IN (SELECT value FROM json_each(?1)))
      AND (?3 IS NULL OR target IN (SELECT value FROM json_each(?3)))
      AND ("key" IS NULL OR NOT EXISTS (
          SELECT 1 FROM {table} h INDEXED BY {prefix}_key_ix
          WHERE h.target = o.target AND h."key" = o."key" AND h.seq < o.seq
            AND h."key" IS NOT NULL AND h.status IN ('pending', 'processing', 'failed')
            AND CASE WHEN h.status = 'processing'
                     THEN h.locked_until > strftime('%Y-%m-%d %H:%M:%f', 'now')
                     ELSE h.available_at > strftime('%Y-%m-%d %H:%M:%f', 'now') END))
    ORDER BY seq
    LIMIT ?4
), claimable AS (
    SELECT c.seq, c.size FROM candidates c
    WHERE c."key" IS NULL OR NOT EXISTS (
        SELECT 1 FROM {table} e INDEXED BY {prefix}_key_ix
        WHERE e.target = c.target AND e."key" = c."key" AND e.seq < c.seq
          AND e.status IN ('pending', 'processing', 'failed')
          AND e.seq NOT IN (SELECT x.seq FROM candidates x))
), kept AS (
    SELECT seq FROM claimable
    WHERE (SELECT sum(size) FROM claimable) <= ?8
       OR seq <= (
           SELECT max(seq) FROM (
               SELECT seq, size, sum(size) OVER (ORDER BY seq) AS through FROM claimable)
           WHERE through <= ?8 OR (?9 AND through = size))
)
UPDATE {table}
SET status = 'processing', locked_by = ?5, lock_token = ?6,
    locked_until = strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', ?7))
WHERE seq IN (SELECT seq FROM kept)
RETURNING seq, id, target, external, topic, "key", "partition", type, content_type,
    payload, headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at,
    attempts;

-- name: read
-- The owned read of a relay that holds its partitions: due rows, oldest first, that
-- no earlier live row of their (target, key) holds back (waiting, or claimed by a
-- row-lease relay), leaving out what the relay has in flight. Nothing is written.
-- ?1 seqs in flight JSON, ?2 partitions JSON or NULL, ?3 partition count, ?4 targets
-- JSON or NULL, ?5 limit, ?6 the byte budget, ?7 whether a first payload over it goes
-- alone. The rows are chosen by seq and payload size alone (length() of a blob reads
-- no blob), cut to the byte budget (the running sum only when their total is over it),
-- and only those kept are read whole: the payloads of rows past the budget are never
-- loaded.
-- `clock` reads 'now' once: SQLite keeps 'now' steady only within one sqlite3_step, and
-- each row this SELECT returns is a step of its own. Read per row, a head whose delay
-- ends between two steps would not be due when its own row was scanned, yet no longer
-- hold its key back when a later row of the key was: that row would come out first.
-- The rows are walked in the live index, named (INDEXED BY), and each key's earlier rows
-- in the key index: with the index left to the planner, SQLite walked the table itself
-- in seq order once it was analyzed, reading every finished row kept under a retention
-- (they stay in this table) before the first live one.
WITH busy(target, "key") AS MATERIALIZED (
    SELECT target, "key" FROM {table}
    WHERE seq IN (SELECT value FROM json_each(?1)) AND "key" IS NOT NULL
), clock(now) AS MATERIALIZED (
    SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')
), picked AS MATERIALIZED (
    SELECT seq, length(payload) AS size
    FROM {table} o INDEXED BY {prefix}_live_ix, clock
    WHERE status IN ('pending', 'processing', 'failed')
      AND CASE WHEN status = 'processing'
               THEN locked_until <= clock.now
               ELSE available_at <= clock.now END
      AND (?2 IS NULL OR "partition" % ?3 IN (SELECT value FROM json_each(?2)))
      AND (?4 IS NULL OR target IN (SELECT value FROM json_each(?4)))
      AND ("key" IS NULL OR NOT EXISTS (
          SELECT 1 FROM busy b WHERE b.target = o.target AND b."key" = o."key"))
      AND seq NOT IN (SELECT value FROM json_each(?1))
      AND ("key" IS NULL OR NOT EXISTS (
          SELECT 1 FROM {table} h INDEXED BY {prefix}_key_ix
          WHERE h.target = o.target AND h."key" = o."key" AND h.seq < o.seq
            AND h."key" IS NOT NULL AND h.status IN ('pending', 'processing', 'failed')
            AND CASE WHEN h.status = 'processing'
                     THEN h.locked_until > clock.now
                     ELSE h.available_at > clock.now END))
    ORDER BY seq
    LIMIT ?5
), kept AS (
    SELECT seq FROM picked
    WHERE (SELECT sum(size) FROM picked) <= ?6
       OR seq <= (
           SELECT max(seq) FROM (
               SELECT seq, size, sum(size) OVER (ORDER BY seq) AS through FROM picked)
           WHERE through <= ?6 OR (?7 AND through = size))
)
SELECT seq, id, target, external, topic, "key", "partition", type, content_type,
    payload, headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at,
    attempts
FROM {table}
WHERE seq IN (SELECT seq FROM kept)
ORDER BY seq;

-- The owned settle: each statement changes only live rows in partitions the worker
-- holds (stored hash modulo the partition count); a settle that needs several runs them
-- in one transaction.
-- Every settle and mark finds its rows by `seq IN` the list it was given, the outbox
-- table its only table: failures too, their error and retry looked up, per row, in one
-- JSON object keyed by seq (a subquery that depends on no row: built once). As a join of
-- the table to the list of failures, SQLite, once the table was analyzed while it held
-- a handful of rows (a drained outbox), walked the whole live index, and the list once
-- per row. (A statement that starts with WITH would not report the rows it changed.)

-- name: fail_owned
-- ?1 failures JSON [[seq, error, retry_in], ...], ?2 worker, ?3 partition count.
UPDATE {table} AS o
SET status = 'failed', attempts = o.attempts + 1,
    last_error = json_extract(
        (SELECT json_group_object(json_extract(value, '$[0]'), value) FROM json_each(?1)),
        '$."' || o.seq || '"[1]'),
    available_at = strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', json_extract(
        (SELECT json_group_object(json_extract(value, '$[0]'), value) FROM json_each(?1)),
        '$."' || o.seq || '"[2]'))),
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE o.seq IN (SELECT json_extract(value, '$[0]') FROM json_each(?1))
  AND o.status IN ('pending', 'processing', 'failed')
  AND (o.target, o."partition" % ?3) IN (
      SELECT target, "partition" FROM {table}_partitions WHERE owner = ?2);

-- name: abandon_owned
-- ?1 failures JSON [[seq, error], ...], ?2 worker, ?3 partition count.
UPDATE {table} AS o
SET status = 'abandoned', attempts = o.attempts + 1,
    last_error = json_extract(
        (SELECT json_group_object(json_extract(value, '$[0]'), value) FROM json_each(?1)),
        '$."' || o.seq || '"[1]'),
    abandoned_at = strftime('%Y-%m-%d %H:%M:%f', 'now'),
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE o.seq IN (SELECT json_extract(value, '$[0]') FROM json_each(?1))
  AND o.status IN ('pending', 'processing', 'failed')
  AND (o.target, o."partition" % ?3) IN (
      SELECT target, "partition" FROM {table}_partitions WHERE owner = ?2);

-- name: delete_owned
-- ?1 seqs JSON, ?2 worker, ?3 partition count.
DELETE FROM {table}
WHERE seq IN (SELECT value FROM json_each(?1)) AND status IN ('pending', 'processing', 'failed')
  AND (target, "partition" % ?3) IN (
      SELECT target, "partition" FROM {table}_partitions WHERE owner = ?2);

-- name: publish_owned
-- ?1 seqs JSON, ?2 worker, ?3 partition count.
UPDATE {table}
SET status = 'published', published_at = strftime('%Y-%m-%d %H:%M:%f', 'now'),
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq IN (SELECT value FROM json_each(?1)) AND status IN ('pending', 'processing', 'failed')
  AND (target, "partition" % ?3) IN (
      SELECT target, "partition" FROM {table}_partitions WHERE owner = ?2);

-- The row-lease marks: each changes only rows still in processing under the claim's
-- token.

-- name: mark_published
-- ?1 seqs JSON, ?2 token.
UPDATE {table}
SET status = 'published', published_at = strftime('%Y-%m-%d %H:%M:%f', 'now'),
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq IN (SELECT value FROM json_each(?1)) AND lock_token = ?2 AND status = 'processing';

-- name: delete_published
-- ?1 seqs JSON, ?2 token.
DELETE FROM {table}
WHERE seq IN (SELECT value FROM json_each(?1)) AND lock_token = ?2 AND status = 'processing';

-- name: mark_failed
-- ?1 failures JSON [[seq, error, retry_in], ...], ?2 token.
UPDATE {table} AS o
SET status = 'failed', attempts = o.attempts + 1,
    last_error = json_extract(
        (SELECT json_group_object(json_extract(value, '$[0]'), value) FROM json_each(?1)),
        '$."' || o.seq || '"[1]'),
    available_at = strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', json_extract(
        (SELECT json_group_object(json_extract(value, '$[0]'), value) FROM json_each(?1)),
        '$."' || o.seq || '"[2]'))),
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE o.seq IN (SELECT json_extract(value, '$[0]') FROM json_each(?1))
  AND o.lock_token = ?2 AND o.status = 'processing';

-- name: abandon
-- ?1 failures JSON [[seq, error], ...], ?2 token.
UPDATE {table} AS o
SET status = 'abandoned', attempts = o.attempts + 1,
    last_error = json_extract(
        (SELECT json_group_object(json_extract(value, '$[0]'), value) FROM json_each(?1)),
        '$."' || o.seq || '"[1]'),
    abandoned_at = strftime('%Y-%m-%d %H:%M:%f', 'now'),
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE o.seq IN (SELECT json_extract(value, '$[0]') FROM json_each(?1))
  AND o.lock_token = ?2 AND o.status = 'processing';

-- name: release
-- ?1 seqs JSON, ?2 token.
UPDATE {table}
SET status = 'pending', locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq IN (SELECT value FROM json_each(?1)) AND lock_token = ?2 AND status = 'processing';

-- name: renew
-- ?1 seqs JSON, ?2 token, ?3 lease seconds.
UPDATE {table}
SET locked_until = strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', ?3))
WHERE seq IN (SELECT value FROM json_each(?1)) AND lock_token = ?2 AND status = 'processing';

-- What operators need.

-- name: purge_published
-- ?1 age seconds, ?2 batch size.
DELETE FROM {table} WHERE seq IN (
    SELECT seq FROM {table}
    WHERE status = 'published'
      AND published_at <= strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', -?1))
    ORDER BY published_at LIMIT ?2);

-- name: purge_abandoned
-- ?1 age seconds, ?2 batch size.
DELETE FROM {table} WHERE seq IN (
    SELECT seq FROM {table}
    WHERE status = 'abandoned'
      AND abandoned_at <= strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', -?1))
    ORDER BY abandoned_at LIMIT ?2);

-- name: replay
-- ?1 seqs JSON.
UPDATE {table}
SET status = 'pending', attempts = 0, available_at = strftime('%Y-%m-%d %H:%M:%f', 'now'),
    abandoned_at = NULL
WHERE status = 'abandoned' AND seq IN (SELECT value FROM json_each(?1));

-- name: abandoned
-- Abandoned rows, newest first: ?1 seq below which to list (NULL: from the newest),
-- ?2 target (NULL: any), ?3 limit.
SELECT seq, id, target, topic, "key", type, attempts, last_error, abandoned_at, occurred_at
FROM {table}
WHERE status = 'abandoned' AND (?1 IS NULL OR seq < ?1) AND (?2 IS NULL OR target = ?2)
ORDER BY seq DESC
LIMIT ?3;

-- name: count_by_status
SELECT status, count(*) FROM {table} GROUP BY status;

-- name: live_by_target
-- Rows still to deliver, per target.
SELECT target, count(*) FROM {table}
WHERE status IN ('pending', 'processing', 'failed') GROUP BY target;

-- name: oldest_pending_age
SELECT (julianday('now') - julianday(min(available_at))) * 86400.0 FROM {table}
WHERE status IN ('pending', 'processing', 'failed') AND status <> 'processing'
  AND available_at <= strftime('%Y-%m-%d %H:%M:%f', 'now');

-- name: active_leases
SELECT count(*) FROM {table}
WHERE status IN ('pending', 'processing', 'failed') AND status = 'processing'
  AND locked_until > strftime('%Y-%m-%d %H:%M:%f', 'now');

-- name: probe
-- Run when a storage connects: it fails (and relaybox says to migrate) if a table is
-- missing.
SELECT 1 FROM {table} WHERE 0
UNION ALL SELECT 1 FROM {table}_partitions WHERE 0
UNION ALL SELECT 1 FROM {table}_members WHERE 0;

-- Partition leases, per target. A heartbeat of one target runs members_expire through
-- partitions_take in one BEGIN IMMEDIATE transaction, in this order.

-- name: members_expire
DELETE FROM {table}_members WHERE lease_until <= strftime('%Y-%m-%d %H:%M:%f', 'now');

-- name: member_join
-- ?1 worker, ?2 lease seconds, ?3 target.
INSERT INTO {table}_members (worker, target, lease_until)
VALUES (?1, ?3, strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', ?2)))
ON CONFLICT (worker, target) DO UPDATE SET lease_until = excluded.lease_until;

-- name: partitions_create
-- ?1 partitions, ?2 target. `WHERE true` tells the parser that ON CONFLICT is not a
-- join constraint.
WITH RECURSIVE numbers(p) AS (SELECT 0 UNION ALL SELECT p + 1 FROM numbers WHERE p + 1 < ?1)
INSERT INTO {table}_partitions (target, "partition")
SELECT ?2, p FROM numbers WHERE true
ON CONFLICT (target, "partition") DO NOTHING;

-- name: members_live
-- ?1 target: how many live relays serve it.
SELECT count(*) FROM {table}_members
WHERE target = ?1 AND lease_until > strftime('%Y-%m-%d %H:%M:%f', 'now');

-- name: members_targets
-- The targets some live relay serves.
SELECT DISTINCT target FROM {table}_members
WHERE lease_until > strftime('%Y-%m-%d %H:%M:%f', 'now');

-- name: partitions_renew
-- ?1 worker, ?2 lease seconds, ?3 target. Returns every partition of the target the
-- worker holds.
UPDATE {table}_partitions
SET lease_until = strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', ?2))
WHERE owner = ?1 AND target = ?3
RETURNING "partition";

-- name: partitions_release
-- ?1 worker, ?2 the partitions it gives back as JSON, ?3 target.
UPDATE {table}_partitions SET owner = NULL, lease_until = NULL
WHERE owner = ?1 AND target = ?3 AND "partition" IN (SELECT value FROM json_each(?2));

-- name: partitions_take
-- ?1 worker, ?2 lease seconds, ?3 partitions, ?4 how many, ?5 target. Free or expired
-- ones, lowest first.
UPDATE {table}_partitions
SET owner = ?1, lease_until = strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', ?2))
WHERE target = ?5 AND "partition" IN (
    SELECT "partition" FROM {table}_partitions
    WHERE target = ?5 AND "partition" < ?3
      AND (owner IS NULL OR lease_until <= strftime('%Y-%m-%d %H:%M:%f', 'now'))
    ORDER BY "partition"
    LIMIT ?4)
RETURNING "partition";

-- name: partitions_leave
-- ?1 worker: every target's partitions.
UPDATE {table}_partitions SET owner = NULL, lease_until = NULL WHERE owner = ?1;

-- name: member_leave
-- ?1 worker.
DELETE FROM {table}_members WHERE worker = ?1;

-- name: relay_members
-- The live relays (the console's list): each membership still within its lease.
SELECT worker, target, joined_at, lease_until FROM {table}_members
WHERE lease_until > strftime('%Y-%m-%d %H:%M:%f', 'now')
ORDER BY target, worker;

-- name: relay_partitions
-- Which partitions each live relay holds, by target.
SELECT target, owner, "partition" FROM {table}_partitions
WHERE owner IS NOT NULL AND lease_until > strftime('%Y-%m-%d %H:%M:%f', 'now')
ORDER BY target, owner, "partition";

-- Activity and status, for the operator's console (schema.sql explains the tables).

-- name: activity_add
-- ?1 target, ?2 worker, ?3 published, ?4 failed, ?5 abandoned, ?6 lag sum, ?7 lag max,
-- ?8 lag count: added to the row of the current minute.
INSERT INTO {table}_activity
    (target, minute, worker, published, failed, abandoned, lag_sum, lag_max, lag_count)
VALUES (?1, CAST(strftime('%s', 'now') AS INTEGER) / 60, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
ON CONFLICT (target, minute, worker) DO UPDATE SET
    published = published + excluded.published,
    failed = failed + excluded.failed,
    abandoned = abandoned + excluded.abandoned,
    lag_sum = lag_sum + excluded.lag_sum,
    lag_max = max(lag_max, excluded.lag_max),
    lag_count = lag_count + excluded.lag_count;

-- name: relay_status_set
-- ?1 worker, ?2 target, ?3 circuit state, ?4 last error.
INSERT INTO {table}_relay_status (worker, target, circuit, last_error, updated_at)
VALUES (?1, ?2, ?3, ?4, strftime('%Y-%m-%d %H:%M:%f', 'now'))
ON CONFLICT (worker, target) DO UPDATE SET
    circuit = excluded.circuit, last_error = excluded.last_error,
    updated_at = excluded.updated_at;

-- name: activity_since
-- ?1 the first minute. Per target and minute, summed over the relays.
SELECT target, minute, sum(published), sum(failed), sum(abandoned), sum(lag_sum),
    max(lag_max), sum(lag_count)
FROM {table}_activity
WHERE minute >= ?1
GROUP BY target, minute
ORDER BY target, minute;

-- name: relay_statuses
-- ?1 seconds: rows updated within them.
SELECT worker, target, circuit, last_error, updated_at FROM {table}_relay_status
WHERE updated_at >= strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', -?1))
ORDER BY target, worker;

-- name: activity_purge
-- ?1 age in seconds, ?2 batch size.
DELETE FROM {table}_activity WHERE rowid IN (
    SELECT rowid FROM {table}_activity
    WHERE minute < (CAST(strftime('%s', 'now') AS INTEGER) - ?1) / 60
    ORDER BY minute LIMIT ?2);

-- name: relay_status_purge
-- ?1 age in seconds, ?2 batch size.
DELETE FROM {table}_relay_status WHERE rowid IN (
    SELECT rowid FROM {table}_relay_status
    WHERE updated_at < strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', -?1))
    ORDER BY updated_at LIMIT ?2);
