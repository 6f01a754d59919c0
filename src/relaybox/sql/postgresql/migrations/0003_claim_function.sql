-- The claim, as one round trip. Claims of one partition take turns: a claim first takes
-- transaction-scoped advisory locks (two-int key space, apart from the writers' bigint
-- key locks): ($3 table key, -1) shared and ($3, p) per partition in order, or (key, -1)
-- exclusive for a claim over every partition. Then, in a statement of its own (so its
-- snapshot is taken after the locks), it walks live rows in seq order and takes those
-- that are due and have no earlier live row of their (target, key) in processing or not
-- due; rows behind such a head are skipped inside the scan, so one key's blocked
-- backlog never uses up the limit. As no other claim runs on these rows at once, and
-- marks, renewals and releases only touch rows in processing (which a claim never
-- takes), an earlier live row of a taken row is always taken too: no SKIP LOCKED, no
-- row locks written before the update, no second pass. A row whose lease ran out is
-- handed back to pending (expired = true, not claimed) and blocks its key in this
-- call; the caller claims again, which takes it and what waited behind it, in order.
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
BEGIN
    IF p_partitions IS NULL THEN
        PERFORM pg_advisory_xact_lock(p_lock_key, -1);
    ELSE
        PERFORM pg_advisory_xact_lock_shared(p_lock_key, -1);
        PERFORM pg_advisory_xact_lock(p_lock_key, ordered.p)
        FROM (SELECT DISTINCT unnest(p_partitions) AS p ORDER BY 1) AS ordered;
    END IF;
    RETURN QUERY
    WITH candidates AS MATERIALIZED (
        SELECT o.seq FROM {table} o
        WHERE o.published_at IS NULL AND o.abandoned_at IS NULL
          AND CASE WHEN o.status = 'processing' THEN o.locked_until < now()
                   ELSE o.available_at <= now() END
          AND (p_partitions IS NULL OR o.partition = ANY(p_partitions))
          AND (p_targets IS NULL OR o.target = ANY(p_targets))
          AND (o.key IS NULL OR o.status = 'processing' OR NOT EXISTS (
              SELECT 1 FROM {table} h
              WHERE h.target = o.target AND h.key = o.key AND h.seq < o.seq
                AND h.key IS NOT NULL AND h.published_at IS NULL AND h.abandoned_at IS NULL
                AND (h.status = 'processing' OR h.available_at > now()
                     -- an earlier row outside this claim's partitions (written under
                     -- another partition count) is not ours to take: it blocks too
                     OR NOT (h.partition = ANY(coalesce(p_partitions, ARRAY[h.partition]))))))
        ORDER BY o.seq
        LIMIT p_limit
    )
    -- A row in processing here has an expired lease: it goes back to pending. The
    -- candidates come as one array, so the update finds them by primary key even when
    -- the planner has no statistics yet (a join was once planned as a nested loop over
    -- every live row: 60-120 ms for 50 rows of 1,000).
    UPDATE {table} o
    SET status = CASE WHEN o.status = 'processing' THEN 'pending' ELSE 'processing' END,
        locked_by = CASE WHEN o.status = 'processing' THEN NULL ELSE p_worker END,
        lock_token = CASE WHEN o.status = 'processing' THEN NULL ELSE p_token END,
        -- The clock, not now(): the transaction began before the lock waits.
        locked_until = CASE WHEN o.status = 'processing' THEN NULL
                            ELSE clock_timestamp() + p_lease * interval '1 second' END
    -- Rechecked if the row changed since the scan (a late mark of an expired lease).
    WHERE o.seq = ANY (ARRAY(SELECT c.seq FROM candidates c))
      AND o.published_at IS NULL AND o.abandoned_at IS NULL
      AND CASE WHEN o.status = 'processing' THEN o.locked_until < now()
               ELSE o.available_at <= now() END
    RETURNING o.status = 'pending', o.seq, o.id, o.target, o.external, o.topic, o.key,
        o.partition, o.type, o.content_type, o.payload, o.headers::text,
        o.correlation_id, o.causation_id, o.tenant_id, o.aggregate_id, o.occurred_at,
        o.created_at, o.attempts;
END
$$;
