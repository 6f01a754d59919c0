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
