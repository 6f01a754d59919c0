-- Migration 0001: relaybox's outbox on PostgreSQL, its first schema (schema.sql is the
-- whole current schema; tests/migration holds the two to each other).

-- The status of a row. An enum rather than a CHECK constraint: PostgreSQL re-reads a
-- table's CHECK expressions for every INSERT statement, which is a cost on every writer
-- transaction; an enum column checks its values for nothing.
DO $$
BEGIN
    CREATE TYPE {table}_status AS ENUM (
        'pending', 'processing', 'published', 'failed', 'abandoned');
EXCEPTION WHEN duplicate_object THEN NULL;
END
$$;

-- The live rows: one per (message, target) that is pending, processing or failed.
-- Rows that finish move to {table}_done in the statement that finishes them (or are
-- deleted), so every row here is live, the primary key is the relay's ordered walk, and
-- a writer's INSERT enters no index about finishing.
-- A row-lease claim updates no indexed column and pages keep half their room free
-- (fillfactor 50), so a claim is a heap-only update that writes no index entry.
-- Mutable columns come first, so an UPDATE's WAL record shares a long suffix with the
-- old tuple (PostgreSQL logs only the changed middle). target and key compare byte by
-- byte (COLLATE "C"): an index step is then a memcmp, not a collation call, and their
-- order never meant more than grouping.
CREATE TABLE IF NOT EXISTS {table} (
    seq            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    status         {table}_status NOT NULL DEFAULT 'pending',
    attempts       integer NOT NULL DEFAULT 0,
    available_at   timestamptz NOT NULL DEFAULT now(),
    locked_by      text,
    locked_until   timestamptz,
    lock_token     uuid,
    published_at   timestamptz,
    abandoned_at   timestamptz,
    last_error     text,
    id             uuid NOT NULL,
    target         text COLLATE "C" NOT NULL,
    external       boolean NOT NULL DEFAULT false,
    topic          text NOT NULL,
    key            text COLLATE "C",
    partition      integer NOT NULL,
    type           text NOT NULL,
    content_type   text NOT NULL,
    payload        bytea NOT NULL,
    headers        jsonb NOT NULL DEFAULT '{}',
    correlation_id text,
    causation_id   text,
    tenant_id      text,
    aggregate_id   text,
    occurred_at    timestamptz NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now()
) WITH (fillfactor = 50);

-- Per-key order: "is there an earlier row of this (target, key)?", and the heads of
-- keys past a read's window (a loose scan, one probe per key).
CREATE INDEX IF NOT EXISTS {prefix}_keyed_ix ON {table} (target, key, seq)
    WHERE key IS NOT NULL;

-- Keyless rows in seq order, found past a window that keyed rows blocked.
CREATE INDEX IF NOT EXISTS {prefix}_unkeyed_ix ON {table} (seq)
    WHERE key IS NULL;

-- Rows that wait (a delay, or the backoff after a failed attempt) and so may hold their
-- key back: a read learns which keys wait from this index alone. A row written without
-- a delay never enters it; a writer only evaluates the predicate.
CREATE INDEX IF NOT EXISTS {prefix}_waits_ix ON {table} (target, key, seq)
    WHERE key IS NOT NULL AND available_at > created_at;

-- Finished rows kept a while: published ones under a published retention, abandoned ones
-- until the abandoned retention ends (operators list and replay them from here). The
-- same columns as {table}; seq is the row's own, not drawn again.
CREATE TABLE IF NOT EXISTS {table}_done (
    LIKE {table} INCLUDING DEFAULTS,
    PRIMARY KEY (seq)
);

-- Retention purges.
CREATE INDEX IF NOT EXISTS {prefix}_published_done_ix ON {table}_done (published_at)
    WHERE published_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS {prefix}_abandoned_done_ix ON {table}_done (abandoned_at)
    WHERE abandoned_at IS NOT NULL;

-- Partition leases, per target: which relay processes are alive and which targets each
-- serves, and which of them owns each partition of a target's keys, until when. Each
-- target's partitions are shared among the relays that serve it, so relays serving
-- different targets (a rolling deploy that adds one) never strand each other's rows.
-- Every heartbeat renews both (queries.sql).
CREATE TABLE IF NOT EXISTS {table}_members (
    worker      text NOT NULL,
    target      text COLLATE "C" NOT NULL,
    lease_until timestamptz NOT NULL,
    joined_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (worker, target)
);

