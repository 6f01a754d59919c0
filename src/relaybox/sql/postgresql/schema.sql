-- relaybox outbox schema for PostgreSQL (all migrations applied). Table: {table}
-- The outbox: one row per (message, target).
-- Mutable columns come first so an UPDATE's WAL record shares a long suffix with the
-- old tuple (PostgreSQL logs only the changed middle of a same-page update).
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
        CHECK (status IN ('pending', 'processing', 'published', 'failed', 'abandoned'))
);

-- The claim walks live rows in sequence order; finished rows are not in this index.
CREATE INDEX IF NOT EXISTS {prefix}_live_ix ON {table} (seq)
    WHERE status IN ('pending', 'processing', 'failed');

-- Per-key order: "is there an earlier live row of this (target, key)?"
CREATE INDEX IF NOT EXISTS {prefix}_key_ix ON {table} (target, key, seq)
    WHERE key IS NOT NULL AND status IN ('pending', 'processing', 'failed');

-- Retention purges.
CREATE INDEX IF NOT EXISTS {prefix}_published_ix ON {table} (published_at)
    WHERE status = 'published';
CREATE INDEX IF NOT EXISTS {prefix}_abandoned_ix ON {table} (abandoned_at)
    WHERE status = 'abandoned';
