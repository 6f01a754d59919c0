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

-- A row held meanwhile (available_at at the held time: an operator held it between the
-- read and the settle) stays held: a failed or abandoned settle leaves it alone, where a
-- published one may still delete it (the message went out). A row delayed meanwhile
-- keeps its delay: a failed settle never makes a row due sooner.

-- name: fail_owned
-- ?1 failures JSON [[seq, error, retry_in], ...], ?2 worker, ?3 partition count, ?4 the
-- held rows' due time.
UPDATE {table} AS o
SET status = 'failed', attempts = o.attempts + 1,
    last_error = json_extract(
        (SELECT json_group_object(json_extract(value, '$[0]'), value) FROM json_each(?1)),
        '$."' || o.seq || '"[1]'),
    available_at = max(o.available_at, strftime('%Y-%m-%d %H:%M:%f', 'now',
        printf('%+.3f seconds', json_extract(
            (SELECT json_group_object(json_extract(value, '$[0]'), value) FROM json_each(?1)),
            '$."' || o.seq || '"[2]')))),
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE o.seq IN (SELECT json_extract(value, '$[0]') FROM json_each(?1))
  AND o.status IN ('pending', 'processing', 'failed') AND o.available_at < ?4
  AND (o.target, o."partition" % ?3) IN (
      SELECT target, "partition" FROM {table}_partitions WHERE owner = ?2);

-- name: abandon_owned
-- ?1 failures JSON [[seq, error], ...], ?2 worker, ?3 partition count, ?4 whether to
-- hold the keys, ?5 the held rows' due time. With ?4, a row with a key is not abandoned
-- but held: failed, due at ?5, with its error and the attempt counted, so its key's
-- later rows wait behind it.
UPDATE {table} AS o
SET status = CASE WHEN ?4 AND o."key" IS NOT NULL THEN 'failed' ELSE 'abandoned' END,
    attempts = o.attempts + 1,
    last_error = json_extract(
        (SELECT json_group_object(json_extract(value, '$[0]'), value) FROM json_each(?1)),
        '$."' || o.seq || '"[1]'),
    abandoned_at = CASE WHEN ?4 AND o."key" IS NOT NULL THEN NULL
                        ELSE strftime('%Y-%m-%d %H:%M:%f', 'now') END,
    available_at = CASE WHEN ?4 AND o."key" IS NOT NULL THEN ?5 ELSE o.available_at END,
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE o.seq IN (SELECT json_extract(value, '$[0]') FROM json_each(?1))
  AND o.status IN ('pending', 'processing', 'failed') AND o.available_at < ?5
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
-- ?1 failures JSON [[seq, error, retry_in], ...], ?2 token, ?3 the held rows' due time
-- (a row held stays held, as in the settle above).
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
  AND o.lock_token = ?2 AND o.status = 'processing' AND o.available_at < ?3;

-- name: abandon
-- As abandon_owned, fenced by the claim's token: ?1 failures JSON [[seq, error], ...],
-- ?2 token, ?3 whether to hold the keys, ?4 the held rows' due time.
UPDATE {table} AS o
SET status = CASE WHEN ?3 AND o."key" IS NOT NULL THEN 'failed' ELSE 'abandoned' END,
    attempts = o.attempts + 1,
    last_error = json_extract(
        (SELECT json_group_object(json_extract(value, '$[0]'), value) FROM json_each(?1)),
        '$."' || o.seq || '"[1]'),
    abandoned_at = CASE WHEN ?3 AND o."key" IS NOT NULL THEN NULL
                        ELSE strftime('%Y-%m-%d %H:%M:%f', 'now') END,
    available_at = CASE WHEN ?3 AND o."key" IS NOT NULL THEN ?4 ELSE o.available_at END,
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE o.seq IN (SELECT json_extract(value, '$[0]') FROM json_each(?1))
  AND o.lock_token = ?2 AND o.status = 'processing' AND o.available_at < ?4;

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

-- name: abandoned
-- Abandoned rows, newest first: ?1 seq below which to list (NULL: from the newest),
-- ?2 target (NULL: any), ?3 limit.
SELECT seq, id, target, topic, "key", type, attempts, last_error, abandoned_at, occurred_at
FROM {table}
WHERE status = 'abandoned' AND (?1 IS NULL OR seq < ?1) AND (?2 IS NULL OR target = ?2)
ORDER BY seq DESC
LIMIT ?3;

