"""The inbox: each received message's effects applied exactly once.

`Inbox` records a processed message in the consumer's own transaction; `Consumer` runs
a handler inside such a transaction; `relaybox.consumers.*` feed it from each broker
and acknowledge only after the commit. docs/inbox.md explains the modes and guarantees.
"""

from relaybox.core.incoming import Incoming
from relaybox.inbox.consumer import Consumer, Processed, Transaction
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
    "Inbox",
    "Incoming",
    "Mode",
    "Processed",
    "Scope",
    "Transaction",
]
