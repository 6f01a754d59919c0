"""relaybox: a transactional outbox and inbox for Python services.

from relaybox import Outbox, Message

outbox = Outbox()
with psycopg.connect(DSN) as conn:          # one transaction
    conn.execute("INSERT INTO orders ...")
    outbox.add(conn, Message(topic="orders", key=order_id, payload={...}))
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

from relaybox.core.circuit import CircuitPolicy
from relaybox.core.ids import uuid7
from relaybox.core.incoming import Incoming
from relaybox.core.lifecycle import Status
from relaybox.core.message import Message, Target
from relaybox.core.publishing import Outcome, PublishResult
from relaybox.core.records import Claim, Failure, OutboxStats, StoredMessage
from relaybox.core.retry import RetryPolicy
from relaybox.errors import (
    ConfigurationError,
    EmptyTopicError,
    EnvelopeError,
    InboxError,
    InvalidHeadersError,
    InvalidTableNameError,
    MessageError,
    MigrationError,
    MissingDependencyError,
    NoTransactionError,
    PayloadNotSerializableError,
    PayloadTooLargeError,
    RelayboxError,
    SchemaError,
    StorageError,
    StorageIntegrityError,
    StorageOperationalError,
    UnknownTargetError,
    UnsupportedConnectionError,
)
from relaybox.ports import (
    OperatorStorage,
    PartitionStorage,
    Publisher,
    RowLeaseStorage,
    Storage,
    TableWriter,
)

__version__ = "0.1.0"

if _TYPE_CHECKING:
    from relaybox.inbox import Consumer, Inbox, Processed
    from relaybox.observability.http import StatusServer
    from relaybox.relay import Relay, RelaySettings, RelayThread
    from relaybox.writer import LogOutbox, Outbox

#: The relay and the inbox pull in asyncio and more (a noticeable import time); a
#: service that only writes messages should not pay for it, so these load on first use.
#: So do the writers, which a relay process (a Python interpreter started for each
#: relay, where the import is most of its start) never uses.
_LAZY = {
    "Outbox": "relaybox.writer",
    "LogOutbox": "relaybox.writer",
    "Relay": "relaybox.relay",
    "RelaySettings": "relaybox.relay",
    "RelayThread": "relaybox.relay",
    "StatusServer": "relaybox.observability.http",
    "Consumer": "relaybox.inbox",
    "Inbox": "relaybox.inbox",
    "Processed": "relaybox.inbox",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is not None:
        import importlib

        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'relaybox' has no attribute {name!r}")


__all__ = [
    "CircuitPolicy",
    "Claim",
    "ConfigurationError",
    "Consumer",
    "EmptyTopicError",
    "EnvelopeError",
    "Failure",
    "Inbox",
    "InboxError",
    "Incoming",
    "InvalidHeadersError",
    "InvalidTableNameError",
    "LogOutbox",
    "Message",
    "MessageError",
    "MigrationError",
    "MissingDependencyError",
    "NoTransactionError",
    "OperatorStorage",
    "Outbox",
    "OutboxStats",
    "Outcome",
    "PartitionStorage",
    "PayloadNotSerializableError",
    "PayloadTooLargeError",
    "Processed",
    "PublishResult",
    "Publisher",
    "Relay",
    "RelaySettings",
    "RelayThread",
    "RelayboxError",
    "RetryPolicy",
    "RowLeaseStorage",
    "SchemaError",
    "Status",
    "StatusServer",
    "Storage",
    "StorageError",
    "StorageIntegrityError",
    "StorageOperationalError",
    "StoredMessage",
    "TableWriter",
    "Target",
    "UnknownTargetError",
    "UnsupportedConnectionError",
    "__version__",
    "uuid7",
]
