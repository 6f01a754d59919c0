-- relaybox's named queries on MySQL and MariaDB. Times are UTC_TIMESTAMP(6), whatever
-- the session's time zone, so writers on any connection agree with the relay.
-- Parameters: the drivers (PyMySQL, aiomysql, asyncmy) take positional %s only. The
-- writer's inserts and the claim's steps, which are assembled at run time, use %s in the
-- order listed per query (their seqs, pairs and filters markers are expanded into one
-- placeholder per value). Every other query numbers its parameters ($1 ...) as on
-- PostgreSQL, and relaybox turns them into %s, repeating a value where a number repeats
-- and spreading a list of seqs into one placeholder per value. Values never enter SQL
-- text. Comments here must not contain a placeholder or a marker.

-- name: lock_keys
-- Before a writer inserts keyed rows: lock their slots (schema.sql, {table}_key_locks),
-- in slot order so that two writers never wait on each other in a cycle. The writer
-- appends the placeholders and the ORDER BY ... FOR UPDATE tail.
SELECT slot FROM {table}_key_locks WHERE slot IN;

-- name: insert_one
-- The 16 values of relaybox.core.records.INSERT_COLUMNS as relaybox.sql.params.row_params
-- gives them: id as text, external as 0/1, occurred_at naive UTC, delay in microseconds.
INSERT INTO {table} (id, target, external, topic, `key`, `partition`, type, content_type,
    payload, headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at,
    available_at)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s,
    UTC_TIMESTAMP(6) + INTERVAL %s MICROSECOND);

-- name: insert_values
-- A multi-row insert is this prefix, then N copies of insert_row joined by commas;
-- insert_row takes the same 16 values as insert_one.
INSERT INTO {table} (id, target, external, topic, `key`, `partition`, type, content_type,
    payload, headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at,
    available_at)
VALUES;

-- name: insert_row
(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s,
    UTC_TIMESTAMP(6) + INTERVAL %s MICROSECOND);

-- name: claim_due
-- Step 1 of a claim, run once for 'pending' and once for 'failed', each one range of
-- the live index in seq order. A claim locks the rows it finds (the lock marker is
-- FOR UPDATE SKIP LOCKED); the owned read of a relay that holds its partitions reads
-- them without locks (the marker is empty). Rows behind a head of their key that is
-- not due or is leased are skipped here, so a long blocked backlog never uses up the
-- limit. Each row comes with its payload's size, for the claim's byte budget.
-- Parameters: status, seq bound, filter values, limit.
SELECT seq, target, `key`, LENGTH(payload) FROM {table} o FORCE INDEX ({prefix}_live_ix)
WHERE status = %s AND seq < %s AND available_at <= UTC_TIMESTAMP(6) {filters}
  AND (live_key IS NULL OR NOT EXISTS (
      SELECT 1 FROM {table} h FORCE INDEX ({prefix}_key_ix)
      WHERE h.target = o.target AND h.live_key = o.live_key AND h.seq < o.seq
        AND ((h.status = 'processing' AND h.locked_until >= UTC_TIMESTAMP(6))
             OR (h.status IN ('pending', 'failed') AND h.available_at > UTC_TIMESTAMP(6)))))
ORDER BY seq
LIMIT %s
{lock};

-- name: claim_expired
-- Step 1, processing rows whose lease ran out. Parameters: seq bound, filter values,
-- limit.
SELECT seq, target, `key`, LENGTH(payload) FROM {table} o FORCE INDEX ({prefix}_live_ix)
WHERE status = 'processing' AND seq < %s AND locked_until < UTC_TIMESTAMP(6) {filters}
  AND (live_key IS NULL OR NOT EXISTS (
      SELECT 1 FROM {table} h FORCE INDEX ({prefix}_key_ix)
      WHERE h.target = o.target AND h.live_key = o.live_key AND h.seq < o.seq
        AND ((h.status = 'processing' AND h.locked_until >= UTC_TIMESTAMP(6))
             OR (h.status IN ('pending', 'failed') AND h.available_at > UTC_TIMESTAMP(6)))))
ORDER BY seq
LIMIT %s
{lock};

-- name: claim_blockers
-- Step 2, per-key order: for each candidate (target, key), the earliest live row that
-- is not itself a candidate, below the last candidate. Every candidate of that key
-- after it must wait: the blocker is held by another worker, not yet due, or outside
-- this claim's partition filter.
-- Parameters: (target, key) pairs, the last candidate seq, every candidate seq.
SELECT target, live_key, MIN(seq) FROM {table} FORCE INDEX ({prefix}_key_ix)
WHERE (target, live_key) IN ({pairs}) AND seq < %s AND seq NOT IN ({seqs})
GROUP BY target, live_key;

-- name: claim_lease
-- Step 3, by seq, and said so (as the settle below). Parameters: worker, token, lease
-- seconds, seqs.
UPDATE {table} FORCE INDEX (PRIMARY)
SET status = 'processing', locked_by = %s, lock_token = %s,
    locked_until = UTC_TIMESTAMP(6) + INTERVAL ROUND(%s * 1000000) MICROSECOND
