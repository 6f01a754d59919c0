-- The claim, bounded (replaces 0003's function; same signature, same locks).
-- 0003 walked live rows in seq order until it had p_limit rows. When every key's head
-- was in flight or waiting out a backoff, the rows behind those heads were all blocked
-- and the walk went through the whole backlog to find nothing: 0.5 s per claim at
-- 200k rows, seconds at 1M, measured (docs/benchmarks.md).
-- Now the walk looks at a window of the first 4 x p_limit live rows only. When the
-- window is full and yields fewer than p_limit rows, what lies beyond it is found
-- without reading the blocked rows: the head of every key with a live row (one index
-- probe per key, a loose scan of {prefix}_key_ix), and keyless rows through an index
-- of their own. A head that may be taken brings the run of its key behind it (rows
-- due, not in processing, in this claim's partitions, up to the first that is not);
-- the room left is shared evenly between the heads (rounded up: the oldest win).
-- Heads and keyless rows are never blocked, and a run is a key's rows in order from
-- its head: order holds.
-- Cost: the window, plus one probe per key with a live row when the window is
-- blocked, plus the rows taken; not one per blocked row. (Rows of other partitions
-- or of targets left out of the claim are still read and passed over in the window.)
-- Building the keyless index reads the whole table once and holds writers back
-- meanwhile; an outbox is small when drained, but on a big one run this migration
-- at a quiet time (or create the index CONCURRENTLY first: IF NOT EXISTS skips it).

-- Keyless live rows in seq order, so the claim finds them past a blocked window.
CREATE INDEX IF NOT EXISTS {prefix}_keyless_ix ON {table} (seq)
    WHERE key IS NULL AND published_at IS NULL AND abandoned_at IS NULL;

CREATE OR REPLACE FUNCTION {prefix}_claim(
    p_worker text, p_limit integer, p_partitions integer[], p_targets text[],
    p_token uuid, p_lease float8, p_lock_key integer)
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
    -- The window, in a statement of its own (so its snapshot is taken after the locks):
    -- rows that are due (or whose lease ran out) and have no earlier live row of their
    -- (target, key) in processing, not due, or outside this claim's partitions. The scan
    -- stops as soon as it has p_limit rows; it reads at most v_window rows.
    v_seqs := ARRAY(
        SELECT w.seq FROM (
            SELECT o.seq, o.target, o.key, o.status, o.locked_until, o.available_at
            FROM {table} o
            WHERE o.published_at IS NULL AND o.abandoned_at IS NULL
              AND (p_partitions IS NULL OR o.partition = ANY(p_partitions))
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
                     -- an earlier row outside this claim's partitions (written under
                     -- another partition count) is not ours to take: it blocks too
                     OR NOT (h.partition = ANY(coalesce(p_partitions, ARRAY[h.partition]))))))
        ORDER BY w.seq
        LIMIT p_limit);
    IF cardinality(v_seqs) < p_limit THEN
        -- Short: was the window full? (Only then can there be more past it.)
        SELECT count(*), max(w.seq) INTO v_seen, v_last FROM (
            SELECT o.seq FROM {table} o
            WHERE o.published_at IS NULL AND o.abandoned_at IS NULL
              AND (p_partitions IS NULL OR o.partition = ANY(p_partitions))
              AND (p_targets IS NULL OR o.target = ANY(p_targets))
            ORDER BY o.seq
            LIMIT v_window) AS w;
    END IF;

    IF v_seen = v_window AND cardinality(v_seqs) < p_limit THEN
        -- Past the window: the key heads that may be taken (a loose index scan, one
        -- probe per key) and keyless rows, oldest first, as many as there is room for.
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
            WHERE (p_partitions IS NULL OR o.partition = ANY(p_partitions))
              AND (p_targets IS NULL OR o.target = ANY(p_targets))
              AND CASE WHEN o.status = 'processing' THEN o.locked_until < now()
                       ELSE o.available_at <= now() END
            UNION ALL
            (SELECT o.seq, o.target, o.key FROM {table} o
             WHERE o.key IS NULL AND o.published_at IS NULL AND o.abandoned_at IS NULL
               AND o.seq > v_last
               AND (p_partitions IS NULL OR o.partition = ANY(p_partitions))
               AND (p_targets IS NULL OR o.target = ANY(p_targets))
               AND CASE WHEN o.status = 'processing' THEN o.locked_until < now()
                        ELSE o.available_at <= now() END
             ORDER BY o.seq
             LIMIT v_room)
            ORDER BY 1
            LIMIT v_room
        ) AS c;
        -- Each head brings its run: the key's rows from the head on, while each is
        -- due, not in processing and in this claim's partitions (a head whose lease
        -- ran out goes back alone), up to an even share of the room.
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
                                           AND k.partition = ANY(coalesce(
                                               p_partitions, ARRAY[k.partition])))
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

    -- A row in processing here has an expired lease: it goes back to pending. The
    -- candidates come as one array, so the update finds them by primary key even when
    -- the planner has no statistics yet (a join was once planned as a nested loop over
    -- every live row: 60-120 ms for 50 rows of 1,000).
    RETURN QUERY
    UPDATE {table} o
    SET status = CASE WHEN o.status = 'processing' THEN 'pending' ELSE 'processing' END,
        locked_by = CASE WHEN o.status = 'processing' THEN NULL ELSE p_worker END,
        lock_token = CASE WHEN o.status = 'processing' THEN NULL ELSE p_token END,
        -- The clock, not now(): the transaction began before the lock waits.
        locked_until = CASE WHEN o.status = 'processing' THEN NULL
                            ELSE clock_timestamp() + p_lease * interval '1 second' END
    -- Rechecked if the row changed since the scan (a late mark of an expired lease).
    WHERE o.seq = ANY (v_seqs)
      AND o.published_at IS NULL AND o.abandoned_at IS NULL
      AND CASE WHEN o.status = 'processing' THEN o.locked_until < now()
               ELSE o.available_at <= now() END
    RETURNING o.status = 'pending', o.seq, o.id, o.target, o.external, o.topic, o.key,
        o.partition, o.type, o.content_type, o.payload, o.headers::text,
        o.correlation_id, o.causation_id, o.tenant_id, o.aggregate_id, o.occurred_at,
        o.created_at, o.attempts;
END
$$;
