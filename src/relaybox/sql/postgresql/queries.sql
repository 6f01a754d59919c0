-- relaybox's named queries on PostgreSQL. Parameters are numbered ($1 ...); lists of
-- seqs travel as one array text parameter ('{1,2,3}'), lists of failures as JSON text.
-- The relay's statements take and return no array of integers as one: asyncpg knows
-- no such array type until it has asked the server what it is, a query of ~4 ms of
-- server time on every new connection, which sat between a fresh relay and its first
-- batch twice (the heartbeat's partitions, then the read's). Partitions travel as
-- array text too, and where a filter tests every row against them, the array is made
-- once per call (a scalar subquery) rather than parsed again at every row.

-- name: insert_one
-- Writers of one key take turns: a transaction-scoped advisory lock on the key ($17,
-- computed by the writer; NULL for a keyless message, which the strict function then
-- skips) is taken before the row gets its seq, so a key's seq order is also its commit
-- order: the relay can never see seq 2 of a key committed while seq 1 is in flight.
-- The lock is taken in a subquery, not as a function in FROM: a function scan stores
-- its one row in a tuplestore first, server CPU in every writer transaction. A subquery
-- with a volatile call is never pulled up, so its Result runs below the projection that
-- draws the seq.
INSERT INTO {table} (id, target, external, topic, key, partition, type, content_type,
    payload, headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at,
    available_at)
-- In a SELECT list parameters get no type from the target columns: cast every one.
SELECT $1::uuid, $2::text, $3::boolean, $4::text, $5::text, $6::integer, $7::text,
    $8::text, $9::bytea, $10::jsonb, $11::text, $12::text, $13::text, $14::text,
    $15::timestamptz, now() + $16::float8 * interval '1 second'
FROM (SELECT pg_advisory_xact_lock($17::bigint)) AS key_lock;

-- name: insert_one_now
-- The common case, no delay: available_at takes its default. $16 is the key lock.
INSERT INTO {table} (id, target, external, topic, key, partition, type, content_type,
    payload, headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at)
SELECT $1::uuid, $2::text, $3::boolean, $4::text, $5::text, $6::integer, $7::text,
    $8::text, $9::bytea, $10::jsonb, $11::text, $12::text, $13::text, $14::text,
    $15::timestamptz
FROM (SELECT pg_advisory_xact_lock($16::bigint)) AS key_lock;

-- name: insert_one_basic
-- The commonest row: no delay, not external, no headers and no correlation, causation,
-- tenant or aggregate id. Those columns take their defaults (false, '{}', NULL), so the
-- statement carries 10 parameters instead of 16: fewer for the client to dump and the
-- server to cast, in every business transaction. $10 is the key lock.
INSERT INTO {table} (id, target, topic, key, partition, type, content_type, payload,
    occurred_at)
SELECT $1::uuid, $2::text, $3::text, $4::text, $5::integer, $6::text, $7::text,
    $8::bytea, $9::timestamptz
FROM (SELECT pg_advisory_xact_lock($10::bigint)) AS key_lock;

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

-- name: insert_one_notify
-- insert_one that also wakes listening relays: pg_notify($18 channel) queues a NOTIFY
-- delivered only if the transaction commits, in the same round trip. NOTIFY takes a
-- global lock at commit, so the writer sends this variant only once per notify interval.
INSERT INTO {table} (id, target, external, topic, key, partition, type, content_type,
    payload, headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at,
    available_at)
SELECT $1::uuid, $2::text, $3::boolean, $4::text, $5::text, $6::integer, $7::text,
    $8::text, $9::bytea, $10::jsonb, $11::text, $12::text, $13::text, $14::text,
    $15::timestamptz, now() + $16::float8 * interval '1 second'
FROM (SELECT pg_advisory_xact_lock($17::bigint), pg_notify($18::text, '')) AS key_lock;

-- name: insert_one_now_notify
-- insert_one_now plus the NOTIFY on channel $17 (see insert_one_notify).
INSERT INTO {table} (id, target, external, topic, key, partition, type, content_type,
    payload, headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at)
SELECT $1::uuid, $2::text, $3::boolean, $4::text, $5::text, $6::integer, $7::text,
    $8::text, $9::bytea, $10::jsonb, $11::text, $12::text, $13::text, $14::text,
    $15::timestamptz
FROM (SELECT pg_advisory_xact_lock($16::bigint), pg_notify($17::text, '')) AS key_lock;

-- name: insert_one_basic_notify
-- insert_one_basic plus the NOTIFY on channel $11 (see insert_one_notify).
INSERT INTO {table} (id, target, topic, key, partition, type, content_type, payload,
    occurred_at)
SELECT $1::uuid, $2::text, $3::text, $4::text, $5::integer, $6::text, $7::text,
    $8::bytea, $9::timestamptz
FROM (SELECT pg_advisory_xact_lock($10::bigint), pg_notify($11::text, '')) AS key_lock;

-- name: insert_many_notify
-- insert_many plus the NOTIFY on channel $18 (see insert_one_notify), as one more
-- one-row item in the FROM list: a CTE nobody reads would never run.
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
FROM (SELECT count(*) FROM key_lock) AS locked, pg_notify($18::text, '') AS woke,
    unnest($1::uuid[], $2::text[], $3::boolean[], $4::text[], $5::text[], $6::integer[],
    $7::text[], $8::text[], $9::bytea[], $10::text[], $11::text[], $12::text[],
    $13::text[], $14::text[], $15::timestamptz[], $16::float8[]) WITH ORDINALITY
    AS r(id, target, external, topic, key, partition, type, content_type, payload, headers,
         correlation_id, causation_id, tenant_id, aggregate_id, occurred_at, delay, ord)
ORDER BY r.ord;

-- name: claim
-- The row-lease claim: one call of {table}_claim (schema.sql explains it).
-- $1 worker, $2 limit, $3 partitions (array text) or NULL, $4 partition count, $5
-- targets or NULL, $6 token, $7 lease s, $8 the table's claim-lock key, $9 the byte
-- budget, $10 whether a first payload over it goes alone.
SELECT expired, seq, id, target, external, topic, key, partition, type, content_type,
    payload, headers, correlation_id, causation_id, tenant_id, aggregate_id, occurred_at,
    attempts
