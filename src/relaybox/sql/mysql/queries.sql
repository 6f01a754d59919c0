-- Parameters are positional (format paramstyle of PyMySQL, aiomysql and asyncmy), in
-- the order listed per query. The seqs, pairs and filters markers are expanded by the
-- backend into one placeholder per value; values themselves never enter SQL text.
-- Comments here must not contain a placeholder or a marker: drivers format the whole
-- text. Times are UTC_TIMESTAMP(6), independent of the session time zone, so writers on
-- any connection agree with the relay.

-- name: lock_keys
-- Before a writer inserts keyed rows: lock their slots (see migration 0002), in slot
-- order so that two writers never wait on each other in a cycle. The writer appends
-- the placeholders and the ORDER BY ... FOR UPDATE tail.
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
-- them without locks (the marker is empty). Rows behind a head of their key that is not due or is
-- leased are skipped here, so a long blocked backlog never uses up the limit. Parameters: status, seq bound, filter values, limit.
SELECT seq, target, `key` FROM {table} o FORCE INDEX ({prefix}_live_ix)
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
SELECT seq, target, `key` FROM {table} o FORCE INDEX ({prefix}_live_ix)
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
-- Step 3. Parameters: worker, token, lease seconds, seqs.
UPDATE {table}
SET status = 'processing', locked_by = %s, lock_token = %s,
    locked_until = UTC_TIMESTAMP(6) + INTERVAL ROUND(%s * 1000000) MICROSECOND
WHERE seq IN ({seqs});

-- name: claim_rows
-- Step 4: the leased rows in relaybox.storage.rows.CLAIM_COLUMNS order.
SELECT seq, id, target, external, topic, `key`, `partition`, type, content_type, payload,
    headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at,
    attempts
FROM {table}
WHERE seq IN ({seqs})
ORDER BY seq;

-- The owned settle of a relay that holds its partitions: each statement changes only
-- live rows in partitions the worker holds (stored hash modulo the partition count);
-- one transaction runs them all.

-- name: fail_owned
-- Parameters: a JSON array of [seq, error, retry_in seconds], partition count, worker.
UPDATE {table} o
JOIN JSON_TABLE(%s, '$[*]' COLUMNS (
        seq BIGINT PATH '$[0]',
        error LONGTEXT PATH '$[1]',
        retry_in DOUBLE PATH '$[2]')) f
    ON o.seq = f.seq
SET o.status = 'failed', o.attempts = o.attempts + 1, o.last_error = f.error,
    o.available_at = UTC_TIMESTAMP(6) + INTERVAL ROUND(f.retry_in * 1000000) MICROSECOND,
    o.locked_by = NULL, o.locked_until = NULL, o.lock_token = NULL
WHERE o.status IN ('pending', 'processing', 'failed')
  AND MOD(o.`partition`, %s) IN (SELECT `partition` FROM {table}_partitions WHERE owner = %s);

-- name: abandon_owned
-- Parameters: a JSON array of [seq, error], partition count, worker.
UPDATE {table} o
JOIN JSON_TABLE(%s, '$[*]' COLUMNS (
        seq BIGINT PATH '$[0]',
        error LONGTEXT PATH '$[1]')) f
    ON o.seq = f.seq
SET o.status = 'abandoned', o.attempts = o.attempts + 1, o.last_error = f.error,
    o.abandoned_at = UTC_TIMESTAMP(6),
    o.locked_by = NULL, o.locked_until = NULL, o.lock_token = NULL
WHERE o.status IN ('pending', 'processing', 'failed')
  AND MOD(o.`partition`, %s) IN (SELECT `partition` FROM {table}_partitions WHERE owner = %s);

-- name: delete_owned
-- Parameters: seqs, partition count, worker.
DELETE FROM {table}
WHERE seq IN ({seqs}) AND status IN ('pending', 'processing', 'failed')
  AND MOD(`partition`, %s) IN (SELECT `partition` FROM {table}_partitions WHERE owner = %s);

