-- Partition leases (seed 002): which relay processes are alive, and which of them owns
-- each partition of the keys, until when. Every heartbeat renews both (queries.sql).
CREATE TABLE IF NOT EXISTS {table}_members (
    worker      TEXT PRIMARY KEY,
    lease_until TEXT NOT NULL,
    joined_at   TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now'))
);

CREATE TABLE IF NOT EXISTS {table}_partitions (
    "partition" INTEGER PRIMARY KEY,
    owner       TEXT,
    lease_until TEXT,
    CONSTRAINT {prefix}_partitions_lease_ck CHECK ((owner IS NULL) = (lease_until IS NULL))
);