CREATE TABLE IF NOT EXISTS {table}_partitions (
    target      text COLLATE "C" NOT NULL,
    partition   integer NOT NULL,
    owner       text,
    lease_until timestamptz,
    PRIMARY KEY (target, partition),
    CONSTRAINT {prefix}_partitions_lease_ck CHECK ((owner IS NULL) = (lease_until IS NULL))
);

-- The functions below find rows of {table} by seq with `o.seq = ANY(array)` (the seqs
-- a step chose), never by a join to them: with the outbox table as a statement's only
-- relation, its plan is a walk of the primary key whatever the planner believes of the
-- table's size, where a join leaves it free to scan the whole table on one side (the
-- plan it makes while the table is empty or never analyzed, kept as it grows).

-- The byte budget of a claim or read, on rows already chosen (p_seqs, with their
-- payload sizes p_sizes, in any order): the seqs, in seq order, whose payloads together
-- stay within p_max_bytes, and, if p_alone, a first payload larger on its own, alone.
-- The functions below call it only when the rows' total is over the budget, and find
-- the sizes as they choose the rows (octet_length reads a payload's length, not the
-- payload), so a batch within the budget costs no second look at its rows.
CREATE OR REPLACE FUNCTION {table}_within(
    p_seqs bigint[], p_sizes integer[], p_max_bytes bigint, p_alone boolean)
RETURNS bigint[]
LANGUAGE sql IMMUTABLE AS $$
    SELECT ARRAY(
        SELECT c.seq FROM (
            SELECT x.seq, x.size, sum(x.size) OVER (ORDER BY x.seq) AS through
            FROM unnest(p_seqs, p_sizes) AS x(seq, size)) AS c
        WHERE c.through <= p_max_bytes OR (p_alone AND c.through = c.size)
        ORDER BY c.seq)
$$;