-- name: publish_owned
-- Parameters: seqs, partition count, worker.
UPDATE {table}
SET status = 'published', published_at = UTC_TIMESTAMP(6),
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq IN ({seqs}) AND status IN ('pending', 'processing', 'failed')
  AND MOD(`partition`, %s) IN (SELECT `partition` FROM {table}_partitions WHERE owner = %s);

-- name: mark_published
UPDATE {table}
SET status = 'published', published_at = UTC_TIMESTAMP(6),
    locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq IN ({seqs}) AND lock_token = %s AND status = 'processing';

-- name: delete_published
DELETE FROM {table}
WHERE seq IN ({seqs}) AND lock_token = %s AND status = 'processing';

-- name: mark_failed
-- Parameters: a JSON array of [seq, error, retry_in seconds], token.
UPDATE {table} o
JOIN JSON_TABLE(%s, '$[*]' COLUMNS (
        seq BIGINT PATH '$[0]',
        error LONGTEXT PATH '$[1]',
        retry_in DOUBLE PATH '$[2]')) f
    ON o.seq = f.seq
SET o.status = 'failed', o.attempts = o.attempts + 1, o.last_error = f.error,
    o.available_at = UTC_TIMESTAMP(6) + INTERVAL ROUND(f.retry_in * 1000000) MICROSECOND,
    o.locked_by = NULL, o.locked_until = NULL, o.lock_token = NULL
WHERE o.lock_token = %s AND o.status = 'processing';

-- name: abandon
-- Parameters: a JSON array of [seq, error], token.
UPDATE {table} o
JOIN JSON_TABLE(%s, '$[*]' COLUMNS (
        seq BIGINT PATH '$[0]',
        error LONGTEXT PATH '$[1]')) f
    ON o.seq = f.seq
SET o.status = 'abandoned', o.attempts = o.attempts + 1, o.last_error = f.error,
    o.abandoned_at = UTC_TIMESTAMP(6),
    o.locked_by = NULL, o.locked_until = NULL, o.lock_token = NULL
WHERE o.lock_token = %s AND o.status = 'processing';

-- name: release
UPDATE {table}
SET status = 'pending', locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq IN ({seqs}) AND lock_token = %s AND status = 'processing';

-- name: renew
-- Parameters: lease seconds, seqs, token.
UPDATE {table}
SET locked_until = UTC_TIMESTAMP(6) + INTERVAL ROUND(%s * 1000000) MICROSECOND
WHERE seq IN ({seqs}) AND lock_token = %s AND status = 'processing';

-- name: recover_expired
UPDATE {table}
SET status = 'pending', locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE status = 'processing' AND locked_until < UTC_TIMESTAMP(6);

-- name: purge_published
-- Parameters: age in seconds, batch size.
DELETE FROM {table}
WHERE published_at < UTC_TIMESTAMP(6) - INTERVAL ROUND(%s * 1000000) MICROSECOND
  AND status = 'published'
ORDER BY published_at
LIMIT %s;

-- name: purge_abandoned
-- Parameters: age in seconds, batch size.
DELETE FROM {table}
WHERE abandoned_at < UTC_TIMESTAMP(6) - INTERVAL ROUND(%s * 1000000) MICROSECOND
  AND status = 'abandoned'
ORDER BY abandoned_at
LIMIT %s;

-- name: replay
UPDATE {table}
SET status = 'pending', attempts = 0, available_at = UTC_TIMESTAMP(6), abandoned_at = NULL
WHERE status = 'abandoned' AND seq IN ({seqs});

-- name: abandoned
-- Abandoned rows, newest first: seq below which to list (NULL: from the newest), twice;
-- target (NULL: any), twice; limit.
SELECT seq, id, target, topic, `key`, type, attempts, last_error, abandoned_at, occurred_at
FROM {table}
WHERE status = 'abandoned' AND (%s IS NULL OR seq < %s) AND (%s IS NULL OR target = %s)
ORDER BY seq DESC
LIMIT %s;

