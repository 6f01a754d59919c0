"""The inbox: each received message's effects applied exactly once.

`Inbox` records a processed message in the consumer's own transaction; `Consumer` runs
a handler inside such a transaction; `relaybox.consumers.*` feed it from each broker
and acknowledge only after the commit. docs/inbox.md explains the modes and guarantees.
`EntityConsumer` does the same for state kept outside a relational transaction
(docs/entities.md).
"""

from relaybox.core.incoming import Incoming
from relaybox.inbox.consumer import Consumer, Processed, Transaction
from relaybox.inbox.entities import EntityConsumer
from relaybox.inbox.inbox import (
    DEFAULT_PURGE_BATCH,
    DEFAULT_RETENTION,
    MODES,
    SCOPES,
    Inbox,
    Mode,
    Scope,
)

__all__ = [
    "DEFAULT_PURGE_BATCH",
    "DEFAULT_RETENTION",
    "MODES",
    "SCOPES",
    "Consumer",
    "EntityConsumer",
    "Inbox",
    "Incoming",
    "Mode",
    "Processed",
    "Scope",
    "Transaction",
]
