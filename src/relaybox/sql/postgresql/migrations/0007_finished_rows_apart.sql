-- Finished rows apart: {table} keeps live rows only (pending, processing, failed), and
-- rows that are finished but kept a while (published, under a published retention;
-- abandoned, until the abandoned retention) move to {table}_done in the statement that
-- finishes them (queries.sql: settle_owned, mark_published, abandon; replay moves one
-- back). Then every row of {table} is live, so the primary key is the claim's and the
-- read's ordered walk, and the writer's INSERT no longer enters {prefix}_live_ix nor
-- tests the two retention indexes' predicates: those go, with the live test in the
-- predicates of the indexes that stay. A writer transaction's throughput rose about
-- 2 points with it (docs/benchmarks.md, "Writer overhead").
--
-- The statements and functions that read {table} no longer test `published_at IS NULL
-- AND abandoned_at IS NULL`: it is always true there, and a planner without statistics
-- on the table (a new one, before its first ANALYZE) takes it for 1 row in 40,000,
-- and then reads the whole table and sorts it rather than walk the primary key (a read
-- of 500 rows of 20,000: 11.2 against 1.6 ms). The claim and {prefix}_read_past are
-- restated below without it; {prefix}_read keeps it, for relays older than 0006.
--
-- On a big outbox run this at a quiet time: it rebuilds the indexes on target and key,
-- and moves every finished row, holding writers back meanwhile.

-- target and key compare byte by byte: an index on them then costs a memcmp per step
-- instead of the database's collation (a libc or ICU call), and their order was never
-- more than a grouping. Changing a column's collation rebuilds its indexes, not the
-- table.
DO $$
BEGIN
    IF (SELECT c.collname FROM pg_attribute a JOIN pg_collation c ON c.oid = a.attcollation
        WHERE a.attrelid = '{table}'::regclass AND a.attname = 'key') IS DISTINCT FROM 'C'
    THEN
        ALTER TABLE {table}
            ALTER COLUMN target TYPE text COLLATE "C",
            ALTER COLUMN key TYPE text COLLATE "C";
    END IF;
END
$$;

CREATE TABLE IF NOT EXISTS {table}_done (
    LIKE {table} INCLUDING DEFAULTS,
    PRIMARY KEY (seq)
);

-- Retention purges, on the finished rows only.
CREATE INDEX IF NOT EXISTS {prefix}_published_done_ix ON {table}_done (published_at)
    WHERE published_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS {prefix}_abandoned_done_ix ON {table}_done (abandoned_at)
    WHERE abandoned_at IS NOT NULL;

-- Relays of earlier versions finish rows in place, with an UPDATE that sets published_at
-- or abandoned_at: this moves such a row to {table}_done as it is finished, so relays
-- of both versions may run side by side during an upgrade. relaybox's own statements
-- move rows themselves and never set those columns on {table}. The row goes over
-- column by column in order: {table}_done was made LIKE {table}, and a migration that
-- adds a column to one must add it to the other.
CREATE OR REPLACE FUNCTION {prefix}_finished() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM {table} WHERE seq = NEW.seq;
    INSERT INTO {table}_done SELECT NEW.*;
    RETURN NULL;
END
$$;

-- Created once, never dropped and made again: with this script run outside a
-- transaction, an in-place finish in between would stay in {table}.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = '{table}'::regclass
                   AND tgname = left('{prefix}_finished', 63)) THEN
        CREATE TRIGGER {prefix}_finished
            AFTER UPDATE OF published_at, abandoned_at ON {table}
            FOR EACH ROW WHEN (NEW.published_at IS NOT NULL OR NEW.abandoned_at IS NOT NULL)
            EXECUTE FUNCTION {prefix}_finished();
    END IF;
END
$$;

-- The rows finished so far.
WITH finished AS (
    DELETE FROM {table} WHERE published_at IS NOT NULL OR abandoned_at IS NOT NULL
    RETURNING *
)
INSERT INTO {table}_done SELECT * FROM finished;