-- name: count_by_status
SELECT status, COUNT(*) FROM {table} GROUP BY status;

-- name: oldest_pending_age
SELECT TIMESTAMPDIFF(MICROSECOND, MIN(available_at), UTC_TIMESTAMP(6)) / 1000000
FROM {table}
WHERE status IN ('pending', 'failed') AND available_at <= UTC_TIMESTAMP(6);

-- name: active_leases
SELECT COUNT(*) FROM {table} WHERE status = 'processing' AND locked_until >= UTC_TIMESTAMP(6);

-- Partition leases (seed 002). A heartbeat runs members_expire through partitions_take
-- in one transaction, in this order. Dead members go before the worker joins, so two
-- heartbeats lock member rows in one order and cannot deadlock on them.

-- name: members_expire
DELETE FROM {table}_members WHERE lease_until < UTC_TIMESTAMP(6);

-- name: member_join
-- Parameters: worker, lease seconds, lease seconds again.
INSERT INTO {table}_members (worker, lease_until)
VALUES (%s, UTC_TIMESTAMP(6) + INTERVAL ROUND(%s * 1000000) MICROSECOND)
ON DUPLICATE KEY UPDATE
    lease_until = UTC_TIMESTAMP(6) + INTERVAL ROUND(%s * 1000000) MICROSECOND;

-- name: partitions_count
-- Parameters: partitions. A plain read: partitions_create runs only if rows are missing.
SELECT COUNT(*) FROM {table}_partitions WHERE `partition` < %s;

-- name: partitions_create
-- Parameters: a JSON array of partition numbers. It locks every row that already
-- exists, which would make heartbeats wait on each other, so it runs only when
-- partitions_count says some are missing. A duplicate (another heartbeat created it
-- first) is a no-op update, not an error or a warning as with INSERT IGNORE.
INSERT INTO {table}_partitions (`partition`)
SELECT p FROM JSON_TABLE(%s, '$[*]' COLUMNS (p INT PATH '$')) AS numbers
ON DUPLICATE KEY UPDATE `partition` = `partition`;

-- name: members_live
SELECT COUNT(*) FROM {table}_members WHERE lease_until >= UTC_TIMESTAMP(6);

-- name: partitions_renew
-- Parameters: lease seconds, worker.
UPDATE {table}_partitions
SET lease_until = UTC_TIMESTAMP(6) + INTERVAL ROUND(%s * 1000000) MICROSECOND
WHERE owner = %s;

-- name: partitions_held
-- Parameters: worker. After partitions_renew, whose locks keep these rows ours.
SELECT `partition` FROM {table}_partitions WHERE owner = %s;

-- name: partitions_release
-- Parameters: worker, the partitions it gives back.
UPDATE {table}_partitions SET owner = NULL, lease_until = NULL
WHERE owner = %s AND `partition` IN ({partitions});

-- name: partitions_free
-- Parameters: partitions, how many. Free or expired ones, lowest first; SKIP LOCKED
-- passes over rows another heartbeat is renewing or taking.
SELECT `partition` FROM {table}_partitions
WHERE `partition` < %s AND (owner IS NULL OR lease_until < UTC_TIMESTAMP(6))
ORDER BY `partition`
LIMIT %s
FOR UPDATE SKIP LOCKED;

-- name: partitions_take
-- Parameters: worker, lease seconds, the partitions partitions_free locked.
UPDATE {table}_partitions
SET owner = %s, lease_until = UTC_TIMESTAMP(6) + INTERVAL ROUND(%s * 1000000) MICROSECOND
WHERE `partition` IN ({partitions});

-- name: partitions_leave
-- Parameters: worker.
UPDATE {table}_partitions SET owner = NULL, lease_until = NULL WHERE owner = %s;

-- name: member_leave
-- Parameters: worker.
DELETE FROM {table}_members WHERE worker = %s;