-- The operator's console. Live and finished rows share this table; a row's state is
-- read off it, by the database's clock: abandoned or published (finished), else held
-- (due at the held rows' due time, HELD_UNTIL), in flight (leased, the lease running),
-- retrying (attempted before, or failed), delayed (not due yet), pending.
-- A search walks the table in seq order (its rowid, NOT INDEXED) within a seq range, in
-- {order} (ASC or DESC: the storage runs each as two queries), and stops at the limit;
-- with a target and a key, live rows come from the key index instead, merged with the
-- finished rows of that key. Parameters, the same on every dialect: ?1 whether live
-- rows are wanted, ?2 whether finished ones are, ?3 the states wanted (comma-separated,
-- NULL: any), ?4 target, ?5 topic, ?6 key, ?7 type, ?8 id, ?9 correlation id, ?10
-- causation id, ?11 tenant id, ?12 aggregate id (each NULL: any), ?13 and ?14 the
-- lowest and highest seq, ?15 and ?16 the earliest and latest created_at (NULL: open),
-- ?17 limit, ?18 the held rows' due time.

-- name: search
SELECT * FROM (
    SELECT o.seq, o.id,
        CASE WHEN o.status IN ('published', 'abandoned') THEN o.status
             WHEN o.available_at >= ?18 THEN 'held'
             WHEN o.status = 'processing'
                  AND o.locked_until > strftime('%Y-%m-%d %H:%M:%f', 'now') THEN 'in_flight'
             WHEN o.attempts > 0 OR o.status = 'failed' THEN 'retrying'
             WHEN o.available_at > strftime('%Y-%m-%d %H:%M:%f', 'now') THEN 'delayed'
             ELSE 'pending' END AS state,
        o.target, o.topic, o."key", o.type, o.attempts, o.created_at,
        CASE WHEN o.status IN ('pending', 'processing', 'failed') THEN o.available_at END
            AS available_at,
        o.occurred_at, o.published_at, o.abandoned_at, o.last_error, o.correlation_id
    FROM {table} o NOT INDEXED
    WHERE o.seq BETWEEN ?13 AND ?14
      AND ((?1 AND o.status IN ('pending', 'processing', 'failed'))
           OR (?2 AND o.status IN ('published', 'abandoned')))
      AND (?4 IS NULL OR o.target = ?4)
      AND (?5 IS NULL OR o.topic = ?5)
      AND (?6 IS NULL OR o."key" = ?6)
      AND (?7 IS NULL OR o.type = ?7)
      AND (?8 IS NULL OR o.id = ?8)
      AND (?9 IS NULL OR o.correlation_id = ?9)
      AND (?10 IS NULL OR o.causation_id = ?10)
      AND (?11 IS NULL OR o.tenant_id = ?11)
      AND (?12 IS NULL OR o.aggregate_id = ?12)
      AND (?15 IS NULL OR o.created_at >= ?15)
      AND (?16 IS NULL OR o.created_at <= ?16)) AS s
WHERE ?3 IS NULL OR instr(',' || ?3 || ',', ',' || s.state || ',') > 0
ORDER BY s.seq {order}
LIMIT ?17;

-- name: search_abandoned
-- `search` of abandoned rows only: they come from the abandoned purge's partial index, which holds
-- them and no other row, sorted by seq here. Abandoned rows are the few that went
-- wrong, where a walk of the rowids would pass over every live and published row first.
-- ?1 target, ?2 topic, ?3 key, ?4 type, ?5 id, ?6 correlation, ?7 causation, ?8 tenant,
-- ?9 aggregate (each NULL: any), ?10 and ?11 the seq range, ?12 and ?13 the written
-- range (NULL: open), ?14 limit.
SELECT o.seq, o.id, 'abandoned' AS state, o.target, o.topic, o."key", o.type, o.attempts,
       o.created_at, NULL AS available_at, o.occurred_at, o.published_at, o.abandoned_at,
       o.last_error, o.correlation_id
FROM {table} o INDEXED BY {prefix}_abandoned_ix
WHERE o.status = 'abandoned' AND o.seq BETWEEN ?10 AND ?11
  AND (?1 IS NULL OR o.target = ?1)
  AND (?2 IS NULL OR o.topic = ?2)
  AND (?3 IS NULL OR o."key" = ?3)
  AND (?4 IS NULL OR o.type = ?4)
  AND (?5 IS NULL OR o.id = ?5)
  AND (?6 IS NULL OR o.correlation_id = ?6)
  AND (?7 IS NULL OR o.causation_id = ?7)
  AND (?8 IS NULL OR o.tenant_id = ?8)
  AND (?9 IS NULL OR o.aggregate_id = ?9)
  AND (?12 IS NULL OR o.created_at >= ?12)
  AND (?13 IS NULL OR o.created_at <= ?13)
ORDER BY o.seq {order}
LIMIT ?14;

-- name: search_key
-- `search` of one (target, key) (?4 and ?6, both given): live rows from the key index
-- in seq order; finished ones, which no index of this table finds by key, from the
-- partial indexes of the retention purges (only rows kept under a retention are in
-- them), so that neither walks the other's rows.
-- The live rows' state is tested where it is computed, not in an outer query: SQLite
-- would read the key's every row to sort them (a subquery whose columns call the clock
-- is not merged into the query around it), where this walks the key index in seq order
-- and stops at the limit.
SELECT * FROM (
    SELECT o.seq, o.id,
        CASE WHEN o.available_at >= ?18 THEN 'held'
             WHEN o.status = 'processing'
                  AND o.locked_until > strftime('%Y-%m-%d %H:%M:%f', 'now')
                 THEN 'in_flight'
             WHEN o.attempts > 0 OR o.status = 'failed' THEN 'retrying'
             WHEN o.available_at > strftime('%Y-%m-%d %H:%M:%f', 'now') THEN 'delayed'
             ELSE 'pending' END AS state,
        o.target, o.topic, o."key", o.type, o.attempts, o.created_at, o.available_at,
        o.occurred_at, o.published_at, o.abandoned_at, o.last_error, o.correlation_id
    FROM {table} o INDEXED BY {prefix}_key_ix
    WHERE ?1 AND o.target = ?4 AND o."key" = ?6 AND o.seq BETWEEN ?13 AND ?14
      AND o."key" IS NOT NULL AND o.status IN ('pending', 'processing', 'failed')
      AND (?3 IS NULL OR instr(',' || ?3 || ',', ',' || CASE WHEN o.available_at >= ?18 THEN 'held'
             WHEN o.status = 'processing'
                  AND o.locked_until > strftime('%Y-%m-%d %H:%M:%f', 'now')
                 THEN 'in_flight'
             WHEN o.attempts > 0 OR o.status = 'failed' THEN 'retrying'
             WHEN o.available_at > strftime('%Y-%m-%d %H:%M:%f', 'now') THEN 'delayed'
             ELSE 'pending' END || ',') > 0)
      AND (?5 IS NULL OR o.topic = ?5)
      AND (?7 IS NULL OR o.type = ?7)
      AND (?8 IS NULL OR o.id = ?8)
      AND (?9 IS NULL OR o.correlation_id = ?9)
      AND (?10 IS NULL OR o.causation_id = ?10)
      AND (?11 IS NULL OR o.tenant_id = ?11)
      AND (?12 IS NULL OR o.aggregate_id = ?12)
      AND (?15 IS NULL OR o.created_at >= ?15)
      AND (?16 IS NULL OR o.created_at <= ?16)
    ORDER BY o.seq {order}
    LIMIT ?17)
