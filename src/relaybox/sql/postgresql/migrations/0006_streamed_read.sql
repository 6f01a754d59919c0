-- The owned read as one statement (queries.sql, `read`) instead of a call of {prefix}_read:
-- rows then stream to the relay as the scan finds them, where a PL/pgSQL function
-- stores its whole result first and sends it after. A batch of 500 came back in
-- 4.6-5.2 instead of 7.4 ms (docs/benchmarks.md, "Relay drain").
--
-- The statement reads the window itself; this function is the rest of 0005's read, run
-- only when the window gave fewer than p_limit rows: if the window was full (the
-- relay's in-flight rows and the keys they hold, or waiting keys, filled it), the heads
-- of keys and keyless rows past it, each head with its run, up to p_room rows, in seq
-- order; otherwise nothing. p_window is the window's size (2 x limit + rows in flight).
-- {prefix}_read stays, for relays of the previous version.
CREATE OR REPLACE FUNCTION {prefix}_read_past(
    p_room integer, p_partitions integer[], p_count integer, p_targets text[],
    p_busy bigint[], p_window integer)
RETURNS TABLE (
    seq bigint, id uuid, target text, external boolean, topic text,
    key text, partition integer, type text, content_type text, payload bytea,
    headers text, correlation_id text, causation_id text, tenant_id text,
    aggregate_id text, occurred_at timestamptz, attempts integer, blocked boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_seqs bigint[];
    v_seen integer;
    v_last bigint;
    v_heads bigint[];
    v_head_targets text[];
    v_head_keys text[];
    v_per_key integer;
BEGIN
    SELECT count(*), max(w.seq) INTO v_seen, v_last FROM (
        SELECT o.seq FROM {table} o
        WHERE o.published_at IS NULL AND o.abandoned_at IS NULL
          AND (p_partitions IS NULL OR o.partition % p_count = ANY(p_partitions))
          AND (p_targets IS NULL OR o.target = ANY(p_targets))
        ORDER BY o.seq
        LIMIT p_window) AS w;
    IF v_seen < p_window OR p_room < 1 THEN
        RETURN;  -- the window held every live row: nothing lies past it
    END IF;
    -- Past the window: heads that are due, neither in flight nor in processing, and
    -- keyless rows not in flight, oldest first; each head brings its run.
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
         LIMIT p_room)
        ORDER BY 1
        LIMIT p_room
    ) AS c;
    v_per_key := (p_room + cardinality(v_heads) - 1) / greatest(cardinality(v_heads), 1);
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
        LIMIT p_room);
    RETURN QUERY
    SELECT o.seq, o.id, o.target, o.external, o.topic, o.key, o.partition % p_count,
        o.type, o.content_type, o.payload, o.headers::text, o.correlation_id,
        o.causation_id, o.tenant_id, o.aggregate_id, o.occurred_at,
        o.attempts, false
    FROM unnest(v_seqs) AS x(seq) JOIN {table} o ON o.seq = x.seq
    ORDER BY o.seq;
END
$$;
