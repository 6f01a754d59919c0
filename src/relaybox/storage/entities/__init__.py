"""Adapters of the entity store and the dedup store (`relaybox.ports.EntityStore`,
`relaybox.ports.DedupStore`) that `relaybox.inbox.entities.EntityConsumer` runs on:
`memory` (one process, for tests), `redis` (redis-py, the `redis` extra) and `sql`
(a document per row on PostgreSQL, MariaDB/MySQL or SQLite, through the drivers the
relay uses). Import the module of the one you use: each loads its client only then.
"""