UNION ALL
SELECT * FROM (
    SELECT o.seq, o.id, o.status AS state, o.target, o.topic, o."key", o.type, o.attempts,
        o.created_at, NULL AS available_at, o.occurred_at, o.published_at, o.abandoned_at,
        o.last_error, o.correlation_id
    FROM {table} o INDEXED BY {prefix}_published_ix
    WHERE ?2 AND o.status = 'published' AND o.seq BETWEEN ?13 AND ?14
      AND o.target = ?4 AND o."key" = ?6
      AND (?3 IS NULL OR instr(',' || ?3 || ',', ',published,') > 0)
      AND (?5 IS NULL OR o.topic = ?5)
      AND (?7 IS NULL OR o.type = ?7)
      AND (?8 IS NULL OR o.id = ?8)
      AND (?9 IS NULL OR o.correlation_id = ?9)
      AND (?10 IS NULL OR o.causation_id = ?10)
      AND (?11 IS NULL OR o.tenant_id = ?11)
      AND (?12 IS NULL OR o.aggregate_id = ?12)
      AND (?15 IS NULL OR o.created_at >= ?15)
      AND (?16 IS NULL OR o.created_at <= ?16)
    ORDER BY o.seq {order}
    LIMIT ?17)
UNION ALL
SELECT * FROM (
    SELECT o.seq, o.id, o.status AS state, o.target, o.topic, o."key", o.type, o.attempts,
        o.created_at, NULL AS available_at, o.occurred_at, o.published_at, o.abandoned_at,
        o.last_error, o.correlation_id
    FROM {table} o INDEXED BY {prefix}_abandoned_ix
    WHERE ?2 AND o.status = 'abandoned' AND o.seq BETWEEN ?13 AND ?14
      AND o.target = ?4 AND o."key" = ?6
      AND (?3 IS NULL OR instr(',' || ?3 || ',', ',abandoned,') > 0)
      AND (?5 IS NULL OR o.topic = ?5)
      AND (?7 IS NULL OR o.type = ?7)
      AND (?8 IS NULL OR o.id = ?8)
      AND (?9 IS NULL OR o.correlation_id = ?9)
      AND (?10 IS NULL OR o.causation_id = ?10)
      AND (?11 IS NULL OR o.tenant_id = ?11)
      AND (?12 IS NULL OR o.aggregate_id = ?12)
      AND (?15 IS NULL OR o.created_at >= ?15)
      AND (?16 IS NULL OR o.created_at <= ?16)
    ORDER BY o.seq {order}
    LIMIT ?17)