FROM {table}_claim($1::text, $2::integer, $3::text::integer[], $4::integer, $5::text[],
    $6::uuid, $7::float8, $8::integer, $9::bigint, $10::boolean);

-- name: read
-- The owned read of a relay that holds partitions: up to $1 due rows of its partitions
-- and targets, oldest first, that it may publish now, in per-key order. It writes
-- nothing. What the relay has in flight comes in as arguments, and those rows are left
-- out, with every row of a key in flight (a key's rows in flight are its earliest live
-- rows, as keys are read in order from their head). A waiting row (delayed, or backing
-- off; waits_ix) holds back what comes after it in its key. A row in processing (claimed
-- by a relay without partition leases) comes back flagged `blocked` while its lease
-- lasts, so the relay holds back its key from there on.
-- One statement, so rows stream to the relay as the scan finds them (a PL/pgSQL
-- function would store its whole result first). Every plan here is good whatever the
-- sizes, so generic plans serve and nothing is planned per call.
-- $1 limit, $2 partitions (array text) or NULL, $3 partition count, $4 targets or NULL,
-- $5 the seqs in flight (array text), $6 the keyed ones' target and key, each pair one
-- string joined by chr(31), as a JSON array, $7 the window (2 x limit + rows in flight). Long
-- lists travel as one text parameter: asyncpg checks every element of an array
-- parameter, where one string costs nothing. One string per pair, not a pair of
-- strings: the read parses and hashes half as much (measured: an eighth of its time).
-- Target names hold no chr(31), so each string is one pair's own; a row written by
-- hand with one in its target could share its string with another pair, which only
-- holds that row back until the batch in flight settles, never lets one through.
-- The window's rows come first, in seq order; {table}_read_past, called only when
-- they are fewer than $1 (and their payloads fewer bytes than $8), adds rows past the
-- window, all of higher seqs, within what is left of $8.
-- $8 the byte budget: the rows go in seq order while their payloads together stay
-- within it, and, if $9, a first payload larger on its own goes alone. The cut is
-- taken over the rows already limited, outside the query that finds them, so that
-- plan stays what it was; and the running sum (a window function, dearer than the
-- plain sum) only when their total is over the budget.
WITH picked AS (
    SELECT w.seq, w.id, w.target, w.external, w.topic, w.key,
        w.partition % $3::integer AS partition, w.type, w.content_type, w.payload,
        w.headers::text AS headers, w.correlation_id, w.causation_id, w.tenant_id,
        w.aggregate_id, w.occurred_at, w.attempts,
        w.status = 'processing' AND w.locked_until >= now() AS blocked
    FROM (
        SELECT o.* FROM {table} o
        WHERE ($2::text IS NULL
               OR o.partition % $3::integer = ANY((SELECT $2::text::integer[])::integer[]))
          AND ($4::text[] IS NULL OR o.target = ANY($4::text[]))
        ORDER BY o.seq
        LIMIT $7::integer) AS w
    WHERE (w.status = 'processing' OR w.available_at <= now())
      AND w.seq NOT IN (SELECT unnest($5::text::bigint[]))
      AND (w.key IS NULL OR w.target || chr(31) || w.key NOT IN (
          SELECT jsonb_array_elements_text($6::text::jsonb)))
      -- A waiting row (delayed, or backing off) holds back the rest of its key: the
      -- keys that wait, with the seq from which they do, from waits_ix alone (NULL,
      -- so no row is held, when none waits).
      AND coalesce(((
          SELECT jsonb_object_agg(x.target || chr(31) || x.key, x.first) FROM (
              SELECT b.target, b.key, min(b.seq) AS first FROM {table} b
              WHERE b.key IS NOT NULL
                AND b.available_at > b.created_at AND b.available_at > now()
                AND ($4::text[] IS NULL OR b.target = ANY($4::text[]))
              GROUP BY b.target, b.key) AS x
          ) ->> (w.target || chr(31) || w.key))::bigint > w.seq, true)
    ORDER BY w.seq
    LIMIT $1::integer
), held AS (
    SELECT count(*)::integer AS found, coalesce(sum(octet_length(payload)), 0) AS bytes
    FROM picked
)
SELECT * FROM picked
WHERE (SELECT bytes FROM held) <= $8::bigint
   OR picked.seq <= (
       SELECT max(s.seq) FROM (
           SELECT p.seq, octet_length(p.payload) AS size,
               sum(octet_length(p.payload)) OVER (ORDER BY p.seq) AS through
           FROM picked p) AS s
       WHERE s.through <= $8::bigint OR ($9::boolean AND s.through = s.size))
UNION ALL
SELECT * FROM {table}_read_past(
    $1::integer - (SELECT found FROM held), $2::text::integer[], $3::integer, $4::text[],
    $5::text::bigint[], $7::integer, $8::bigint - (SELECT bytes FROM held),
    $9::boolean AND (SELECT bytes FROM held) = 0)
WHERE (SELECT found FROM held) < $1::integer AND (SELECT bytes FROM held) < $8::bigint;