WHERE seq IN ({seqs});

-- name: claim_rows
-- Step 4: the leased rows in relaybox.storage.rows.CLAIM_COLUMNS order, by seq.
SELECT seq, id, target, external, topic, `key`, `partition`, type, content_type, payload,
    headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at,
    attempts
FROM {table} FORCE INDEX (PRIMARY)
WHERE seq IN ({seqs})
ORDER BY seq;

-- The owned settle of a relay that holds its partitions: each statement changes only
-- live rows in partitions the worker holds (stored hash modulo the partition count); a
-- settle that needs several runs them in one transaction.
--
-- The settle and the marks find their rows by seq, and say so (FORCE INDEX (PRIMARY)),
-- so that their plan holds whatever the optimizer believes of the table's size: once
-- the table was analyzed while empty (a fresh deploy, a drained outbox), MariaDB priced
-- a walk of the whole table below a lookup of each seq, and walked a backlog of 100k
-- rows for every batch it settled. A single-table DELETE takes no index hint, so the
-- deletes are written as multi-table ones. Failures arrive as a JSON array: its rows
-- come first (STRAIGHT_JOIN), each finding its outbox row by seq, where the optimizer
-- was free to walk the outbox table and scan the array once per row.
-- The fence reads the owner of the row's partition by its primary key, one lookup per
-- row: a scalar subquery, which neither MariaDB nor MySQL turns into a join. As an IN
-- (or IN ... IS TRUE, which MySQL also flattens) it became a semi-join, planned with the
-- partitions outside whenever that table was last analyzed while nobody held any:
-- every held partition then repeated the lookup of every row of the batch.

-- A row held meanwhile (available_at at the held time: an operator held it between the
-- read and the settle) stays held: a failed or abandoned settle leaves it alone, where a
-- published one may still delete it (the message went out). A row delayed meanwhile
-- keeps its delay: a failed settle never makes a row due sooner.

-- name: fail_owned
-- $1 failures JSON [[seq, error, retry_in seconds], ...], $2 worker, $3 partition count,
-- $4 the held rows' due time.
UPDATE JSON_TABLE($1, '$[*]' COLUMNS (
        seq BIGINT PATH '$[0]',
        error LONGTEXT PATH '$[1]',
        retry_in DOUBLE PATH '$[2]')) f
STRAIGHT_JOIN {table} o FORCE INDEX (PRIMARY) ON o.seq = f.seq
SET o.status = 'failed', o.attempts = o.attempts + 1, o.last_error = f.error,
    o.available_at = GREATEST(o.available_at,
        UTC_TIMESTAMP(6) + INTERVAL ROUND(f.retry_in * 1000000) MICROSECOND),
    o.locked_by = NULL, o.locked_until = NULL, o.lock_token = NULL
WHERE o.status IN ('pending', 'processing', 'failed') AND o.available_at < $4
  AND (SELECT p.owner FROM {table}_partitions p FORCE INDEX (PRIMARY)
       WHERE p.target = o.target AND p.`partition` = MOD(o.`partition`, $3)) = $2;

-- name: abandon_owned
-- $1 failures JSON [[seq, error], ...], $2 worker, $3 partition count, $4 whether to
-- hold the keys, $5 the held rows' due time. With $4, a row with a key is not abandoned
-- but held: failed, due at $5, with its error and the attempt counted, so its key's
-- later rows wait behind it. (No assignment reads a column assigned before it.)
UPDATE JSON_TABLE($1, '$[*]' COLUMNS (
        seq BIGINT PATH '$[0]',
        error LONGTEXT PATH '$[1]')) f
STRAIGHT_JOIN {table} o FORCE INDEX (PRIMARY) ON o.seq = f.seq
SET o.status = IF($4 AND o.`key` IS NOT NULL, 'failed', 'abandoned'),
    o.attempts = o.attempts + 1, o.last_error = f.error,
    o.abandoned_at = IF($4 AND o.`key` IS NOT NULL, NULL, UTC_TIMESTAMP(6)),
    o.available_at = IF($4 AND o.`key` IS NOT NULL, $5, o.available_at),
    o.locked_by = NULL, o.locked_until = NULL, o.lock_token = NULL
WHERE o.status IN ('pending', 'processing', 'failed') AND o.available_at < $5
  AND (SELECT p.owner FROM {table}_partitions p FORCE INDEX (PRIMARY)
       WHERE p.target = o.target AND p.`partition` = MOD(o.`partition`, $3)) = $2;

-- name: delete_owned
-- $1 seqs, $2 worker, $3 partition count.
DELETE o FROM {table} o FORCE INDEX (PRIMARY)
WHERE o.seq IN ($1) AND o.status IN ('pending', 'processing', 'failed')
  AND (SELECT p.owner FROM {table}_partitions p FORCE INDEX (PRIMARY)
       WHERE p.target = o.target AND p.`partition` = MOD(o.`partition`, $3)) = $2;

