-- relaybox outbox schema for PostgreSQL (all migrations applied). Table: {table}
-- The outbox: one row per (message, target).
-- A claim must cost little more than the delete that follows it. So the claim updates
-- no indexed column and touches no column of an index predicate (only the finish
-- timestamps are), and pages keep half their room free: the claim is then a
-- heap-only (HOT) update with no index entries, measured at 2x the drain rate of a
-- plain update. Mutable columns come first so an UPDATE's WAL record shares a long
-- suffix with the old tuple (PostgreSQL logs only the changed middle).
CREATE TABLE IF NOT EXISTS {table} (
    seq            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    status         text NOT NULL DEFAULT 'pending',
    attempts       integer NOT NULL DEFAULT 0,
    available_at   timestamptz NOT NULL DEFAULT now(),
    locked_by      text,
    locked_until   timestamptz,
    lock_token     uuid,
    published_at   timestamptz,
    abandoned_at   timestamptz,
    last_error     text,
    id             uuid NOT NULL,
    target         text NOT NULL,
    external       boolean NOT NULL DEFAULT false,
    topic          text NOT NULL,
    key            text,
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
    created_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT {prefix}_status_ck
        CHECK (status IN ('pending', 'processing', 'published', 'failed', 'abandoned')),
    -- A row is live (pending, processing, failed) exactly while both are NULL.
    CONSTRAINT {prefix}_finished_ck
        CHECK ((published_at IS NOT NULL) = (status = 'published')
               AND (abandoned_at IS NOT NULL) = (status = 'abandoned'))
) WITH (fillfactor = 50);

-- The claim walks live rows in sequence order; finished rows are not in this index.
CREATE INDEX IF NOT EXISTS {prefix}_live_ix ON {table} (seq)
    WHERE published_at IS NULL AND abandoned_at IS NULL;

-- Per-key order: "is there an earlier live row of this (target, key)?"
CREATE INDEX IF NOT EXISTS {prefix}_key_ix ON {table} (target, key, seq)
    WHERE key IS NOT NULL AND published_at IS NULL AND abandoned_at IS NULL;

-- Retention purges.
CREATE INDEX IF NOT EXISTS {prefix}_published_ix ON {table} (published_at)
    WHERE published_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS {prefix}_abandoned_ix ON {table} (abandoned_at)
    WHERE abandoned_at IS NOT NULL;

-- Partition leases (seed 002): which relay processes are alive, and which of them owns
-- each partition of the keys, until when. Every heartbeat renews both (queries.sql).
CREATE TABLE IF NOT EXISTS {table}_members (
    worker      text PRIMARY KEY,
    lease_until timestamptz NOT NULL,
    joined_at   timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS {table}_partitions (
    partition   integer PRIMARY KEY,
    owner       text,
    lease_until timestamptz,
    CONSTRAINT {prefix}_partitions_lease_ck CHECK ((owner IS NULL) = (lease_until IS NULL))
);
