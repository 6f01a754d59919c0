"""relaybox: a transactional outbox and inbox for Python services.

from relaybox import Outbox, Message

outbox = Outbox()
with psycopg.connect(DSN) as conn:          # one transaction
    conn.execute("INSERT INTO orders ...")
    outbox.add(conn, Message(topic="orders", key=order_id, payload={...}))
"""

from relaybox.core.circuit import CircuitPolicy
from relaybox.core.ids import uuid7
from relaybox.core.lifecycle import Status
from relaybox.core.message import Message, Target
from relaybox.core.publishing import Outcome, PublishResult
from relaybox.core.records import Claim, Failure, OutboxStats, StoredMessage
from relaybox.core.retry import RetryPolicy
from relaybox.errors import (
    ConfigurationError,
    EmptyTopicError,
    InvalidHeadersError,
    InvalidTableNameError,
    MessageError,
    MigrationError,
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
from relaybox.ports import OutboxStorage, Publisher
from relaybox.relay import Relay, RelaySettings, RelayThread
from relaybox.writer import Outbox

__version__ = "0.1.0"

__all__ = [
    "CircuitPolicy",
    "Claim",
    "ConfigurationError",
    "EmptyTopicError",
    "Failure",
    "InvalidHeadersError",
    "InvalidTableNameError",
    "Message",
    "MessageError",
    "MigrationError",
    "Outbox",
    "OutboxStats",
    "OutboxStorage",
    "Outcome",
    "PayloadNotSerializableError",
    "PayloadTooLargeError",
    "PublishResult",
    "Publisher",
    "Relay",
    "RelaySettings",
    "RelayThread",
    "RelayboxError",
    "RetryPolicy",
    "SchemaError",
    "Status",
    "StorageError",
    "StorageIntegrityError",
    "StorageOperationalError",
    "StoredMessage",
    "Target",
    "UnknownTargetError",
    "UnsupportedConnectionError",
    "__version__",
    "uuid7",
]