-- The row-lease claim, for relays run without partition leases, in one round trip.
-- Claims of one partition take turns: a claim first takes transaction-scoped advisory
-- locks (the two-int key space, apart from the writers' bigint key locks): (p_lock_key,
-- -1) shared and (p_lock_key, p) per partition in order, or (p_lock_key, -1) exclusive
-- for a claim over every partition. As no other claim runs on these rows at once, and
-- marks, renewals and releases only touch rows in processing (which a claim never
-- takes), an earlier live row of a taken row is always taken too: no SKIP LOCKED and
-- no row locks before the update.
-- It walks a window of the first 4 x p_limit rows of its partitions and targets in seq
-- order and takes those that are due and have no earlier row of their (target, key) in
-- processing, not due, or outside this claim's partitions. When the window is full and
-- yields fewer than p_limit rows (every key's head in flight or waiting), what lies past
-- it is found without reading the blocked rows: the head of every key (a loose scan of
-- {prefix}_keyed_ix, one probe per key) and keyless rows ({prefix}_unkeyed_ix). A head
-- that may be taken brings the run of its key behind it, up to the first row that may
-- not; the room left is shared evenly between the heads (rounded up: the oldest win).
-- Heads and keyless rows are never blocked and a run is a key's rows in order from its
-- head, so order holds; the cost is the window plus one probe per key, not one per
-- blocked row.
-- A row whose lease ran out goes back to pending (expired = true, not claimed) and
-- blocks its key in this call; the caller claims again, which takes it and what waited
-- behind it, in order. A row's partition is its stored key hash modulo p_count.
-- Last, the byte budget: the rows chosen go in seq order while their payloads together
-- stay within p_max_bytes, and, if p_alone, a first payload larger on its own goes
-- alone. Cutting the tail of a seq-ordered choice leaves every key's taken rows a run
-- from its head, so order holds. The rows bring their payload sizes along, and are
-- cut ({table}_within) only when their total is over the budget; rows found past the
-- window, within what the window's rows left of it.
CREATE OR REPLACE FUNCTION {table}_claim(
    p_worker text, p_limit integer, p_partitions integer[], p_count integer,
    p_targets text[], p_token uuid, p_lease float8, p_lock_key integer,
    p_max_bytes bigint, p_alone boolean)
RETURNS TABLE (
    expired boolean, seq bigint, id uuid, target text, external boolean, topic text,
    key text, partition integer, type text, content_type text, payload bytea,
    headers text, correlation_id text, causation_id text, tenant_id text,
    aggregate_id text, occurred_at timestamptz, attempts integer)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_window integer := 4 * p_limit;
    v_seqs bigint[];
    v_sizes integer[];
    v_bytes bigint;
    v_found integer;
    v_seen integer;
    v_last bigint;
    v_room integer;
    v_heads bigint[];
    v_head_targets text[];
    v_head_keys text[];
    v_head_sizes integer[];
    v_per_key integer;
    v_more bigint[];
    v_more_sizes integer[];
    v_more_bytes bigint;
BEGIN
    IF p_partitions IS NULL THEN
        PERFORM pg_advisory_xact_lock(p_lock_key, -1);
    ELSE
        PERFORM pg_advisory_xact_lock_shared(p_lock_key, -1);
        PERFORM pg_advisory_xact_lock(p_lock_key, ordered.p)
        FROM (SELECT DISTINCT unnest(p_partitions) AS p ORDER BY 1) AS ordered;
    END IF;
    SELECT coalesce(array_agg(f.seq), '{}'), coalesce(array_agg(f.size), '{}'),
        coalesce(sum(f.size), 0), count(*)
    INTO v_seqs, v_sizes, v_bytes, v_found
    FROM (
        SELECT w.seq, octet_length(w.payload) AS size FROM (
            SELECT o.seq, o.target, o.key, o.status, o.locked_until, o.available_at,
                o.payload
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
        LIMIT p_limit) AS f;
    IF v_bytes > p_max_bytes THEN
        v_seqs := {table}_within(v_seqs, v_sizes, p_max_bytes, p_alone);
    END IF;
    IF v_found < p_limit THEN
        SELECT count(*), max(w.seq) INTO v_seen, v_last FROM (
            SELECT o.seq FROM {table} o
            WHERE (p_partitions IS NULL OR o.partition % p_count = ANY(p_partitions))
              AND (p_targets IS NULL OR o.target = ANY(p_targets))
            ORDER BY o.seq
            LIMIT v_window) AS w;
    END IF;

    IF v_seen = v_window AND v_found < p_limit AND v_bytes < p_max_bytes THEN
        v_room := p_limit - v_found;
        SELECT coalesce(array_agg(c.seq ORDER BY c.seq), '{}'),
               array_agg(c.target ORDER BY c.seq), array_agg(c.key ORDER BY c.seq),
               array_agg(c.size ORDER BY c.seq)
        INTO v_heads, v_head_targets, v_head_keys, v_head_sizes
        FROM (
            SELECT o.seq, o.target, o.key, octet_length(o.payload) AS size
            FROM {table} o
            WHERE o.seq = ANY(ARRAY(
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
                SELECT heads.seq FROM heads WHERE heads.seq > v_last))
              AND (p_partitions IS NULL OR o.partition % p_count = ANY(p_partitions))
              AND (p_targets IS NULL OR o.target = ANY(p_targets))
              AND CASE WHEN o.status = 'processing' THEN o.locked_until < now()
                       ELSE o.available_at <= now() END
            UNION ALL
            (SELECT o.seq, o.target, o.key, octet_length(o.payload) FROM {table} o
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
        SELECT coalesce(array_agg(y.seq), '{}'), coalesce(array_agg(y.size), '{}'),
            coalesce(sum(y.size), 0)
        INTO v_more, v_more_sizes, v_more_bytes
        FROM (
            SELECT x.seq, x.size FROM (
                SELECT hd.seq, hd.size
                FROM unnest(v_heads, v_head_keys, v_head_sizes) AS hd(seq, key, size)
                WHERE hd.key IS NULL
                UNION ALL
                SELECT r.seq, r.size
                FROM unnest(v_heads, v_head_targets, v_head_keys) AS hd(seq, target, key),
                LATERAL (
                    SELECT k.seq, octet_length(k.payload) AS size,
                        bool_and(k.status <> 'processing'
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
            LIMIT v_room) AS y;
        IF v_bytes + v_more_bytes > p_max_bytes THEN
            v_more := {table}_within(v_more, v_more_sizes, p_max_bytes - v_bytes,
                                      p_alone AND v_bytes = 0);
        END IF;
        v_seqs := v_seqs || v_more;
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
        o.attempts;
END
$$;

-- The owned read's second half. A relay that holds partitions reads them with one
-- statement (queries.sql, `read`) over a window of its due rows; when the window gives
-- fewer than p_limit rows and was full (the relay's in-flight rows and the keys they
-- hold, or waiting keys, filled it), this finds the rows past it as the claim above
-- does: the heads of keys and keyless rows past the window, each head with its run
-- (which stops before a row in flight: a relay that reads behind rows in flight may
-- have handed back a key's head while later rows of it are still out), up to p_room
-- rows, in seq order. p_window is the window's size (2 x limit + rows in flight).
-- Last, the byte budget, as the claim above cuts its rows past the window (p_max_bytes,
-- p_alone). It writes nothing, and is STABLE so that its queries see the snapshot of
-- the read that calls it: a volatile function takes a new one for each, and a row
-- committed meanwhile below the window's end (a late commit) would shorten the window
-- it finds here, so that it returned again rows the read had already taken.
CREATE OR REPLACE FUNCTION {table}_read_past(
    p_room integer, p_partitions integer[], p_count integer, p_targets text[],
    p_busy bigint[], p_window integer, p_max_bytes bigint, p_alone boolean)
RETURNS TABLE (
    seq bigint, id uuid, target text, external boolean, topic text,
    key text, partition integer, type text, content_type text, payload bytea,
    headers text, correlation_id text, causation_id text, tenant_id text,
    aggregate_id text, occurred_at timestamptz, attempts integer, blocked boolean)
LANGUAGE plpgsql STABLE AS $$
#variable_conflict use_column
DECLARE
    v_seqs bigint[];
    v_sizes integer[];
    v_bytes bigint;
    v_seen integer;
    v_last bigint;
    v_heads bigint[];
    v_head_targets text[];
    v_head_keys text[];
    v_head_sizes integer[];
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
           array_agg(c.target ORDER BY c.seq), array_agg(c.key ORDER BY c.seq),
           array_agg(c.size ORDER BY c.seq)
    INTO v_heads, v_head_targets, v_head_keys, v_head_sizes
    FROM (
        SELECT o.seq, o.target, o.key, octet_length(o.payload) AS size
        FROM {table} o
        WHERE o.seq = ANY(ARRAY(
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
            SELECT heads.seq FROM heads WHERE heads.seq > v_last))
          AND (p_partitions IS NULL OR o.partition % p_count = ANY(p_partitions))
          AND (p_targets IS NULL OR o.target = ANY(p_targets))
          AND o.status <> 'processing' AND o.available_at <= now()
          AND o.seq NOT IN (SELECT unnest(p_busy))
        UNION ALL
        (SELECT o.seq, o.target, o.key, octet_length(o.payload) FROM {table} o
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
    SELECT coalesce(array_agg(y.seq), '{}'), coalesce(array_agg(y.size), '{}'),
        coalesce(sum(y.size), 0)
    INTO v_seqs, v_sizes, v_bytes
    FROM (
        SELECT x.seq, x.size FROM (
            SELECT hd.seq, hd.size
            FROM unnest(v_heads, v_head_keys, v_head_sizes) AS hd(seq, key, size)
            WHERE hd.key IS NULL
            UNION ALL
            SELECT r.seq, r.size
            FROM unnest(v_heads, v_head_targets, v_head_keys) AS hd(seq, target, key),
            LATERAL (
                SELECT k.seq, octet_length(k.payload) AS size,
                    bool_and(k.status <> 'processing'
                             AND k.available_at <= now()
                             AND NOT k.seq = ANY(p_busy)
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
        LIMIT p_room) AS y;
    IF v_bytes > p_max_bytes THEN
        v_seqs := {table}_within(v_seqs, v_sizes, p_max_bytes, p_alone);
    END IF;
    RETURN QUERY
    SELECT o.seq, o.id, o.target, o.external, o.topic, o.key, o.partition % p_count,
        o.type, o.content_type, o.payload, o.headers::text, o.correlation_id,
        o.causation_id, o.tenant_id, o.aggregate_id, o.occurred_at,
        o.attempts, false
    FROM {table} o
    WHERE o.seq = ANY(v_seqs)
    ORDER BY o.seq;
END
$$;

-- A relay's partition-lease heartbeat of one target, in one statement: the steps below
-- run in this order, in the statement's own transaction. Dead members go before the
-- worker joins, so two heartbeats lock member rows in one order and cannot deadlock on
-- them. The target's partitions are created once: the insert finds nothing to add once
-- the rows exist, and one that another heartbeat adds at the same time is skipped. Then
-- every partition of p_target that p_worker holds is renewed for p_lease seconds, and
-- if fewer of them than its fair share are below p_count (p_count: how many partitions
-- the relay counts; the share is p_count over the live relays, rounded up, as
-- core.partitions.fair_share counts it), free or expired ones are taken up to the
-- share, lowest first; SKIP LOCKED passes over rows another heartbeat is renewing or
-- taking. A fresh relay thus holds its share after this one round trip.
-- It returns how many live relays serve p_target, the targets some live relay serves,
-- and the partitions held: renewed and taken. From these the relay works out which
-- partitions to give back (rebalance, in Python): in a steady state none, and the
-- heartbeat is this one round trip; otherwise queries.sql's partitions_release follows
-- in a transaction of its own (the storage's `heartbeat` says why that is safe).
CREATE OR REPLACE FUNCTION {table}_heartbeat(
    p_worker text, p_lease float8, p_target text, p_count integer)
RETURNS TABLE (live integer, served text[], held integer[])
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_live integer;
    v_served text[];
    v_held integer[];
    v_wanted integer;
BEGIN
    DELETE FROM {table}_members m WHERE m.lease_until < now();
    INSERT INTO {table}_members (worker, target, lease_until)
    VALUES (p_worker, p_target, now() + p_lease * interval '1 second')
    ON CONFLICT (worker, target) DO UPDATE SET lease_until = EXCLUDED.lease_until;
    INSERT INTO {table}_partitions (target, partition)
    SELECT p_target, n FROM generate_series(0, p_count - 1) AS n
    WHERE NOT EXISTS (SELECT 1 FROM {table}_partitions x
                      WHERE x.target = p_target AND x.partition = n)
    ON CONFLICT DO NOTHING;
    SELECT count(*) INTO v_live FROM {table}_members m
    WHERE m.target = p_target AND m.lease_until >= now();
    SELECT coalesce(array_agg(DISTINCT m.target), '{}') INTO v_served
    FROM {table}_members m WHERE m.lease_until >= now();
    WITH renewed AS (
        UPDATE {table}_partitions x
        SET lease_until = now() + p_lease * interval '1 second'
        WHERE x.owner = p_worker AND x.target = p_target
        RETURNING x.partition)
    SELECT coalesce(array_agg(r.partition ORDER BY r.partition), '{}') INTO v_held
    FROM renewed r;
    v_wanted := (p_count + greatest(v_live, 1) - 1) / greatest(v_live, 1)
        - cardinality(array(SELECT h FROM unnest(v_held) AS h WHERE h < p_count));
    IF v_wanted > 0 THEN
        WITH taken AS (
            UPDATE {table}_partitions p
            SET owner = p_worker, lease_until = now() + p_lease * interval '1 second'
            FROM (SELECT f.partition FROM {table}_partitions f
                  WHERE f.target = p_target AND f.partition < p_count
                    AND (f.owner IS NULL OR f.lease_until < now())
                  ORDER BY f.partition
                  LIMIT v_wanted
                  FOR UPDATE SKIP LOCKED) AS free
            WHERE p.target = p_target AND p.partition = free.partition
            RETURNING p.partition)
        SELECT v_held || coalesce(array_agg(t.partition ORDER BY t.partition), '{}')
        INTO v_held FROM taken t;
    END IF;
    RETURN QUERY SELECT v_live, v_served, v_held;
END
$$;