-- The indexes that go, by their name in the table's schema (an index lives in its
-- table's schema, which need not be on the search path), before the ones that take
-- their place are made: a long table name truncates index names to 63 characters,
-- where an old and a new name could meet.
DO $$
DECLARE
    v_schema text := (SELECT n.nspname FROM pg_class c
                      JOIN pg_namespace n ON n.oid = c.relnamespace
                      WHERE c.oid = '{table}'::regclass);
    v_name text;
BEGIN
    FOREACH v_name IN ARRAY ARRAY['live_ix', 'published_ix', 'abandoned_ix', 'key_ix',
                                  'keyless_ix', 'waiting_ix'] LOOP
        EXECUTE format('DROP INDEX IF EXISTS %I.%I', v_schema,
                       left('{prefix}_' || v_name, 63));
    END LOOP;
END
$$;

-- The indexes that stay, without the live test. Per-key order: "is there an earlier
-- row of this (target, key)?", and the heads of keys past a read's window.
CREATE INDEX IF NOT EXISTS {prefix}_keyed_ix ON {table} (target, key, seq)
    WHERE key IS NOT NULL;

-- Keyless rows in seq order, found past a blocked window.
CREATE INDEX IF NOT EXISTS {prefix}_unkeyed_ix ON {table} (seq)
    WHERE key IS NULL;

-- Rows that wait (a delay, or the backoff after a failed attempt) and so may hold their
-- key back; a row written without a delay never enters it.
CREATE INDEX IF NOT EXISTS {prefix}_waits_ix ON {table} (target, key, seq)
    WHERE key IS NOT NULL AND available_at > created_at;

-- The per-row claim (0005) and the read past a full window (0006), as they were but for
-- the live test.
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
            WHERE (p_partitions IS NULL OR o.partition % p_count = ANY(p_partitions))
              AND (p_targets IS NULL OR o.target = ANY(p_targets))
            ORDER BY o.seq
            LIMIT v_window) AS w
        WHERE CASE WHEN w.status = 'processing' THEN w.locked_until < now()
                   ELSE w.available_at <= now() END
          AND (w.key IS NULL OR w.status = 'processing' OR NOT EXISTS (
              SELECT 1 FROM {table} h
              WHERE h.target = w.target AND h.key = w.key AND h.seq < w.seq
                AND h.key IS NOT NULL
                AND (h.status = 'processing' OR h.available_at > now()
                     OR NOT (h.partition % p_count
                             = ANY(coalesce(p_partitions, ARRAY[h.partition % p_count]))))))
        ORDER BY w.seq
        LIMIT p_limit);
    IF cardinality(v_seqs) < p_limit THEN
        SELECT count(*), max(w.seq) INTO v_seen, v_last FROM (
            SELECT o.seq FROM {table} o
            WHERE (p_partitions IS NULL OR o.partition % p_count = ANY(p_partitions))
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
                     ORDER BY k.target, k.key, k.seq LIMIT 1)
                    UNION ALL
                    SELECT n.target, n.key, n.seq FROM heads p, LATERAL (
                        SELECT k.target, k.key, k.seq FROM {table} k
                        WHERE k.key IS NOT NULL
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
             WHERE o.key IS NULL
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
      AND CASE WHEN o.status = 'processing' THEN o.locked_until < now()
               ELSE o.available_at <= now() END
    RETURNING o.status = 'pending', o.seq, o.id, o.target, o.external, o.topic, o.key,
        o.partition % p_count, o.type, o.content_type, o.payload, o.headers::text,
        o.correlation_id, o.causation_id, o.tenant_id, o.aggregate_id, o.occurred_at,
        o.created_at, o.attempts;
END
$$;

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
        WHERE (p_partitions IS NULL OR o.partition % p_count = ANY(p_partitions))
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
                 ORDER BY k.target, k.key, k.seq LIMIT 1)
                UNION ALL
                SELECT n.target, n.key, n.seq FROM heads p, LATERAL (
                    SELECT k.target, k.key, k.seq FROM {table} k
                    WHERE k.key IS NOT NULL
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
         WHERE o.key IS NULL
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