-- name: publish_owned
-- $1 seqs, $2 worker, $3 partition count.
UPDATE {table} o FORCE INDEX (PRIMARY)
SET o.status = 'published', o.published_at = UTC_TIMESTAMP(6),
    o.locked_by = NULL, o.locked_until = NULL, o.lock_token = NULL
WHERE o.seq IN ($1) AND o.status IN ('pending', 'processing', 'failed')
  AND (SELECT p.owner FROM {table}_partitions p FORCE INDEX (PRIMARY)
       WHERE p.target = o.target AND p.`partition` = MOD(o.`partition`, $3)) = $2;

-- The row-lease marks: each changes only rows still in processing under the claim's
-- token.

-- name: mark_published
-- $1 seqs, $2 token.
UPDATE {table} FORCE INDEX (PRIMARY)
SET status = 'published', published_at = UTC_TIMESTAMP(6),
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq IN ($1) AND lock_token = $2 AND status = 'processing';

-- name: delete_published
-- $1 seqs, $2 token.
DELETE o FROM {table} o FORCE INDEX (PRIMARY)
WHERE o.seq IN ($1) AND o.lock_token = $2 AND o.status = 'processing';

-- name: mark_failed
-- $1 failures JSON [[seq, error, retry_in seconds], ...], $2 token, $3 the held rows'
-- due time (a row held stays held, as in the settle above).
UPDATE JSON_TABLE($1, '$[*]' COLUMNS (
        seq BIGINT PATH '$[0]',
        error LONGTEXT PATH '$[1]',
        retry_in DOUBLE PATH '$[2]')) f
STRAIGHT_JOIN {table} o FORCE INDEX (PRIMARY) ON o.seq = f.seq
SET o.status = 'failed', o.attempts = o.attempts + 1, o.last_error = f.error,
    o.available_at = UTC_TIMESTAMP(6) + INTERVAL ROUND(f.retry_in * 1000000) MICROSECOND,
    o.locked_by = NULL, o.locked_until = NULL, o.lock_token = NULL
WHERE o.lock_token = $2 AND o.status = 'processing' AND o.available_at < $3;

-- name: abandon
-- As abandon_owned, fenced by the claim's token: $1 failures JSON [[seq, error], ...],
-- $2 token, $3 whether to hold the keys, $4 the held rows' due time.
UPDATE JSON_TABLE($1, '$[*]' COLUMNS (
        seq BIGINT PATH '$[0]',
        error LONGTEXT PATH '$[1]')) f
STRAIGHT_JOIN {table} o FORCE INDEX (PRIMARY) ON o.seq = f.seq
SET o.status = IF($3 AND o.`key` IS NOT NULL, 'failed', 'abandoned'),
    o.attempts = o.attempts + 1, o.last_error = f.error,
    o.abandoned_at = IF($3 AND o.`key` IS NOT NULL, NULL, UTC_TIMESTAMP(6)),
    o.available_at = IF($3 AND o.`key` IS NOT NULL, $4, o.available_at),
    o.locked_by = NULL, o.locked_until = NULL, o.lock_token = NULL
WHERE o.lock_token = $2 AND o.status = 'processing' AND o.available_at < $4;

-- name: release
-- $1 seqs, $2 token.
UPDATE {table} FORCE INDEX (PRIMARY)
SET status = 'pending', locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq IN ($1) AND lock_token = $2 AND status = 'processing';

-- name: renew
-- $1 seqs, $2 token, $3 lease seconds.
UPDATE {table} FORCE INDEX (PRIMARY)
SET locked_until = UTC_TIMESTAMP(6) + INTERVAL ROUND($3 * 1000000) MICROSECOND
WHERE seq IN ($1) AND lock_token = $2 AND status = 'processing';

-- What operators need.

-- name: purge_published
-- $1 age in seconds, $2 batch size.
DELETE FROM {table}
WHERE published_at < UTC_TIMESTAMP(6) - INTERVAL ROUND($1 * 1000000) MICROSECOND
  AND status = 'published'
ORDER BY published_at
LIMIT $2;

-- name: purge_abandoned
-- $1 age in seconds, $2 batch size.
DELETE FROM {table}
WHERE abandoned_at < UTC_TIMESTAMP(6) - INTERVAL ROUND($1 * 1000000) MICROSECOND
  AND status = 'abandoned'
ORDER BY abandoned_at
LIMIT $2;

-- name: abandoned
-- Abandoned rows, newest first: $1 seq below which to list (NULL: from the newest), $2
-- target (NULL: any), $3 limit.
SELECT seq, id, target, topic, `key`, type, attempts, last_error, abandoned_at, occurred_at
FROM {table}
WHERE status = 'abandoned' AND ($1 IS NULL OR seq < $1) AND ($2 IS NULL OR target = $2)
ORDER BY seq DESC
LIMIT $3;

