"""relaybox on Django's database connection: the outbox the settings describe, messages
written in the current transaction, and the inbox's transactions.

    from relaybox.integrations.django import add_messages, outbox

    with transaction.atomic():
        order = Order.objects.create(...)
        add_messages(outbox(), Message(topic="orders", key=str(order.pk), payload=...))

`Outbox.add(django.db.connection, ...)` works as well; `add_messages` adds the
post-commit hand-off through `transaction.on_commit`, and picks the database alias.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from typing import Any

from django.db import connections
from django.db import transaction as django_transaction

from relaybox.core.message import Message
from relaybox.integrations.django.conf import settings
from relaybox.writer.outbox import Outbox


def outbox() -> Outbox:
    """The `Outbox` of `settings.RELAYBOX` (its table, targets, default targets and
    notify); one per configuration, so its commit listeners live as long as the process."""
    conf = settings()
    return _outbox(conf.outbox_table, conf.targets, conf.default_targets, conf.notify)


@functools.lru_cache(maxsize=8)
def _outbox(
    table: str,
    targets: tuple[str, ...] | None,
    default_targets: tuple[str, ...] | None,
    notify: bool | float,
) -> Outbox:
    return Outbox(table=table, targets=targets, default_targets=default_targets, notify=notify)


def add_messages(
    outbox: Outbox, messages: Message | Iterable[Message], *, using: str | None = None
) -> list[Message]:
    """Write `messages` in the current transaction of database `using` (by default
    `RELAYBOX["DATABASE"]`); the outbox hears of them once that transaction commits."""
    alias = using or settings().database
    written = outbox.add(connections[alias], messages)
    django_transaction.on_commit(lambda: outbox.committed(written), using=alias)
    return written


@contextlib.contextmanager
def transaction(using: str | None = None) -> Iterator[Any]:
    """One transaction on Django's connection of `using` (by default
    `RELAYBOX["DATABASE"]`), yielding that connection: the `transaction` of an inbox
    `Consumer` whose handlers use the ORM. It commits when the block ends cleanly and
    rolls back on an exception, so the handler's effects and the inbox record go
    together. The consumer opens it in a worker thread, which gets a connection of its
    own; one that broke or outlived `CONN_MAX_AGE` is closed afterwards."""
    alias = using or settings().database
    connection = connections[alias]
    try:
        with django_transaction.atomic(using=alias):
            yield connection
    finally:
        connection.close_if_unusable_or_obsolete()
