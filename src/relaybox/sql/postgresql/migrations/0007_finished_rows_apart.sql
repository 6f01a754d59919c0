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
-- The statements and functions that still test `published_at IS NULL AND abandoned_at
-- IS NULL` on {table} stay right: the test is now always true there.
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
CREATE INDEX IF NOT EXISTS {prefix}_done_published_ix ON {table}_done (published_at)
    WHERE published_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS {prefix}_done_abandoned_ix ON {table}_done (abandoned_at)
    WHERE abandoned_at IS NOT NULL;

-- Relays of earlier versions finish rows in place, with an UPDATE that sets published_at
-- or abandoned_at: this moves such a row to {table}_done as it is finished, so relays
-- of both versions may run side by side during an upgrade. relaybox's own statements
-- move rows themselves and never set those columns on {table}.
CREATE OR REPLACE FUNCTION {prefix}_finished() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM {table} WHERE seq = NEW.seq;
    INSERT INTO {table}_done SELECT NEW.*;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS {prefix}_finished ON {table};
CREATE TRIGGER {prefix}_finished
    AFTER UPDATE OF published_at, abandoned_at ON {table}
    FOR EACH ROW WHEN (NEW.published_at IS NOT NULL OR NEW.abandoned_at IS NOT NULL)
    EXECUTE FUNCTION {prefix}_finished();

-- The rows finished so far.
WITH finished AS (
    DELETE FROM {table} WHERE published_at IS NOT NULL OR abandoned_at IS NOT NULL
    RETURNING *
)
INSERT INTO {table}_done SELECT * FROM finished;

DROP INDEX IF EXISTS {prefix}_live_ix;
DROP INDEX IF EXISTS {prefix}_published_ix;
DROP INDEX IF EXISTS {prefix}_abandoned_ix;

-- The indexes that stay, without the live test. Per-key order: "is there an earlier
-- row of this (target, key)?", and the heads of keys past a read's window.
CREATE INDEX IF NOT EXISTS {prefix}_keyed_ix ON {table} (target, key, seq)
    WHERE key IS NOT NULL;
DROP INDEX IF EXISTS {prefix}_key_ix;

-- Keyless rows in seq order, found past a blocked window.
CREATE INDEX IF NOT EXISTS {prefix}_unkeyed_ix ON {table} (seq)
    WHERE key IS NULL;
DROP INDEX IF EXISTS {prefix}_keyless_ix;

-- Rows that wait (a delay, or the backoff after a failed attempt) and so may hold their
-- key back; a row written without a delay never enters it.
CREATE INDEX IF NOT EXISTS {prefix}_waits_ix ON {table} (target, key, seq)
    WHERE key IS NOT NULL AND available_at > created_at;
DROP INDEX IF EXISTS {prefix}_waiting_ix;
