-- Reads that write nothing, for relays that hold partitions by lease (the default).
--
-- A relay that holds a partition (seed 002: {table}_partitions, renewed by its
-- heartbeats) is the only one that may publish that partition's rows, so it needs no
-- lease on each row: it reads due rows, keeps what it has in flight in memory, and
-- settles them with statements fenced by its ownership (queries.sql, *_owned). The
-- per-row claim below stays for relays run without partition leases.
--
-- The `partition` column now holds the key's stable hash (31 bits); a relay's partition
-- is that hash modulo its partition count, so writers and relays no longer have to
-- agree on a count, and a key never sits in two partitions when the count changes.
-- Rows written before, under the default 64 partitions, map to the same partitions
-- (64 divides 2^31).

-- Rows that may hold their key back because they wait (a delay, or the backoff after a
-- failed attempt): a read learns which keys wait from this index alone, without
-- walking any key's rows. A row written without a delay never enters it, so a writer
-- only evaluates its predicate.
CREATE INDEX IF NOT EXISTS {prefix}_waiting_ix ON {table} (target, key, seq)
    WHERE key IS NOT NULL AND published_at IS NULL AND abandoned_at IS NULL
      AND available_at > created_at;

-- The status is an enum instead of two CHECK constraints: PostgreSQL re-reads and
-- re-plans a table's CHECK expressions for every INSERT statement, which cost about
-- 5 % of a writer's one-row transaction (docs/benchmarks.md); an enum column checks
-- its values for nothing. (The dropped `finished_ck` tied the finish timestamps to the
-- status; relaybox's own statements set both together.) Changing the column's type
-- rewrites the table once: on a big outbox, run this migration at a quiet time.
DO $$
BEGIN
    CREATE TYPE {table}_status AS ENUM (
        'pending', 'processing', 'published', 'failed', 'abandoned');
EXCEPTION WHEN duplicate_object THEN NULL;
END
$$;

ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {prefix}_status_ck;
ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {prefix}_finished_ck;

DO $$
BEGIN
    IF (SELECT a.atttypid FROM pg_attribute a
        WHERE a.attrelid = '{table}'::regclass AND a.attname = 'status') = 'text'::regtype
    THEN
        ALTER TABLE {table}
            ALTER COLUMN status DROP DEFAULT,
            ALTER COLUMN status TYPE {table}_status USING status::{table}_status,
            ALTER COLUMN status SET DEFAULT 'pending';
    END IF;
END
$$;

-- The per-row claim of 0004, with partitions taken as hash modulo p_count.
DROP FUNCTION IF EXISTS {prefix}_claim(text, integer, integer[], text[], uuid, float8, integer);

CREATE OR REPLACE FUNCTION {prefix}_claim(
    p_worker text, p_limit integer, p_partitions integer[], p_count integer,
    p_targets text[], p_token uuid, p_lease float8, p_lock_key integer)
RETURNS TABLE (
    expired boolean, seq bigint, id uuid, target text, external boolean, topic text,
    key text, partition integer, type text, content_type text, payload bytea,
    headers text, correlation_id text, causation_id text, tenant_id text,
    aggregate_id text, occurred_at timestamptz, created_at timestamptz, attempts integer)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_window integer := 4 * p_limit;
    v_seqs bigint[];
    v_seen integer;
    v_last bigint;
    v_room integer;
    v_heads bigint[];
    v_head_targets text[];
    v_head_keys text[];
    v_per_key integer;
BEGIN
    IF p_partitions IS NULL THEN
        PERFORM pg_advisory_xact_lock(p_lock_key, -1);
    ELSE
        PERFORM pg_advisory_xact_lock_shared(p_lock_key, -1);
        PERFORM pg_advisory_xact_lock(p_lock_key, ordered.p)
        FROM (SELECT DISTINCT unnest(p_partitions) AS p ORDER BY 1) AS ordered;
    END IF;
    v_seqs := ARRAY(
        SELECT w.seq FROM (
            SELECT o.seq, o.target, o.key, o.status, o.locked_until, o.available_at
            FROM {table} o
            WHERE o.published_at IS NULL AND o.abandoned_at IS NULL
              AND (p_partitions IS NULL OR o.partition % p_count = ANY(p_partitions))
              AND (p_targets IS NULL OR o.target = ANY(p_targets))
            ORDER BY o.seq
            LIMIT v_window) AS w
        WHERE CASE WHEN w.status = 'processing' THEN w.locked_until < now()
                   ELSE w.available_at <= now() END
          AND (w.key IS NULL OR w.status = 'processing' OR NOT EXISTS (
              SELECT 1 FROM {table} h
              WHERE h.target = w.target AND h.key = w.key AND h.seq < w.seq
                AND h.key IS NOT NULL AND h.published_at IS NULL AND h.abandoned_at IS NULL
                AND (h.status = 'processing' OR h.available_at > now()
                     OR NOT (h.partition % p_count
                             = ANY(coalesce(p_partitions, ARRAY[h.partition % p_count]))))))
        ORDER BY w.seq
        LIMIT p_limit);
    IF cardinality(v_seqs) < p_limit THEN
        SELECT count(*), max(w.seq) INTO v_seen, v_last FROM (
            SELECT o.seq FROM {table} o
            WHERE o.published_at IS NULL AND o.abandoned_at IS NULL
              AND (p_partitions IS NULL OR o.partition % p_count = ANY(p_partitions))
              AND (p_targets IS NULL OR o.target = ANY(p_targets))
            ORDER BY o.seq
            LIMIT v_window) AS w;
    END IF;

    IF v_seen = v_window AND cardinality(v_seqs) < p_limit THEN
        v_room := p_limit - cardinality(v_seqs);
        SELECT coalesce(array_agg(c.seq ORDER BY c.seq), '{}'),
               array_agg(c.target ORDER BY c.seq), array_agg(c.key ORDER BY c.seq)
        INTO v_heads, v_head_targets, v_head_keys
        FROM (
            SELECT o.seq, o.target, o.key FROM (
                WITH RECURSIVE heads AS (
                    (SELECT k.target, k.key, k.seq FROM {table} k
                     WHERE k.key IS NOT NULL
                       AND k.published_at IS NULL AND k.abandoned_at IS NULL
                     ORDER BY k.target, k.key, k.seq LIMIT 1)
                    UNION ALL
                    SELECT n.target, n.key, n.seq FROM heads p, LATERAL (
                        SELECT k.target, k.key, k.seq FROM {table} k
                        WHERE k.key IS NOT NULL
                          AND k.published_at IS NULL AND k.abandoned_at IS NULL
                          AND (k.target, k.key) > (p.target, p.key)
                        ORDER BY k.target, k.key, k.seq LIMIT 1) n
                )
                SELECT heads.seq FROM heads WHERE heads.seq > v_last
            ) AS head
            JOIN {table} o ON o.seq = head.seq
            WHERE (p_partitions IS NULL OR o.partition % p_count = ANY(p_partitions))
              AND (p_targets IS NULL OR o.target = ANY(p_targets))
              AND CASE WHEN o.status = 'processing' THEN o.locked_until < now()
                       ELSE o.available_at <= now() END
            UNION ALL
            (SELECT o.seq, o.target, o.key FROM {table} o
             WHERE o.key IS NULL AND o.published_at IS NULL AND o.abandoned_at IS NULL
               AND o.seq > v_last
               AND (p_partitions IS NULL OR o.partition % p_count = ANY(p_partitions))
               AND (p_targets IS NULL OR o.target = ANY(p_targets))
               AND CASE WHEN o.status = 'processing' THEN o.locked_until < now()
                        ELSE o.available_at <= now() END
             ORDER BY o.seq
             LIMIT v_room)
            ORDER BY 1
            LIMIT v_room
        ) AS c;
        v_per_key := (v_room + cardinality(v_heads) - 1) / greatest(cardinality(v_heads), 1);
        v_seqs := v_seqs || ARRAY(
            SELECT x.seq FROM (
                SELECT hd.seq FROM unnest(v_heads, v_head_keys) AS hd(seq, key)
                WHERE hd.key IS NULL
                UNION ALL
                SELECT r.seq
                FROM unnest(v_heads, v_head_targets, v_head_keys) AS hd(seq, target, key),
                LATERAL (
                    SELECT k.seq, bool_and(k.status <> 'processing'
                                           AND k.available_at <= now()
                                           AND k.partition % p_count = ANY(coalesce(
                                               p_partitions, ARRAY[k.partition % p_count])))
                                  OVER (ORDER BY k.seq) AS ok
                    FROM {table} k
                    WHERE k.target = hd.target AND k.key = hd.key AND k.seq >= hd.seq
                      AND k.key IS NOT NULL
                      AND k.published_at IS NULL AND k.abandoned_at IS NULL
                    ORDER BY k.seq
                    LIMIT v_per_key) AS r
                WHERE hd.key IS NOT NULL AND (r.seq = hd.seq OR r.ok)
            ) AS x
            ORDER BY x.seq
            LIMIT v_room);
    END IF;

    RETURN QUERY
    UPDATE {table} o
    SET status = CASE WHEN o.status = 'processing' THEN 'pending'::{table}_status
                      ELSE 'processing'::{table}_status END,
        locked_by = CASE WHEN o.status = 'processing' THEN NULL ELSE p_worker END,
        lock_token = CASE WHEN o.status = 'processing' THEN NULL ELSE p_token END,
        locked_until = CASE WHEN o.status = 'processing' THEN NULL
                            ELSE clock_timestamp() + p_lease * interval '1 second' END
    WHERE o.seq = ANY (v_seqs)
      AND o.published_at IS NULL AND o.abandoned_at IS NULL
      AND CASE WHEN o.status = 'processing' THEN o.locked_until < now()
               ELSE o.available_at <= now() END
    RETURNING o.status = 'pending', o.seq, o.id, o.target, o.external, o.topic, o.key,
        o.partition % p_count, o.type, o.content_type, o.payload, o.headers::text,
        o.correlation_id, o.causation_id, o.tenant_id, o.aggregate_id, o.occurred_at,
        o.created_at, o.attempts;
END
$$;

-- The owned read: up to p_limit rows of the partitions a relay holds (p_partitions of
-- p_count, or all when NULL) and its targets, due, oldest first, that the relay may
-- publish now, in per-key order. Nothing is written, so nothing is locked or logged.
-- What the relay has in flight comes in as arguments: the seqs (p_busy), and the
-- [target, key] of each keyed one (p_busy_keys, a JSON array). Rows in flight are
-- left out, and so is every row of a key in flight: a key's rows in flight are its
-- earliest live rows, as keys are read in order from their head. A waiting row
-- (delayed, or backing off; waiting_ix) holds back what comes after it in its key.
-- A row in processing (claimed by a relay without partition leases) comes back with
-- `blocked` set while its lease lasts, so the caller holds back its key from there on
-- (relays of one table should not mix the two ways; this keeps order if they do).
-- The scan reads at most a window of 2 x p_limit live rows beyond those in flight and
-- stops as soon as it has p_limit; past a full window it takes key heads and their
-- runs as the claim above does. Rows come back in seq order.
-- Every plan here is good whatever the sizes, so generic plans serve and nothing is
-- planned per call: what is in flight is looked up in hashed NOT IN sets, and waiting
-- keys come from a small index as a jsonb object looked up per row.
CREATE OR REPLACE FUNCTION {prefix}_read(
    p_limit integer, p_partitions integer[], p_count integer, p_targets text[],
    p_busy bigint[], p_busy_keys jsonb)
RETURNS TABLE (
    seq bigint, id uuid, target text, external boolean, topic text,
    key text, partition integer, type text, content_type text, payload bytea,
    headers text, correlation_id text, causation_id text, tenant_id text,
    aggregate_id text, occurred_at timestamptz, created_at timestamptz, attempts integer,
    blocked boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_window integer := 2 * p_limit + coalesce(cardinality(p_busy), 0);
    v_wait jsonb;
    v_found bigint;
    v_seqs bigint[];
    v_seen integer;
    v_last bigint;
    v_room integer;
    v_heads bigint[];
    v_head_targets text[];
    v_head_keys text[];
    v_per_key integer;
BEGIN
    -- Keys that wait, with the seq from which they wait (NULL when none does).
    SELECT jsonb_object_agg(x.target || chr(31) || x.key, x.first) INTO v_wait
    FROM (
        SELECT b.target, b.key, min(b.seq) AS first FROM {table} b
        WHERE b.key IS NOT NULL AND b.published_at IS NULL AND b.abandoned_at IS NULL
          AND b.available_at > b.created_at AND b.available_at > now()
          AND (p_targets IS NULL OR b.target = ANY(p_targets))
        GROUP BY b.target, b.key
    ) AS x;

    RETURN QUERY
    SELECT w.seq, w.id, w.target, w.external, w.topic, w.key, w.partition % p_count,
        w.type, w.content_type, w.payload, w.headers::text, w.correlation_id,
        w.causation_id, w.tenant_id, w.aggregate_id, w.occurred_at, w.created_at,
        w.attempts, w.status = 'processing' AND w.locked_until >= now()
    FROM (
        SELECT o.* FROM {table} o
        WHERE o.published_at IS NULL AND o.abandoned_at IS NULL
          AND (p_partitions IS NULL OR o.partition % p_count = ANY(p_partitions))
          AND (p_targets IS NULL OR o.target = ANY(p_targets))
        ORDER BY o.seq
        LIMIT v_window) AS w
    WHERE (w.status = 'processing' OR w.available_at <= now())
      AND w.seq NOT IN (SELECT unnest(p_busy))
      AND (w.key IS NULL OR (w.target, w.key) NOT IN (
          SELECT k ->> 0, k ->> 1 FROM jsonb_array_elements(p_busy_keys) AS k))
      AND (v_wait IS NULL OR w.key IS NULL
           OR coalesce((v_wait ->> (w.target || chr(31) || w.key))::bigint > w.seq, true))
    ORDER BY w.seq
    LIMIT p_limit;
    GET DIAGNOSTICS v_found = ROW_COUNT;
    IF v_found < p_limit THEN
        SELECT count(*), max(w.seq) INTO v_seen, v_last FROM (
            SELECT o.seq FROM {table} o
            WHERE o.published_at IS NULL AND o.abandoned_at IS NULL
              AND (p_partitions IS NULL OR o.partition % p_count = ANY(p_partitions))
              AND (p_targets IS NULL OR o.target = ANY(p_targets))
            ORDER BY o.seq
            LIMIT v_window) AS w;
    END IF;

    IF v_seen = v_window AND v_found < p_limit THEN
        -- Past the window: heads that are due, neither in flight nor in processing, and
        -- keyless rows not in flight, oldest first; each head brings its run.
        v_room := p_limit - v_found;
        SELECT coalesce(array_agg(c.seq ORDER BY c.seq), '{}'),
               array_agg(c.target ORDER BY c.seq), array_agg(c.key ORDER BY c.seq)
        INTO v_heads, v_head_targets, v_head_keys
        FROM (
            SELECT o.seq, o.target, o.key FROM (
                WITH RECURSIVE heads AS (
                    (SELECT k.target, k.key, k.seq FROM {table} k
                     WHERE k.key IS NOT NULL
                       AND k.published_at IS NULL AND k.abandoned_at IS NULL
                     ORDER BY k.target, k.key, k.seq LIMIT 1)
                    UNION ALL
                    SELECT n.target, n.key, n.seq FROM heads p, LATERAL (
                        SELECT k.target, k.key, k.seq FROM {table} k
                        WHERE k.key IS NOT NULL
                          AND k.published_at IS NULL AND k.abandoned_at IS NULL
                          AND (k.target, k.key) > (p.target, p.key)
                        ORDER BY k.target, k.key, k.seq LIMIT 1) n
                )
                SELECT heads.seq FROM heads WHERE heads.seq > v_last
            ) AS head
            JOIN {table} o ON o.seq = head.seq
            WHERE (p_partitions IS NULL OR o.partition % p_count = ANY(p_partitions))
              AND (p_targets IS NULL OR o.target = ANY(p_targets))
              AND o.status <> 'processing' AND o.available_at <= now()
              AND o.seq NOT IN (SELECT unnest(p_busy))
            UNION ALL
            (SELECT o.seq, o.target, o.key FROM {table} o
             WHERE o.key IS NULL AND o.published_at IS NULL AND o.abandoned_at IS NULL
               AND o.seq > v_last
               AND (p_partitions IS NULL OR o.partition % p_count = ANY(p_partitions))
               AND (p_targets IS NULL OR o.target = ANY(p_targets))
               AND o.status <> 'processing' AND o.available_at <= now()
               AND o.seq NOT IN (SELECT unnest(p_busy))
             ORDER BY o.seq
             LIMIT v_room)
            ORDER BY 1
            LIMIT v_room
        ) AS c;
        v_per_key := (v_room + cardinality(v_heads) - 1) / greatest(cardinality(v_heads), 1);
        v_seqs := ARRAY(
            SELECT x.seq FROM (
                SELECT hd.seq FROM unnest(v_heads, v_head_keys) AS hd(seq, key)
                WHERE hd.key IS NULL
                UNION ALL
                SELECT r.seq
                FROM unnest(v_heads, v_head_targets, v_head_keys) AS hd(seq, target, key),
                LATERAL (
                    SELECT k.seq, bool_and(k.status <> 'processing'
                                           AND k.available_at <= now()
                                           AND k.partition % p_count = ANY(coalesce(
                                               p_partitions, ARRAY[k.partition % p_count])))
                                  OVER (ORDER BY k.seq) AS ok
                    FROM {table} k
                    WHERE k.target = hd.target AND k.key = hd.key AND k.seq >= hd.seq
                      AND k.key IS NOT NULL
                      AND k.published_at IS NULL AND k.abandoned_at IS NULL
                    ORDER BY k.seq
                    LIMIT v_per_key) AS r
                WHERE hd.key IS NOT NULL AND r.ok
            ) AS x
            ORDER BY x.seq
            LIMIT v_room);
        RETURN QUERY
        SELECT o.seq, o.id, o.target, o.external, o.topic, o.key, o.partition % p_count,
            o.type, o.content_type, o.payload, o.headers::text, o.correlation_id,
            o.causation_id, o.tenant_id, o.aggregate_id, o.occurred_at, o.created_at,
            o.attempts, false
        FROM unnest(v_seqs) AS x(seq) JOIN {table} o ON o.seq = x.seq
        ORDER BY o.seq;
    END IF;
END
$$;