ORDER BY 1 {order}
LIMIT ?17;

-- name: messages
-- Messages whole: ?1 their seqs, ?2 the held rows' due time.
SELECT o.seq, o.id,
    CASE WHEN o.status IN ('published', 'abandoned') THEN o.status
         WHEN o.available_at >= ?2 THEN 'held'
         WHEN o.status = 'processing'
              AND o.locked_until > strftime('%Y-%m-%d %H:%M:%f', 'now') THEN 'in_flight'
         WHEN o.attempts > 0 OR o.status = 'failed' THEN 'retrying'
         WHEN o.available_at > strftime('%Y-%m-%d %H:%M:%f', 'now') THEN 'delayed'
         ELSE 'pending' END,
    o.target, o.topic, o."key", o.type, o.attempts, o.created_at,
    CASE WHEN o.status IN ('pending', 'processing', 'failed') THEN o.available_at END,
    o.occurred_at, o.published_at, o.abandoned_at, o.last_error, o.correlation_id,
    o.external, o."partition", o.content_type, o.payload, o.headers, o.causation_id,
    o.tenant_id, o.aggregate_id, o.locked_by, o.locked_until
FROM {table} o
WHERE o.seq IN (SELECT value FROM json_each(?1));

-- The operator's changes, three steps in one BEGIN IMMEDIATE transaction (no other
-- writer runs meanwhile): `<change>_pick` finds the rows of ?1 (seqs JSON) still in a
-- state the change applies to, as of now (?2, where taken, the held rows' due time),
-- audit_record writes one record per row picked, and `<change>` changes the rows
-- picked. A row in flight is leased under a lease still running; a row in processing
-- whose lease ran out is not, and a change that keeps it live puts it back to pending
-- (failed, if it was attempted before), so that no claim takes it by its lease.

-- name: audit_record
-- ?1 the rows picked, ?2 actor, ?3 action, ?4 reason.
INSERT INTO {table}_audit (actor, action, reason, seq, message_id, target, "key")
SELECT ?2, ?3, ?4, seq, id, target, "key" FROM {table}
WHERE seq IN (SELECT value FROM json_each(?1))
ORDER BY seq;

-- name: discard_pick
-- Any row not in flight.
SELECT seq FROM {table}
WHERE seq IN (SELECT value FROM json_each(?1))
  AND NOT (status = 'processing' AND locked_until > strftime('%Y-%m-%d %H:%M:%f', 'now'))
ORDER BY seq;

-- name: discard
DELETE FROM {table} WHERE seq IN (SELECT value FROM json_each(?1));

-- name: reschedule_pick
-- Live rows neither in flight nor held.
SELECT seq FROM {table}
WHERE seq IN (SELECT value FROM json_each(?1))
  AND status IN ('pending', 'processing', 'failed') AND available_at < ?2
  AND NOT (status = 'processing' AND locked_until > strftime('%Y-%m-%d %H:%M:%f', 'now'))
ORDER BY seq;

-- name: reschedule
-- ?1 the rows picked, ?2 seconds from now.
UPDATE {table}
SET available_at = strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', ?2)),
    status = CASE WHEN status <> 'processing' THEN status
                  WHEN attempts > 0 THEN 'failed' ELSE 'pending' END,
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq IN (SELECT value FROM json_each(?1));

-- name: hold_pick
-- Live rows neither in flight nor held.
SELECT seq FROM {table}
WHERE seq IN (SELECT value FROM json_each(?1))
  AND status IN ('pending', 'processing', 'failed') AND available_at < ?2
  AND NOT (status = 'processing' AND locked_until > strftime('%Y-%m-%d %H:%M:%f', 'now'))
ORDER BY seq;

-- name: hold
-- Due at the held rows' due time: every read and claim then treats them as rows that
-- wait, and holds back their key behind them. ?1 the rows picked, ?2 the held rows' due
-- time.
UPDATE {table}
SET available_at = ?2,
    status = CASE WHEN status <> 'processing' THEN status
                  WHEN attempts > 0 THEN 'failed' ELSE 'pending' END,
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq IN (SELECT value FROM json_each(?1));

-- name: release_held_pick
SELECT seq FROM {table}
WHERE seq IN (SELECT value FROM json_each(?1))
  AND status IN ('pending', 'processing', 'failed') AND available_at >= ?2
ORDER BY seq;

-- name: release_held
UPDATE {table}
SET status = 'pending', attempts = 0,
    available_at = strftime('%Y-%m-%d %H:%M:%f', 'now'),
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq IN (SELECT value FROM json_each(?1));

-- name: replay_pick
-- Abandoned rows and held ones.
SELECT seq FROM {table}
WHERE seq IN (SELECT value FROM json_each(?1))
  AND (status = 'abandoned'
       OR (status IN ('pending', 'processing', 'failed') AND available_at >= ?2))
ORDER BY seq;

-- name: replay
UPDATE {table}
SET status = 'pending', attempts = 0, available_at = strftime('%Y-%m-%d %H:%M:%f', 'now'),
    abandoned_at = NULL, locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq IN (SELECT value FROM json_each(?1));

-- name: audit
-- Audit records, newest first: ?1 id below which to list (NULL: from the newest), ?2
-- limit.
SELECT id, at, actor, action, reason, seq, message_id, target, "key"
FROM {table}_audit
WHERE ?1 IS NULL OR id < ?1
ORDER BY id DESC
LIMIT ?2;

-- name: count_by_status
-- ?1 the held rows' due time: held rows are counted apart (count_held).
SELECT status, count(*) FROM {table}
WHERE status NOT IN ('pending', 'failed') OR available_at < ?1
GROUP BY status;

-- name: count_held
-- Held rows, and the (target, key) pairs they hold back: ?1 the held rows' due time.
SELECT count(*), count(DISTINCT target || char(31) || "key") FROM {table}
WHERE status IN ('pending', 'failed') AND available_at >= ?1;

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

-- name: backfill_job
-- ?1 name.
SELECT name, source, target, external, cursor_seq, copied, actor, reason, created_at,
       finished_at
FROM {table}_backfills WHERE name = ?1;

-- name: backfill_begin
-- ?1 name, ?2 source filter (JSON), ?3 target, ?4 external, ?5 actor, ?6 reason: a new
-- backfill, or none when one of that name exists.
INSERT OR IGNORE INTO {table}_backfills (name, source, target, external, actor, reason)
VALUES (?1, ?2, ?3, ?4, ?5, ?6);

-- name: backfill_advance
-- ?1 name, ?2 the new cursor, ?3 copies written with it, ?4 finished: moves a running
-- backfill's cursor forward (or, with nothing copied, only marks it finished). It
-- changes no row when another run moved the cursor there first: the caller then
-- writes nothing.
UPDATE {table}_backfills
SET cursor_seq = CASE WHEN cursor_seq < ?2 THEN ?2 ELSE cursor_seq END,
    copied = copied + ?3, updated_at = strftime('%Y-%m-%d %H:%M:%f', 'now'),
    finished_at = CASE WHEN ?4 = 1 THEN strftime('%Y-%m-%d %H:%M:%f', 'now') ELSE NULL END
WHERE name = ?1 AND finished_at IS NULL AND (cursor_seq < ?2 OR (?3 = 0 AND ?4 = 1));

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

-- name: stuck_live
-- ?1 the held rows' due time: per target, its live rows that failed at least once
-- (not in flight) and its held ones, and when the oldest of them was written.
SELECT target,
       sum(available_at < ?1), sum(available_at >= ?1), min(created_at)
FROM {table}
WHERE status IN ('pending', 'processing', 'failed')
  AND (status = 'failed' OR attempts > 0 OR available_at >= ?1)
  AND NOT (status = 'processing' AND locked_until > strftime('%Y-%m-%d %H:%M:%f', 'now'))
GROUP BY target;

-- name: stuck_abandoned
-- Per target, its abandoned rows still kept and the oldest one's written time: from the
-- abandoned purge's partial index, which holds them alone.
SELECT target, count(*), min(created_at) FROM {table} INDEXED BY {prefix}_abandoned_ix
WHERE status = 'abandoned'
GROUP BY target;