-- The operator's console. Live and finished rows share this table; a row's state is
-- read off it, by the database's clock: abandoned or published (finished), else held
-- (due at the held rows' due time, HELD_UNTIL), in flight (leased, the lease running),
-- retrying (attempted before, or failed), delayed (not due yet), pending.
-- A search walks the primary key within a seq range, in {order} (ASC or DESC: the
-- storage runs each as two queries), and stops at the limit; with a target and a key,
-- live rows come from the key index instead, merged with the finished rows of that key.
-- Parameters, the same on every dialect: $1 whether live rows are wanted, $2 whether
-- finished ones are, $3 the states wanted (comma-separated, NULL: any), $4 target, $5
-- topic, $6 key, $7 type, $8 id, $9 correlation id, $10 causation id, $11 tenant id, $12
-- aggregate id (each NULL: any), $13 and $14 the lowest and highest seq, $15 and $16
-- the earliest and latest created_at (NULL: open), $17 limit, $18 the held rows' due
-- time.

-- name: search
SELECT * FROM (
    SELECT o.seq, o.id,
        CASE WHEN o.status IN ('published', 'abandoned') THEN o.status
             WHEN o.available_at >= $18 THEN 'held'
             WHEN o.status = 'processing' AND o.locked_until > UTC_TIMESTAMP(6) THEN 'in_flight'
             WHEN o.attempts > 0 OR o.status = 'failed' THEN 'retrying'
             WHEN o.available_at > UTC_TIMESTAMP(6) THEN 'delayed'
             ELSE 'pending' END AS state,
        o.target, o.topic, o.`key`, o.type, o.attempts, o.created_at,
        CASE WHEN o.status IN ('pending', 'processing', 'failed') THEN o.available_at END
            AS available_at,
        o.occurred_at, o.published_at, o.abandoned_at, o.last_error, o.correlation_id
    FROM {table} o FORCE INDEX (PRIMARY)
    WHERE o.seq BETWEEN $13 AND $14
      AND (($1 AND o.status IN ('pending', 'processing', 'failed'))
           OR ($2 AND o.status IN ('published', 'abandoned')))
      AND ($4 IS NULL OR o.target = $4)
      AND ($5 IS NULL OR o.topic = $5)
      AND ($6 IS NULL OR o.`key` = $6)
      AND ($7 IS NULL OR o.type = $7)
      AND ($8 IS NULL OR o.id = $8)
      AND ($9 IS NULL OR o.correlation_id = $9)
      AND ($10 IS NULL OR o.causation_id = $10)
      AND ($11 IS NULL OR o.tenant_id = $11)
      AND ($12 IS NULL OR o.aggregate_id = $12)
      AND ($15 IS NULL OR o.created_at >= $15)
      AND ($16 IS NULL OR o.created_at <= $16)) AS s
WHERE $3 IS NULL OR FIND_IN_SET(s.state, $3) > 0
ORDER BY s.seq {order}
LIMIT $17;

-- name: search_abandoned
-- `search` of abandoned rows only: they come from the abandoned purge's index, which holds
-- them and no other row, sorted by seq here. Abandoned rows are the few that went
-- wrong, where a walk of the primary key would pass over every live and published row first.
-- $1 target, $2 topic, $3 key, $4 type, $5 id, $6 correlation, $7 causation, $8 tenant,
-- $9 aggregate (each NULL: any), $10 and $11 the seq range, $12 and $13 the written
-- range (NULL: open), $14 limit.
SELECT o.seq, o.id, 'abandoned' AS state, o.target, o.topic, o.`key`, o.type, o.attempts,
       o.created_at, NULL AS available_at, o.occurred_at, o.published_at, o.abandoned_at,
       o.last_error, o.correlation_id
FROM {table} o FORCE INDEX ({prefix}_abandoned_ix)
WHERE o.abandoned_at IS NOT NULL AND o.status = 'abandoned' AND o.seq BETWEEN $10 AND $11
  AND ($1 IS NULL OR o.target = $1)
  AND ($2 IS NULL OR o.topic = $2)
  AND ($3 IS NULL OR o.`key` = $3)
  AND ($4 IS NULL OR o.type = $4)
  AND ($5 IS NULL OR o.id = $5)
  AND ($6 IS NULL OR o.correlation_id = $6)
  AND ($7 IS NULL OR o.causation_id = $7)
  AND ($8 IS NULL OR o.tenant_id = $8)
  AND ($9 IS NULL OR o.aggregate_id = $9)
  AND ($12 IS NULL OR o.created_at >= $12)
  AND ($13 IS NULL OR o.created_at <= $13)
ORDER BY o.seq {order}
LIMIT $14;

-- name: search_key
-- `search` of one (target, key) ($4 and $6, both given): live rows from the key index in
-- seq order; finished ones, which no index of this table finds by key, from the indexes
-- of the retention purges (only rows kept under a retention are in them), so that
-- neither walks the other's rows.
SELECT * FROM (
    (SELECT * FROM (
        SELECT o.seq, o.id,
            CASE WHEN o.available_at >= $18 THEN 'held'
                 WHEN o.status = 'processing' AND o.locked_until > UTC_TIMESTAMP(6)
                     THEN 'in_flight'
                 WHEN o.attempts > 0 OR o.status = 'failed' THEN 'retrying'
                 WHEN o.available_at > UTC_TIMESTAMP(6) THEN 'delayed'
                 ELSE 'pending' END AS state,
            o.target, o.topic, o.`key`, o.type, o.attempts, o.created_at, o.available_at,
            o.occurred_at, o.published_at, o.abandoned_at, o.last_error, o.correlation_id
        FROM {table} o FORCE INDEX ({prefix}_key_ix)
        WHERE $1 AND o.target = $4 AND o.live_key = $6 AND o.seq BETWEEN $13 AND $14
          AND ($5 IS NULL OR o.topic = $5)
          AND ($7 IS NULL OR o.type = $7)
          AND ($8 IS NULL OR o.id = $8)
          AND ($9 IS NULL OR o.correlation_id = $9)
          AND ($10 IS NULL OR o.causation_id = $10)
          AND ($11 IS NULL OR o.tenant_id = $11)
          AND ($12 IS NULL OR o.aggregate_id = $12)
          AND ($15 IS NULL OR o.created_at >= $15)
          AND ($16 IS NULL OR o.created_at <= $16)) AS s
     WHERE $3 IS NULL OR FIND_IN_SET(s.state, $3) > 0
     ORDER BY s.seq {order}
     LIMIT $17)
    UNION ALL
    (SELECT o.seq, o.id, o.status AS state, o.target, o.topic, o.`key`, o.type,
        o.attempts, o.created_at, NULL AS available_at, o.occurred_at, o.published_at,
        o.abandoned_at, o.last_error, o.correlation_id
     FROM {table} o FORCE INDEX ({prefix}_published_ix)
     WHERE $2 AND o.published_at IS NOT NULL AND o.status = 'published'
       AND o.seq BETWEEN $13 AND $14
       AND o.target = $4 AND o.`key` = $6
       AND ($3 IS NULL OR FIND_IN_SET('published', $3) > 0)
       AND ($5 IS NULL OR o.topic = $5)
       AND ($7 IS NULL OR o.type = $7)
       AND ($8 IS NULL OR o.id = $8)
       AND ($9 IS NULL OR o.correlation_id = $9)
       AND ($10 IS NULL OR o.causation_id = $10)
       AND ($11 IS NULL OR o.tenant_id = $11)
       AND ($12 IS NULL OR o.aggregate_id = $12)
       AND ($15 IS NULL OR o.created_at >= $15)
       AND ($16 IS NULL OR o.created_at <= $16)
     ORDER BY o.seq {order}
     LIMIT $17)
    UNION ALL
    (SELECT o.seq, o.id, o.status AS state, o.target, o.topic, o.`key`, o.type,
        o.attempts, o.created_at, NULL AS available_at, o.occurred_at, o.published_at,
        o.abandoned_at, o.last_error, o.correlation_id
     FROM {table} o FORCE INDEX ({prefix}_abandoned_ix)
     WHERE $2 AND o.abandoned_at IS NOT NULL AND o.status = 'abandoned'
       AND o.seq BETWEEN $13 AND $14
       AND o.target = $4 AND o.`key` = $6
       AND ($3 IS NULL OR FIND_IN_SET('abandoned', $3) > 0)
       AND ($5 IS NULL OR o.topic = $5)
       AND ($7 IS NULL OR o.type = $7)
       AND ($8 IS NULL OR o.id = $8)
       AND ($9 IS NULL OR o.correlation_id = $9)
       AND ($10 IS NULL OR o.causation_id = $10)
       AND ($11 IS NULL OR o.tenant_id = $11)
       AND ($12 IS NULL OR o.aggregate_id = $12)
       AND ($15 IS NULL OR o.created_at >= $15)
       AND ($16 IS NULL OR o.created_at <= $16)
     ORDER BY o.seq {order}
     LIMIT $17)
) AS m
ORDER BY m.seq {order}
LIMIT $17;

-- name: messages
-- Messages whole: $1 their seqs, $2 the held rows' due time.
SELECT o.seq, o.id,
    CASE WHEN o.status IN ('published', 'abandoned') THEN o.status
         WHEN o.available_at >= $2 THEN 'held'
         WHEN o.status = 'processing' AND o.locked_until > UTC_TIMESTAMP(6) THEN 'in_flight'
         WHEN o.attempts > 0 OR o.status = 'failed' THEN 'retrying'
         WHEN o.available_at > UTC_TIMESTAMP(6) THEN 'delayed'
         ELSE 'pending' END,
    o.target, o.topic, o.`key`, o.type, o.attempts, o.created_at,
    CASE WHEN o.status IN ('pending', 'processing', 'failed') THEN o.available_at END,
    o.occurred_at, o.published_at, o.abandoned_at, o.last_error, o.correlation_id,
    o.external, o.`partition`, o.content_type, o.payload, o.headers, o.causation_id,
    o.tenant_id, o.aggregate_id, o.locked_by, o.locked_until
FROM {table} o
WHERE o.seq IN ($1);

-- The operator's changes, three steps in one transaction: `<change>_pick` locks the
-- rows of $1 (seqs) still in a state the change applies to, as of now ($2, where
-- taken, the held rows' due time), audit_record writes one record per row picked, and
-- `<change>` changes the rows picked. A row in flight is leased under a lease still
-- running; a row in processing whose lease ran out is not, and a change that keeps it
-- live puts it back to pending (failed, if it was attempted before), so that no claim
-- takes it by its lease.

-- name: audit_record
-- $1 the rows picked, $2 actor, $3 action, $4 reason.
INSERT INTO {table}_audit (actor, action, reason, seq, message_id, target, `key`)
SELECT $2, $3, $4, seq, id, target, `key` FROM {table} FORCE INDEX (PRIMARY)
WHERE seq IN ($1)
ORDER BY seq;

-- name: discard_pick
-- Any row not in flight.
SELECT seq FROM {table} FORCE INDEX (PRIMARY)
WHERE seq IN ($1) AND NOT (status = 'processing' AND locked_until > UTC_TIMESTAMP(6))
ORDER BY seq
FOR UPDATE;

-- name: discard
DELETE o FROM {table} o FORCE INDEX (PRIMARY) WHERE o.seq IN ($1);

-- name: reschedule_pick
-- Live rows neither in flight nor held.
SELECT seq FROM {table} FORCE INDEX (PRIMARY)
WHERE seq IN ($1) AND status IN ('pending', 'processing', 'failed') AND available_at < $2
  AND NOT (status = 'processing' AND locked_until > UTC_TIMESTAMP(6))
ORDER BY seq
FOR UPDATE;

-- name: reschedule
-- $1 the rows picked, $2 seconds from now.
UPDATE {table} FORCE INDEX (PRIMARY)
SET available_at = UTC_TIMESTAMP(6) + INTERVAL ROUND($2 * 1000000) MICROSECOND,
    status = CASE WHEN status <> 'processing' THEN status
                  WHEN attempts > 0 THEN 'failed' ELSE 'pending' END,
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq IN ($1);

-- name: hold_pick
-- Live rows neither in flight nor held.
SELECT seq FROM {table} FORCE INDEX (PRIMARY)
WHERE seq IN ($1) AND status IN ('pending', 'processing', 'failed') AND available_at < $2
  AND NOT (status = 'processing' AND locked_until > UTC_TIMESTAMP(6))
ORDER BY seq
FOR UPDATE;

-- name: hold
-- Due at the held rows' due time: every read and claim then treats them as rows that
-- wait, and holds back their key behind them. $1 the rows picked, $2 the held rows'
-- due time.
UPDATE {table} FORCE INDEX (PRIMARY)
SET available_at = $2,
    status = CASE WHEN status <> 'processing' THEN status
                  WHEN attempts > 0 THEN 'failed' ELSE 'pending' END,
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq IN ($1);

-- name: release_held_pick
SELECT seq FROM {table} FORCE INDEX (PRIMARY)
WHERE seq IN ($1) AND status IN ('pending', 'processing', 'failed') AND available_at >= $2
ORDER BY seq
FOR UPDATE;

-- name: release_held
UPDATE {table} FORCE INDEX (PRIMARY)
SET status = 'pending', attempts = 0, available_at = UTC_TIMESTAMP(6),
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq IN ($1);

-- name: replay_pick
-- Abandoned rows and held ones.
SELECT seq FROM {table} FORCE INDEX (PRIMARY)
WHERE seq IN ($1)
  AND (status = 'abandoned'
       OR (status IN ('pending', 'processing', 'failed') AND available_at >= $2))
ORDER BY seq
FOR UPDATE;

-- name: replay
UPDATE {table} FORCE INDEX (PRIMARY)
SET status = 'pending', attempts = 0, available_at = UTC_TIMESTAMP(6), abandoned_at = NULL,
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq IN ($1);

-- name: audit
-- Audit records, newest first: $1 id below which to list (NULL: from the newest), $2
-- limit.
SELECT id, at, actor, action, reason, seq, message_id, target, `key`
FROM {table}_audit
WHERE $1 IS NULL OR id < $1
ORDER BY id DESC
LIMIT $2;

-- name: count_by_status
-- $1 the held rows' due time: held rows are counted apart (count_held).
SELECT status, COUNT(*) FROM {table}
WHERE status NOT IN ('pending', 'failed') OR available_at < $1
GROUP BY status;

-- name: count_held
-- Held rows, and the (target, key) pairs they hold back: $1 the held rows' due time.
SELECT COUNT(*), COUNT(DISTINCT target, live_key) FROM {table}
WHERE status IN ('pending', 'failed') AND available_at >= $1;

-- name: live_by_target
-- Rows still to deliver, per target.
SELECT target, COUNT(*) FROM {table}
WHERE status IN ('pending', 'processing', 'failed') GROUP BY target;

-- name: oldest_pending_age
SELECT TIMESTAMPDIFF(MICROSECOND, MIN(available_at), UTC_TIMESTAMP(6)) / 1000000
FROM {table}
WHERE status IN ('pending', 'failed') AND available_at <= UTC_TIMESTAMP(6);

-- name: active_leases
SELECT COUNT(*) FROM {table} WHERE status = 'processing' AND locked_until >= UTC_TIMESTAMP(6);

-- name: probe
-- Run when a storage connects: it fails (and relaybox says to migrate) if a table is
-- missing.
SELECT 1 FROM {table} WHERE FALSE
UNION ALL SELECT 1 FROM {table}_key_locks WHERE FALSE
UNION ALL SELECT 1 FROM {table}_partitions WHERE FALSE
UNION ALL SELECT 1 FROM {table}_members WHERE FALSE;

-- Partition leases, per target. A heartbeat of one target runs members_expire through
-- partitions_take in one transaction, in this order. Dead members go before the worker
-- joins, so two heartbeats lock member rows in one order and cannot deadlock on them.
-- MySQL has no UPDATE ... RETURNING: renewing and taking partitions are two statements
-- each.

-- name: members_expire
DELETE FROM {table}_members WHERE lease_until < UTC_TIMESTAMP(6);

-- name: member_join
-- $1 worker, $2 lease seconds, $3 target.
INSERT INTO {table}_members (worker, target, lease_until)
VALUES ($1, $3, UTC_TIMESTAMP(6) + INTERVAL ROUND($2 * 1000000) MICROSECOND)
ON DUPLICATE KEY UPDATE
    lease_until = UTC_TIMESTAMP(6) + INTERVAL ROUND($2 * 1000000) MICROSECOND;

-- name: partitions_count
-- $1 partitions, $2 target. A plain read: partitions_create runs only if rows are
-- missing.
SELECT COUNT(*) FROM {table}_partitions WHERE target = $2 AND `partition` < $1;

-- name: partitions_create
-- $1 a JSON array of partition numbers, $2 target. It locks every row that already
-- exists, which would make heartbeats wait on each other, so it runs only when
-- partitions_count says some are missing. A duplicate (another heartbeat created it
-- first) is a no-op update, not an error or a warning as with INSERT IGNORE.
INSERT INTO {table}_partitions (target, `partition`)
SELECT $2, p FROM JSON_TABLE($1, '$[*]' COLUMNS (p INT PATH '$')) AS numbers
ON DUPLICATE KEY UPDATE `partition` = `partition`;

-- name: members_live
-- $1 target: how many live relays serve it.
SELECT COUNT(*) FROM {table}_members WHERE target = $1 AND lease_until >= UTC_TIMESTAMP(6);

-- name: members_targets
-- The targets some live relay serves.
SELECT DISTINCT target FROM {table}_members WHERE lease_until >= UTC_TIMESTAMP(6);

-- name: partitions_renew
-- $1 worker, $2 lease seconds, $3 target.
UPDATE {table}_partitions
SET lease_until = UTC_TIMESTAMP(6) + INTERVAL ROUND($2 * 1000000) MICROSECOND
WHERE owner = $1 AND target = $3;

-- name: partitions_held
-- $1 worker, $2 target. After partitions_renew, whose locks keep these rows ours.
SELECT `partition` FROM {table}_partitions WHERE owner = $1 AND target = $2;

-- name: partitions_release
-- $1 worker, $2 the partitions it gives back, $3 target.
UPDATE {table}_partitions SET owner = NULL, lease_until = NULL
WHERE owner = $1 AND target = $3 AND `partition` IN ($2);

-- name: partitions_free
-- $1 partitions, $2 how many, $3 target. Free or expired ones, lowest first; SKIP
-- LOCKED passes over rows another heartbeat is renewing or taking.
SELECT `partition` FROM {table}_partitions
WHERE target = $3 AND `partition` < $1 AND (owner IS NULL OR lease_until < UTC_TIMESTAMP(6))
ORDER BY `partition`
LIMIT $2
FOR UPDATE SKIP LOCKED;

-- name: partitions_take
-- $1 worker, $2 lease seconds, $3 the partitions partitions_free locked, $4 target.
UPDATE {table}_partitions
SET owner = $1, lease_until = UTC_TIMESTAMP(6) + INTERVAL ROUND($2 * 1000000) MICROSECOND
WHERE target = $4 AND `partition` IN ($3);

-- name: partitions_leave
-- $1 worker: every target's partitions.
UPDATE {table}_partitions SET owner = NULL, lease_until = NULL WHERE owner = $1;

-- name: member_leave
-- $1 worker.
DELETE FROM {table}_members WHERE worker = $1;

-- name: relay_members
-- The live relays (the console's list): each membership still within its lease.
SELECT worker, target, joined_at, lease_until FROM {table}_members
WHERE lease_until >= UTC_TIMESTAMP(6)
ORDER BY target, worker;

-- name: relay_partitions
-- Which partitions each live relay holds, by target.
SELECT target, owner, `partition` FROM {table}_partitions
WHERE owner IS NOT NULL AND lease_until >= UTC_TIMESTAMP(6)
ORDER BY target, owner, `partition`;

-- name: backfill_job
-- $1 name.
SELECT name, source, target, external, cursor_seq, copied, actor, reason, created_at,
       finished_at
FROM {table}_backfills WHERE name = $1;

-- name: backfill_begin
-- $1 name, $2 source filter (JSON), $3 target, $4 external, $5 actor, $6 reason: a new
-- backfill, or none when one of that name exists.
INSERT IGNORE INTO {table}_backfills (name, source, target, external, actor, reason)
VALUES ($1, $2, $3, $4, $5, $6);

-- name: backfill_advance
-- $1 name, $2 the new cursor, $3 copies written with it, $4 finished: moves a running
-- backfill's cursor forward (or, with nothing copied, only marks it finished). It
-- changes no row when another run moved the cursor there first: the caller then
-- writes nothing.
UPDATE {table}_backfills
SET cursor_seq = CASE WHEN cursor_seq < $2 THEN $2 ELSE cursor_seq END,
    copied = copied + $3, updated_at = UTC_TIMESTAMP(6),
    finished_at = CASE WHEN $4 THEN UTC_TIMESTAMP(6) ELSE NULL END
WHERE name = $1 AND finished_at IS NULL AND (cursor_seq < $2 OR ($3 = 0 AND $4));

-- Activity and status, for the operator's console (schema.sql explains the tables).

-- name: activity_add
-- $1 target, $2 worker, $3 published, $4 failed, $5 abandoned, $6 lag sum, $7 lag max,
-- $8 lag count: added to the row of the database's current minute. Not VALUES(): MySQL
-- 8 warns that it is deprecated.
INSERT INTO {table}_activity
    (target, minute, worker, published, failed, abandoned, lag_sum, lag_max, lag_count)
VALUES ($1, FLOOR(UNIX_TIMESTAMP() / 60), $2, $3, $4, $5, $6, $7, $8)
ON DUPLICATE KEY UPDATE
    published = published + $3, failed = failed + $4, abandoned = abandoned + $5,
    lag_sum = lag_sum + $6, lag_max = GREATEST(lag_max, $7), lag_count = lag_count + $8;

-- name: relay_status_set
-- $1 worker, $2 target, $3 circuit state, $4 last error.
INSERT INTO {table}_relay_status (worker, target, circuit, last_error, updated_at)
VALUES ($1, $2, $3, $4, UTC_TIMESTAMP(6))
ON DUPLICATE KEY UPDATE circuit = $3, last_error = $4, updated_at = UTC_TIMESTAMP(6);

-- name: activity_since
-- $1 the first minute. Per target and minute, summed over the relays.
SELECT target, minute, CAST(SUM(published) AS SIGNED), CAST(SUM(failed) AS SIGNED),
    CAST(SUM(abandoned) AS SIGNED), SUM(lag_sum), MAX(lag_max),
    CAST(SUM(lag_count) AS SIGNED)
FROM {table}_activity
WHERE minute >= $1
GROUP BY target, minute
ORDER BY target, minute;

-- name: relay_statuses
-- $1 seconds: rows updated within them.
SELECT worker, target, circuit, last_error, updated_at FROM {table}_relay_status
WHERE updated_at >= UTC_TIMESTAMP(6) - INTERVAL ROUND($1 * 1000000) MICROSECOND
ORDER BY target, worker;

-- name: activity_purge
-- $1 age in seconds, $2 batch size.
DELETE FROM {table}_activity
WHERE minute < FLOOR((UNIX_TIMESTAMP() - $1) / 60)
ORDER BY minute LIMIT $2;

-- name: relay_status_purge
-- $1 age in seconds, $2 batch size.
DELETE FROM {table}_relay_status
WHERE updated_at < UTC_TIMESTAMP(6) - INTERVAL ROUND($1 * 1000000) MICROSECOND
ORDER BY updated_at LIMIT $2;

-- name: stuck_live
-- $1 the held rows' due time: per target, its live rows that failed at least once
-- (not in flight) and its held ones, and when the oldest of them was written.
SELECT target,
       SUM(available_at < $1), SUM(available_at >= $1), MIN(created_at)
FROM {table}
WHERE status IN ('pending', 'processing', 'failed')
  AND (status = 'failed' OR attempts > 0 OR available_at >= $1)
  AND NOT (status = 'processing' AND locked_until > UTC_TIMESTAMP(6))
GROUP BY target;

-- name: stuck_abandoned
-- Per target, its abandoned rows still kept and the oldest one's written time: from the
-- abandoned purge's index, which holds them alone.
SELECT target, COUNT(*), MIN(created_at) FROM {table} FORCE INDEX ({prefix}_abandoned_ix)
WHERE abandoned_at IS NOT NULL AND status = 'abandoned'
GROUP BY target;