-- The owned settle: what a relay holding partitions learned about rows it read. Each
-- statement changes only rows in a partition of their target that the worker still
-- holds (the fence: a relay that lost a partition changes nothing there); a settle that
-- needs several runs them in one transaction. Failures travel as one JSON array.
-- The fence is an IN over the worker's partitions wrapped in IS TRUE: a subquery inside
-- an expression is never turned into a join, so the plan has the outbox table as its
-- only relation, found by seq, and the held partitions read once into a hash table that
-- each row probes (a hashed SubPlan). As a join, the planner was free to put the
-- partitions outside and repeat the whole seq lookup once per held partition, which it
-- did with a generic plan, or whenever the partitions table was last analyzed while no
-- relay held any (a fresh deploy): 20-40 ms a settle instead of under 1 ms. The same
-- holds for failures: their rows are found by seq = ANY (the failures' seqs, read once)
-- and each row's error and retry looked up in one JSON object keyed by seq, rather than
-- joined to the list, whose plan could scan the whole table.

-- A row held meanwhile (available_at at the held time, $4 below: an operator held it
-- between the read and the settle) stays held: a failed or abandoned settle leaves it
-- alone, where a published one may still delete it (the message went out). A row
-- delayed meanwhile keeps its delay: a failed settle never makes a row due sooner.

-- name: fail_owned
-- $1 failures JSON [[seq, error, retry-in seconds], ...], $2 worker, $3 partition count,
-- $4 the held rows' due time.
UPDATE {table} o
SET status = 'failed', attempts = o.attempts + 1, last_error = f.by_seq -> o.seq::text ->> 1,
    available_at = greatest(o.available_at, now()
        + (f.by_seq -> o.seq::text ->> 2)::float8 * interval '1 second'),
    locked_by = NULL, locked_until = NULL, lock_token = NULL
FROM (SELECT jsonb_object_agg(x ->> 0, x) AS by_seq
      FROM jsonb_array_elements($1::text::jsonb) AS x) AS f
WHERE o.seq = ANY(ARRAY(SELECT (x ->> 0)::bigint
                        FROM jsonb_array_elements($1::text::jsonb) AS x))
  AND o.available_at < $4::timestamptz
  AND ((o.target, o.partition % $3::integer) IN (
      SELECT p.target, p.partition FROM {table}_partitions p WHERE p.owner = $2::text)) IS TRUE;

-- name: abandon_owned
-- $1 failures JSON [[seq, error], ...], $2 worker, $3 partition count, $4 whether to
-- hold the keys, $5 the held rows' due time. The rows move to {table}_done with their
-- error and one more attempt; with $4, a row with a key stays instead, held (failed,
-- due at $5, with its error and the attempt counted), and its key's later rows wait
-- behind it. One row: how many rows were held or moved (a statement's own count would
-- say only one of the two).
WITH held AS (
    UPDATE {table} o
    SET status = 'failed', attempts = o.attempts + 1, last_error = f.by_seq ->> o.seq::text,
        available_at = $5::timestamptz,
        locked_by = NULL, locked_until = NULL, lock_token = NULL
    FROM (SELECT jsonb_object_agg(x ->> 0, x ->> 1) AS by_seq
          FROM jsonb_array_elements($1::text::jsonb) AS x) AS f
    WHERE $4::boolean AND o.key IS NOT NULL
      AND o.seq = ANY(ARRAY(SELECT (x ->> 0)::bigint
                            FROM jsonb_array_elements($1::text::jsonb) AS x))
      AND o.available_at < $5::timestamptz
      AND ((o.target, o.partition % $3::integer) IN (
          SELECT p.target, p.partition FROM {table}_partitions p WHERE p.owner = $2::text))
          IS TRUE
    RETURNING o.seq
), finished AS (
    DELETE FROM {table} o
    USING (SELECT jsonb_object_agg(x ->> 0, x ->> 1) AS by_seq
           FROM jsonb_array_elements($1::text::jsonb) AS x) AS f
    WHERE o.seq = ANY(ARRAY(SELECT (x ->> 0)::bigint
                            FROM jsonb_array_elements($1::text::jsonb) AS x))
      AND NOT ($4::boolean AND o.key IS NOT NULL)
      AND o.available_at < $5::timestamptz
      AND ((o.target, o.partition % $3::integer) IN (
          SELECT p.target, p.partition FROM {table}_partitions p WHERE p.owner = $2::text))
          IS TRUE
    RETURNING o.*, f.by_seq ->> o.seq::text AS error
), moved AS (
    INSERT INTO {table}_done (seq, status, attempts, available_at, abandoned_at, last_error,
        id, target, external, topic, key, partition, type, content_type, payload, headers,
        correlation_id, causation_id, tenant_id, aggregate_id, occurred_at, created_at)
    SELECT m.seq, 'abandoned', m.attempts + 1, m.available_at, now(), m.error,
        m.id, m.target, m.external, m.topic, m.key, m.partition, m.type, m.content_type,
        m.payload, m.headers, m.correlation_id, m.causation_id, m.tenant_id, m.aggregate_id,
        m.occurred_at, m.created_at
    FROM finished m
    RETURNING 1
)
SELECT (SELECT count(*) FROM held) + (SELECT count(*) FROM moved);

-- name: delete_owned
-- Published rows, deleted: $1 seqs (array text), $2 worker, $3 partition count.
DELETE FROM {table} o
WHERE o.seq = ANY($1::text::bigint[])
  AND ((o.target, o.partition % $3::integer) IN (
      SELECT p.target, p.partition FROM {table}_partitions p WHERE p.owner = $2::text)) IS TRUE;

-- name: publish_owned
-- Published rows, kept under the published retention: moved to {table}_done.
-- $1 seqs (array text), $2 worker, $3 partition count.
WITH finished AS (
    DELETE FROM {table} o
    WHERE o.seq = ANY($1::text::bigint[])
      AND ((o.target, o.partition % $3::integer) IN (
          SELECT p.target, p.partition FROM {table}_partitions p WHERE p.owner = $2::text))
          IS TRUE
    RETURNING o.*
)
INSERT INTO {table}_done (seq, status, attempts, available_at, published_at, last_error,
    id, target, external, topic, key, partition, type, content_type, payload, headers,
    correlation_id, causation_id, tenant_id, aggregate_id, occurred_at, created_at)
SELECT m.seq, 'published', m.attempts, m.available_at, now(), m.last_error,
    m.id, m.target, m.external, m.topic, m.key, m.partition, m.type, m.content_type,
    m.payload, m.headers, m.correlation_id, m.causation_id, m.tenant_id, m.aggregate_id,
    m.occurred_at, m.created_at
FROM finished m;

-- The row-lease marks: each changes only rows still in processing under the claim's
-- token (a mark whose lease was lost and taken over changes nothing).

-- name: mark_published
-- Published rows that are kept, moved to {table}_done: $1 seqs (array text), $2 token.
WITH finished AS (
    DELETE FROM {table}
    WHERE seq = ANY($1::text::bigint[]) AND lock_token = $2::uuid AND status = 'processing'
    RETURNING *
)
INSERT INTO {table}_done (seq, status, attempts, available_at, published_at, last_error,
    id, target, external, topic, key, partition, type, content_type, payload, headers,
    correlation_id, causation_id, tenant_id, aggregate_id, occurred_at, created_at)
SELECT m.seq, 'published', m.attempts, m.available_at, now(), m.last_error,
    m.id, m.target, m.external, m.topic, m.key, m.partition, m.type, m.content_type,
    m.payload, m.headers, m.correlation_id, m.causation_id, m.tenant_id, m.aggregate_id,
    m.occurred_at, m.created_at
FROM finished m;

-- name: delete_published
-- $1 seqs (array text), $2 token.
DELETE FROM {table}
WHERE seq = ANY($1::text::bigint[]) AND lock_token = $2::uuid AND status = 'processing';

-- name: mark_failed
-- $1 failures JSON [[seq, error, retry-in seconds], ...], $2 token, $3 the held rows' due
-- time (a row held stays held, as in the settle above).
UPDATE {table} o
SET status = 'failed', attempts = o.attempts + 1, last_error = f.by_seq -> o.seq::text ->> 1,
    available_at = now()
        + (f.by_seq -> o.seq::text ->> 2)::float8 * interval '1 second',
    locked_by = NULL, locked_until = NULL, lock_token = NULL
FROM (SELECT jsonb_object_agg(x ->> 0, x) AS by_seq
      FROM jsonb_array_elements($1::text::jsonb) AS x) AS f
WHERE o.seq = ANY(ARRAY(SELECT (x ->> 0)::bigint
                        FROM jsonb_array_elements($1::text::jsonb) AS x))
  AND o.lock_token = $2::uuid AND o.status = 'processing' AND o.available_at < $3::timestamptz;

-- name: abandon
-- As abandon_owned, fenced by the claim's token: $1 failures JSON [[seq, error], ...],
-- $2 token, $3 whether to hold the keys, $4 the held rows' due time. One row: how many
-- rows were held or moved.
WITH held AS (
    UPDATE {table} o
    SET status = 'failed', attempts = o.attempts + 1, last_error = f.by_seq ->> o.seq::text,
        available_at = $4::timestamptz,
        locked_by = NULL, locked_until = NULL, lock_token = NULL
    FROM (SELECT jsonb_object_agg(x ->> 0, x ->> 1) AS by_seq
          FROM jsonb_array_elements($1::text::jsonb) AS x) AS f
    WHERE $3::boolean AND o.key IS NOT NULL
      AND o.seq = ANY(ARRAY(SELECT (x ->> 0)::bigint
                            FROM jsonb_array_elements($1::text::jsonb) AS x))
      AND o.lock_token = $2::uuid AND o.status = 'processing'
      AND o.available_at < $4::timestamptz
    RETURNING o.seq
), finished AS (
    DELETE FROM {table} o
    USING (SELECT jsonb_object_agg(x ->> 0, x ->> 1) AS by_seq
           FROM jsonb_array_elements($1::text::jsonb) AS x) AS f
    WHERE o.seq = ANY(ARRAY(SELECT (x ->> 0)::bigint
                            FROM jsonb_array_elements($1::text::jsonb) AS x))
      AND NOT ($3::boolean AND o.key IS NOT NULL)
      AND o.lock_token = $2::uuid AND o.status = 'processing'
      AND o.available_at < $4::timestamptz
    RETURNING o.*, f.by_seq ->> o.seq::text AS error
), moved AS (
    INSERT INTO {table}_done (seq, status, attempts, available_at, abandoned_at, last_error,
        id, target, external, topic, key, partition, type, content_type, payload, headers,
        correlation_id, causation_id, tenant_id, aggregate_id, occurred_at, created_at)
    SELECT m.seq, 'abandoned', m.attempts + 1, m.available_at, now(), m.error,
        m.id, m.target, m.external, m.topic, m.key, m.partition, m.type, m.content_type,
        m.payload, m.headers, m.correlation_id, m.causation_id, m.tenant_id, m.aggregate_id,
        m.occurred_at, m.created_at
    FROM finished m
    RETURNING 1
)
SELECT (SELECT count(*) FROM held) + (SELECT count(*) FROM moved);

-- name: release
-- $1 seqs (array text), $2 token.
UPDATE {table}
SET status = 'pending', locked_by = NULL, locked_until = NULL, lock_token = NULL
WHERE seq = ANY($1::text::bigint[]) AND lock_token = $2::uuid AND status = 'processing';

-- name: renew
-- $1 seqs (array text), $2 token, $3 lease seconds.
UPDATE {table}
SET locked_until = now() + $3::float8 * interval '1 second'
WHERE seq = ANY($1::text::bigint[]) AND lock_token = $2::uuid AND status = 'processing';

-- What operators need.

-- name: purge_published
-- $1 age in seconds, $2 batch size.
DELETE FROM {table}_done WHERE seq IN (
    SELECT seq FROM {table}_done
    WHERE published_at < now() - $1::float8 * interval '1 second'
    ORDER BY published_at LIMIT $2::integer);

-- name: purge_abandoned
-- $1 age in seconds, $2 batch size.
DELETE FROM {table}_done WHERE seq IN (
    SELECT seq FROM {table}_done
    WHERE abandoned_at < now() - $1::float8 * interval '1 second'
    ORDER BY abandoned_at LIMIT $2::integer);

-- name: replay
-- Abandoned rows back to {table} as pending, under their own seq, with no attempts, and
-- held rows (due at $5, the held rows' due time) pending, with no attempts, due now.
-- $1 seqs (array text); with $2 actor, each row replayed gets an audit record ($3 the
-- action, $4 the reason). The statement returns how many rows it replayed.
WITH back AS (
    DELETE FROM {table}_done
    WHERE status = 'abandoned' AND seq = ANY($1::text::bigint[])
    RETURNING *
), moved AS (
    INSERT INTO {table} (seq, last_error, id, target, external, topic, key, partition, type,
        content_type, payload, headers, correlation_id, causation_id, tenant_id,
        aggregate_id, occurred_at, created_at)
    OVERRIDING SYSTEM VALUE
    SELECT b.seq, b.last_error, b.id, b.target, b.external, b.topic, b.key, b.partition,
        b.type, b.content_type, b.payload, b.headers, b.correlation_id, b.causation_id,
        b.tenant_id, b.aggregate_id, b.occurred_at, b.created_at
    FROM back b
    RETURNING seq, id, target, key
), freed AS (
    UPDATE {table}
    SET status = 'pending', attempts = 0, available_at = now(),
        locked_by = NULL, locked_until = NULL, lock_token = NULL
    WHERE seq = ANY($1::text::bigint[]) AND available_at >= $5::timestamptz
    RETURNING seq, id, target, key
), changed AS (
    SELECT * FROM moved UNION ALL SELECT * FROM freed
), audited AS (
    INSERT INTO {table}_audit (actor, action, reason, seq, message_id, target, key)
    SELECT $2::text, $3::text, $4::text, c.seq, c.id, c.target, c.key
    FROM changed c WHERE $2::text IS NOT NULL
    ORDER BY c.seq
)
SELECT count(*) FROM changed;

-- name: abandoned
-- Abandoned rows, newest first: $1 seq below which to list (NULL: from the newest), $2
-- target (NULL: any), $3 limit. The abandoned_at test lets the purge's partial index
-- find them among published rows kept under a retention.
SELECT seq, id, target, topic, key, type, attempts, last_error, abandoned_at, occurred_at
FROM {table}_done
WHERE abandoned_at IS NOT NULL AND status = 'abandoned'
  AND ($1::bigint IS NULL OR seq < $1::bigint)
  AND ($2::text IS NULL OR target = $2::text)
ORDER BY seq DESC
LIMIT $3::integer;

-- The operator's console. A row's state is read off it, by the database's clock: held
-- (due at the held rows' due time, HELD_UNTIL), in flight (leased, the lease running),
-- retrying (attempted before, or failed), delayed (not due yet), else pending; in
-- {table}_done, abandoned or published.
-- A search walks one ordered index per table (the primary key, or with a target and a
-- key the (target, key, seq) indexes) within a seq range, in {order} (ASC or DESC: the
-- storage runs each as two queries), each side limited, then merged. Parameters, the
-- same on every dialect: $1 whether live rows are wanted, $2 whether finished ones are,
-- $3 the states wanted (comma-separated, NULL: any), $4 target, $5 topic, $6 key, $7
-- type, $8 id, $9 correlation id, $10 causation id, $11 tenant id, $12 aggregate id
-- (each NULL: any), $13 and $14 the lowest and highest seq, $15 and $16 the earliest
-- and latest created_at (NULL: open), $17 limit, $18 the held rows' due time.

-- name: search
SELECT * FROM (
    (SELECT * FROM (
        SELECT o.seq, o.id,
            CASE WHEN o.available_at >= $18::timestamptz THEN 'held'
                 WHEN o.status = 'processing' AND o.locked_until > now() THEN 'in_flight'
                 WHEN o.attempts > 0 OR o.status = 'failed' THEN 'retrying'
                 WHEN o.available_at > now() THEN 'delayed'
                 ELSE 'pending' END AS state,
            o.target, o.topic, o.key, o.type, o.attempts, o.created_at, o.available_at,
            o.occurred_at, o.published_at, o.abandoned_at, o.last_error, o.correlation_id
        FROM {table} o
        WHERE $1::boolean AND o.seq BETWEEN $13::bigint AND $14::bigint
          AND ($4::text IS NULL OR o.target = $4::text)
          AND ($5::text IS NULL OR o.topic = $5::text)
          AND ($6::text IS NULL OR o.key = $6::text)
          AND ($7::text IS NULL OR o.type = $7::text)
          AND ($8::uuid IS NULL OR o.id = $8::uuid)
          AND ($9::text IS NULL OR o.correlation_id = $9::text)
          AND ($10::text IS NULL OR o.causation_id = $10::text)
          AND ($11::text IS NULL OR o.tenant_id = $11::text)
          AND ($12::text IS NULL OR o.aggregate_id = $12::text)
          AND ($15::timestamptz IS NULL OR o.created_at >= $15::timestamptz)
          AND ($16::timestamptz IS NULL OR o.created_at <= $16::timestamptz)) AS s
     WHERE $3::text IS NULL OR s.state = ANY(string_to_array($3::text, ','))
     ORDER BY s.seq {order}
     LIMIT $17::integer)
    UNION ALL
    (SELECT * FROM (
        SELECT d.seq, d.id, d.status::text AS state, d.target, d.topic, d.key, d.type,
            d.attempts, d.created_at, NULL::timestamptz AS available_at, d.occurred_at,
            d.published_at, d.abandoned_at, d.last_error, d.correlation_id
        FROM {table}_done d
        WHERE $2::boolean AND d.seq BETWEEN $13::bigint AND $14::bigint
          AND ($4::text IS NULL OR d.target = $4::text)
          AND ($5::text IS NULL OR d.topic = $5::text)
          AND ($6::text IS NULL OR d.key = $6::text)
          AND ($7::text IS NULL OR d.type = $7::text)
          AND ($8::uuid IS NULL OR d.id = $8::uuid)
          AND ($9::text IS NULL OR d.correlation_id = $9::text)
          AND ($10::text IS NULL OR d.causation_id = $10::text)
          AND ($11::text IS NULL OR d.tenant_id = $11::text)
          AND ($12::text IS NULL OR d.aggregate_id = $12::text)
          AND ($15::timestamptz IS NULL OR d.created_at >= $15::timestamptz)
          AND ($16::timestamptz IS NULL OR d.created_at <= $16::timestamptz)) AS s
     WHERE $3::text IS NULL OR s.state = ANY(string_to_array($3::text, ','))
     ORDER BY s.seq {order}
     LIMIT $17::integer)
) AS m
ORDER BY m.seq {order}
LIMIT $17::integer;

-- name: search_key
-- `search` of one (target, key) ($4 and $6, both given): each side walks its (target,
-- key, seq) index within the seq range.
SELECT * FROM (
    (SELECT * FROM (
        SELECT o.seq, o.id,
            CASE WHEN o.available_at >= $18::timestamptz THEN 'held'
                 WHEN o.status = 'processing' AND o.locked_until > now() THEN 'in_flight'
                 WHEN o.attempts > 0 OR o.status = 'failed' THEN 'retrying'
                 WHEN o.available_at > now() THEN 'delayed'
                 ELSE 'pending' END AS state,
            o.target, o.topic, o.key, o.type, o.attempts, o.created_at, o.available_at,
            o.occurred_at, o.published_at, o.abandoned_at, o.last_error, o.correlation_id
        FROM {table} o
        WHERE $1::boolean AND o.target = $4::text AND o.key = $6::text
          AND o.seq BETWEEN $13::bigint AND $14::bigint
          AND ($5::text IS NULL OR o.topic = $5::text)
          AND ($7::text IS NULL OR o.type = $7::text)
          AND ($8::uuid IS NULL OR o.id = $8::uuid)
          AND ($9::text IS NULL OR o.correlation_id = $9::text)
          AND ($10::text IS NULL OR o.causation_id = $10::text)
          AND ($11::text IS NULL OR o.tenant_id = $11::text)
          AND ($12::text IS NULL OR o.aggregate_id = $12::text)
          AND ($15::timestamptz IS NULL OR o.created_at >= $15::timestamptz)
          AND ($16::timestamptz IS NULL OR o.created_at <= $16::timestamptz)) AS s
     WHERE $3::text IS NULL OR s.state = ANY(string_to_array($3::text, ','))
     ORDER BY s.seq {order}
     LIMIT $17::integer)
    UNION ALL
    (SELECT * FROM (
        SELECT d.seq, d.id, d.status::text AS state, d.target, d.topic, d.key, d.type,
            d.attempts, d.created_at, NULL::timestamptz AS available_at, d.occurred_at,
            d.published_at, d.abandoned_at, d.last_error, d.correlation_id
        FROM {table}_done d
        WHERE $2::boolean AND d.target = $4::text AND d.key = $6::text
          AND d.seq BETWEEN $13::bigint AND $14::bigint
          AND ($5::text IS NULL OR d.topic = $5::text)
          AND ($7::text IS NULL OR d.type = $7::text)
          AND ($8::uuid IS NULL OR d.id = $8::uuid)
          AND ($9::text IS NULL OR d.correlation_id = $9::text)
          AND ($10::text IS NULL OR d.causation_id = $10::text)
          AND ($11::text IS NULL OR d.tenant_id = $11::text)
          AND ($12::text IS NULL OR d.aggregate_id = $12::text)
          AND ($15::timestamptz IS NULL OR d.created_at >= $15::timestamptz)
          AND ($16::timestamptz IS NULL OR d.created_at <= $16::timestamptz)) AS s
     WHERE $3::text IS NULL OR s.state = ANY(string_to_array($3::text, ','))
     ORDER BY s.seq {order}
     LIMIT $17::integer)
) AS m
ORDER BY m.seq {order}
LIMIT $17::integer;

-- name: messages
-- Messages whole, live or finished: $1 their seqs, $2 the held rows' due time.
SELECT o.seq, o.id,
    CASE WHEN o.available_at >= $2::timestamptz THEN 'held'
         WHEN o.status = 'processing' AND o.locked_until > now() THEN 'in_flight'
         WHEN o.attempts > 0 OR o.status = 'failed' THEN 'retrying'
         WHEN o.available_at > now() THEN 'delayed'
         ELSE 'pending' END,
    o.target, o.topic, o.key, o.type, o.attempts, o.created_at, o.available_at,
    o.occurred_at, o.published_at, o.abandoned_at, o.last_error, o.correlation_id,
    o.external, o.partition, o.content_type, o.payload, o.headers::text, o.causation_id,
    o.tenant_id, o.aggregate_id, o.locked_by, o.locked_until
FROM {table} o WHERE o.seq = ANY($1::text::bigint[])
UNION ALL
SELECT d.seq, d.id, d.status::text, d.target, d.topic, d.key, d.type, d.attempts,
    d.created_at, NULL, d.occurred_at, d.published_at, d.abandoned_at, d.last_error,
    d.correlation_id, d.external, d.partition, d.content_type, d.payload, d.headers::text,
    d.causation_id, d.tenant_id, d.aggregate_id, NULL, NULL
FROM {table}_done d WHERE d.seq = ANY($1::text::bigint[]);

-- The operator's changes. Each is one statement: it changes only the rows of $1 (seqs,
-- array text) still in a state the change applies to, as of the statement (a row a
-- relay changed meanwhile is checked again as it now is), writes one audit record per
-- row changed ($2 actor, $3 action, $4 reason) and returns how many it changed. $5,
-- where taken, is the held rows' due time. A row in flight is leased under a lease still running; a
-- row in processing whose lease ran out is not, and a change that keeps it live puts
-- it back to pending (failed, if it was attempted before), so that no claim takes it
-- by its lease.

-- name: discard
-- Live rows not in flight, and finished rows, deleted.
WITH live AS (
    DELETE FROM {table}
    WHERE seq = ANY($1::text::bigint[])
      AND NOT (status = 'processing' AND locked_until > now())
    RETURNING seq, id, target, key
), done AS (
    DELETE FROM {table}_done WHERE seq = ANY($1::text::bigint[])
    RETURNING seq, id, target, key
), changed AS (
    SELECT * FROM live UNION ALL SELECT * FROM done
), audited AS (
    INSERT INTO {table}_audit (actor, action, reason, seq, message_id, target, key)
    SELECT $2::text, $3::text, $4::text, c.seq, c.id, c.target, c.key FROM changed c
    ORDER BY c.seq
)
SELECT count(*) FROM changed;

-- name: claim_gate
-- Taken first, in the same transaction, by an operator's change that makes rows wait
-- (hold, reschedule): the lock a claim of a relay that leases rows takes ({table}_claim,
-- $1 its lock key), exclusively, so the change commits wholly before or after any such
-- claim. A claim chooses a key's rows with one snapshot and leases them with a later
-- one, which skips a row that stopped being due meanwhile: a row held in between would
-- stay behind while the rows after it in its key went out.
SELECT pg_advisory_xact_lock($1::integer, -1);

-- name: reschedule
-- Rows neither in flight nor held, due $6 seconds from now.
WITH changed AS (
    UPDATE {table}
    SET available_at = now() + $6::float8 * interval '1 second',
        status = CASE WHEN status <> 'processing' THEN status
                      WHEN attempts > 0 THEN 'failed'::{table}_status
                      ELSE 'pending'::{table}_status END,
        locked_by = NULL, locked_until = NULL, lock_token = NULL
    WHERE seq = ANY($1::text::bigint[]) AND available_at < $5::timestamptz
      AND NOT (status = 'processing' AND locked_until > now())
    RETURNING seq, id, target, key
), audited AS (
    INSERT INTO {table}_audit (actor, action, reason, seq, message_id, target, key)
    SELECT $2::text, $3::text, $4::text, c.seq, c.id, c.target, c.key FROM changed c
    ORDER BY c.seq
)
SELECT count(*) FROM changed;

-- name: hold
-- Rows neither in flight nor held, due at the held rows' due time ($6, the same as $5):
-- every read and claim then treats them as rows that wait, and holds back their key
-- behind them.
WITH changed AS (
    UPDATE {table}
    SET available_at = $6::timestamptz,
        status = CASE WHEN status <> 'processing' THEN status
                      WHEN attempts > 0 THEN 'failed'::{table}_status
                      ELSE 'pending'::{table}_status END,
        locked_by = NULL, locked_until = NULL, lock_token = NULL
    WHERE seq = ANY($1::text::bigint[]) AND available_at < $5::timestamptz
      AND NOT (status = 'processing' AND locked_until > now())
    RETURNING seq, id, target, key
), audited AS (
    INSERT INTO {table}_audit (actor, action, reason, seq, message_id, target, key)
    SELECT $2::text, $3::text, $4::text, c.seq, c.id, c.target, c.key FROM changed c
    ORDER BY c.seq
)
SELECT count(*) FROM changed;

-- name: release_held
-- Held rows pending, with no attempts, due now.
WITH changed AS (
    UPDATE {table}
    SET status = 'pending', attempts = 0, available_at = now(),
        locked_by = NULL, locked_until = NULL, lock_token = NULL
    WHERE seq = ANY($1::text::bigint[]) AND available_at >= $5::timestamptz
    RETURNING seq, id, target, key
), audited AS (
    INSERT INTO {table}_audit (actor, action, reason, seq, message_id, target, key)
    SELECT $2::text, $3::text, $4::text, c.seq, c.id, c.target, c.key FROM changed c
    ORDER BY c.seq
)
SELECT count(*) FROM changed;

-- name: audit
-- Audit records, newest first: $1 id below which to list (NULL: from the newest), $2
-- limit.
SELECT id, at, actor, action, reason, seq, message_id, target, key
FROM {table}_audit
WHERE $1::bigint IS NULL OR id < $1::bigint
ORDER BY id DESC
LIMIT $2::integer;

-- name: stats_scope
-- First in the counts' transaction: they read every live row, which no index serves,
-- and the relay's sessions run with sequential scans off (storage/postgres.py).
SET LOCAL enable_seqscan = on;

-- name: count_by_status
-- $1 the held rows' due time: held rows are counted apart (count_held).
SELECT status::text, count(*) FROM (
    SELECT status FROM {table} WHERE available_at < $1::timestamptz
    UNION ALL SELECT status FROM {table}_done) AS rows
GROUP BY status;

-- name: count_held
-- Held rows, and the (target, key) pairs they hold back: $1 the held rows' due time.
SELECT count(*), count(DISTINCT target || chr(31) || key) FROM {table}
WHERE available_at >= $1::timestamptz AND status <> 'processing';

-- name: live_by_target
-- Rows still to deliver, per target (every row of {table} is live).
SELECT target, count(*) FROM {table} GROUP BY target;

-- name: oldest_pending_age
SELECT extract(epoch FROM now() - min(available_at))::float8 FROM {table}
WHERE status IN ('pending', 'failed') AND available_at <= now();

-- name: active_leases
SELECT count(*) FROM {table}
WHERE status = 'processing' AND locked_until >= now();

-- name: probe
-- Run when a storage connects: the tables that are missing (relaybox then says to
-- migrate). It reads the catalog only, so a lock held on the table does not hold it up.
SELECT t FROM unnest(ARRAY['{table}', '{table}_done', '{table}_partitions',
                           '{table}_members']) AS t
WHERE to_regclass(t) IS NULL;

-- Partition leases, per target. A heartbeat of one target is one call of
-- {table}_heartbeat (schema.sql explains it), which expires dead members, joins,
-- creates the target's partitions if missing, renews those the worker holds and takes
-- free ones up to its share; only when the relay must give partitions back does
-- partitions_release follow, in a transaction of its own.

-- name: heartbeat
-- $1 worker, $2 lease seconds, $3 target, $4 partitions. One row: how many live relays
-- serve the target, the targets some live relay serves, the partitions held (renewed
-- and taken).
SELECT live, served, held::text
FROM {table}_heartbeat($1::text, $2::float8, $3::text, $4::integer);

-- name: partitions_release
-- $1 worker, $2 the partitions it gives back (array text), $3 target.
UPDATE {table}_partitions SET owner = NULL, lease_until = NULL
WHERE owner = $1::text AND target = $3::text AND partition = ANY($2::text::integer[]);

-- name: partitions_leave
-- $1 worker: every target's partitions.
UPDATE {table}_partitions SET owner = NULL, lease_until = NULL WHERE owner = $1::text;

-- name: member_leave
-- $1 worker.
DELETE FROM {table}_members WHERE worker = $1::text;

-- name: relay_members
-- The live relays (the console's list): each membership still within its lease.
SELECT worker, target, joined_at, lease_until FROM {table}_members
WHERE lease_until >= now()
ORDER BY target, worker;

-- name: relay_partitions
-- Which partitions each live relay holds, by target.
SELECT target, owner, partition FROM {table}_partitions
WHERE owner IS NOT NULL AND lease_until >= now()
ORDER BY target, owner, partition;

-- name: backfill_job
-- $1 name.
SELECT name, source, target, external, cursor_seq, copied, actor, reason, created_at,
       finished_at
FROM {table}_backfills WHERE name = $1;

-- name: backfill_begin
-- $1 name, $2 source filter (JSON), $3 target, $4 external, $5 actor, $6 reason: a new
-- backfill, or none when one of that name exists.
INSERT INTO {table}_backfills (name, source, target, external, actor, reason)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (name) DO NOTHING;

-- name: backfill_advance
-- $1 name, $2 the new cursor, $3 copies written with it, $4 finished: moves a running
-- backfill's cursor forward (or, with nothing copied, only marks it finished). It
-- changes no row when another run moved the cursor there first: the caller then
-- writes nothing.
UPDATE {table}_backfills
SET cursor_seq = CASE WHEN cursor_seq < $2 THEN $2 ELSE cursor_seq END,
    copied = copied + $3, updated_at = now(),
    finished_at = CASE WHEN $4 THEN now() ELSE NULL END
WHERE name = $1 AND finished_at IS NULL AND (cursor_seq < $2 OR ($3 = 0 AND $4));

-- name: key_targets
-- $1 key: the targets that have rows of this key, live or finished, each found by one
-- probe of the (target, key, seq) indexes past the one before (a loose scan): a search
-- of one key without a target then walks each target's key index instead of every row.
WITH RECURSIVE live(target) AS (
    (SELECT o.target FROM {table} o WHERE o.key IS NOT NULL ORDER BY o.target LIMIT 1)
    UNION ALL
    SELECT (SELECT o.target FROM {table} o
            WHERE o.key IS NOT NULL AND o.target > live.target ORDER BY o.target LIMIT 1)
    FROM live WHERE live.target IS NOT NULL
), done(target) AS (
    (SELECT d.target FROM {table}_done d WHERE d.key IS NOT NULL ORDER BY d.target LIMIT 1)
    UNION ALL
    SELECT (SELECT d.target FROM {table}_done d
            WHERE d.key IS NOT NULL AND d.target > done.target ORDER BY d.target LIMIT 1)
    FROM done WHERE done.target IS NOT NULL
)
SELECT t.target FROM (SELECT target FROM live UNION SELECT target FROM done) AS t
WHERE t.target IS NOT NULL
  AND (EXISTS (SELECT 1 FROM {table} o WHERE o.target = t.target AND o.key = $1::text)
       OR EXISTS (SELECT 1 FROM {table}_done d WHERE d.target = t.target AND d.key = $1::text))
ORDER BY t.target;

-- name: search_scope
-- First in a search's transaction: a bitmap scan reads every row its index condition
-- admits before the LIMIT can stop it, and the planner picks one for a filter it knows
-- nothing of (a never-analyzed table). Without it, a search walks an index in seq order
-- and stops at its page.
SET LOCAL enable_bitmapscan = off;

-- Activity and status, for the operator's console (schema.sql explains the tables).

-- name: activity_add
-- $1 target, $2 worker, $3 published, $4 failed, $5 abandoned, $6 lag sum, $7 lag max,
-- $8 lag count: added to the row of the database's current minute.
INSERT INTO {table}_activity AS a
    (target, minute, worker, published, failed, abandoned, lag_sum, lag_max, lag_count)
VALUES ($1, floor(extract(epoch FROM now()) / 60)::bigint, $2, $3, $4, $5, $6, $7, $8)
ON CONFLICT (target, minute, worker) DO UPDATE SET
    published = a.published + EXCLUDED.published,
    failed = a.failed + EXCLUDED.failed,
    abandoned = a.abandoned + EXCLUDED.abandoned,
    lag_sum = a.lag_sum + EXCLUDED.lag_sum,
    lag_max = greatest(a.lag_max, EXCLUDED.lag_max),
    lag_count = a.lag_count + EXCLUDED.lag_count;

-- name: relay_status_set
-- $1 worker, $2 target, $3 circuit state, $4 last error.
INSERT INTO {table}_relay_status (worker, target, circuit, last_error, updated_at)
VALUES ($1, $2, $3, $4, now())
ON CONFLICT (worker, target) DO UPDATE SET
    circuit = EXCLUDED.circuit, last_error = EXCLUDED.last_error,
    updated_at = EXCLUDED.updated_at;

-- name: activity_since
-- $1 the first minute. Per target and minute, summed over the relays.
SELECT target, minute, sum(published)::bigint, sum(failed)::bigint, sum(abandoned)::bigint,
    sum(lag_sum), max(lag_max), sum(lag_count)::bigint
FROM {table}_activity
WHERE minute >= $1::bigint
GROUP BY target, minute
ORDER BY target, minute;

-- name: relay_statuses
-- $1 seconds: rows updated within them.
SELECT worker, target, circuit, last_error, updated_at FROM {table}_relay_status
WHERE updated_at >= now() - $1::float8 * interval '1 second'
ORDER BY target, worker;

-- name: activity_purge
-- $1 age in seconds, $2 batch size.
DELETE FROM {table}_activity WHERE (target, minute, worker) IN (
    SELECT target, minute, worker FROM {table}_activity
    WHERE minute < floor((extract(epoch FROM now()) - $1::float8) / 60)
    ORDER BY minute LIMIT $2::integer);

-- name: relay_status_purge
-- $1 age in seconds, $2 batch size.
DELETE FROM {table}_relay_status WHERE (worker, target) IN (
    SELECT worker, target FROM {table}_relay_status
    WHERE updated_at < now() - $1::float8 * interval '1 second'
    ORDER BY updated_at LIMIT $2::integer);

-- name: stuck_live
-- $1 the held rows' due time: per target, its live rows that failed at least once
-- (not in flight) and its held ones, and when the oldest of them was written. One pass
-- over the live rows, in the counts' transaction (sequential scans on).
SELECT target,
       count(*) FILTER (WHERE available_at < $1::timestamptz),
       count(*) FILTER (WHERE available_at >= $1::timestamptz),
       min(created_at)
FROM {table}
WHERE (status = 'failed' OR attempts > 0 OR available_at >= $1::timestamptz)
  AND NOT (status = 'processing' AND locked_until > now())
GROUP BY target;

-- name: stuck_abandoned
-- Per target, its abandoned rows still kept and the oldest one's written time: from the
-- abandoned purge's partial index, which holds them alone.
SELECT target, count(*), min(created_at) FROM {table}_done
WHERE abandoned_at IS NOT NULL AND status = 'abandoned'
GROUP BY target;
