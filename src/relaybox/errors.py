"""relaybox's exceptions: one root, a branch per concern.

    RelayboxError
    +-- ConfigurationError            bad settings, URL or table name
    |   +-- InvalidTableNameError
    |   +-- MissingDependencyError    an extra's client library is not installed
    +-- MessageError                  a message that cannot be written
    |   +-- EmptyTopicError
    |   +-- PayloadNotSerializableError
    |   +-- PayloadTooLargeError
    |   +-- InvalidHeadersError
    |   +-- UnknownTargetError
    +-- StorageError                  the database said no
    |   +-- UnsupportedConnectionError
    |   +-- NoTransactionError        a write would commit on its own, outside the caller's
    |   +-- StorageOperationalError   connection lost, timeout, deadlock: retry
    |   +-- StorageIntegrityError     a constraint was violated: do not retry
    |   +-- SchemaError               tables missing or newer than this relaybox
    +-- MigrationError
    +-- EnvelopeError                 a received message cannot be decoded; never retry it
    +-- SignatureError                a webhook request's signature is missing or wrong
    +-- InboxError                    the inbox cannot check a message as configured
    +-- BrokerError                   a broker could not be reached or refused a request
        +-- BrokerUnavailableError    cannot connect or authenticate; check the broker URL

Each class's docstring is its default message. Adapters translate their driver's
exceptions into the storage branch, so one retry rule works on every database
(PEP 249's split of operational and integrity errors).
"""

from __future__ import annotations


class RelayboxError(Exception):
    """relaybox failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigurationError(RelayboxError):
    """relaybox is configured wrongly."""


class InvalidTableNameError(ConfigurationError):
    """The table name is not a plain SQL identifier."""


class MissingDependencyError(ConfigurationError):
    """A client library this needs is not installed; install the relaybox extra it names."""


class MessageError(RelayboxError):
    """The message cannot be written to the outbox; nothing was written."""


class EmptyTopicError(MessageError):
    """A message needs a non-empty topic."""


class PayloadNotSerializableError(MessageError):
    """The payload cannot be serialised to JSON; pass JSON-able data, bytes or str."""


class PayloadTooLargeError(MessageError):
    """The encoded payload is larger than the configured limit."""


class InvalidHeadersError(MessageError):
    """Headers must map str names to str values."""


class UnknownTargetError(MessageError):
    """The message names a target that this outbox does not know."""


class StorageError(RelayboxError):
    """The outbox storage failed."""


class UnsupportedConnectionError(StorageError):
    """relaybox does not know how to write through this kind of connection."""


class NoTransactionError(StorageError):
    """The connection is in autocommit mode with no transaction open: a write through it
    would commit on its own, apart from the caller's work; open a transaction first."""


class StorageOperationalError(StorageError):
    """The database could not run the operation (connection, timeout, deadlock); retry."""


class StorageIntegrityError(StorageError):
    """The database rejected the write for a constraint; retrying will not help."""


class SchemaError(StorageError):
    """The outbox tables are missing or were made by a newer relaybox; run `relaybox migrate`."""


class MigrationError(RelayboxError):
    """A schema migration failed; the database keeps the last version that succeeded."""


class EnvelopeError(RelayboxError):
    """The received message is not a readable relaybox (CloudEvents) envelope."""


class SignatureError(RelayboxError):
    """The webhook request carries no valid signature: none, a malformed one, one made
    too long ago, or one that does not match the request; it is refused unprocessed."""


class InboxError(RelayboxError):
    """The inbox cannot check this message as configured."""


class TransactionLostError(RelayboxError):
    """A consumer's handler returned, but its transaction no longer holds the message's
    record (an error the handler caught aborted it): nothing is acknowledged, and the
    message counts a failed attempt."""


class EntityConflictError(RelayboxError):
    """An entity kept changing under its consumer's saves; the message is not acknowledged
    and comes again."""


class BrokerError(RelayboxError):
    """The broker failed."""


class BrokerUnavailableError(BrokerError):
    """The broker cannot be reached or refused the connection; check its URL and that it runs."""
