"""Django: write messages through Django's connection, announce them on commit.

    from relaybox.integrations.django import add_messages

    with transaction.atomic():
        order = Order.objects.create(...)
        add_messages(outbox, Message(topic="orders", key=str(order.pk), payload=...))

`Outbox.add(django.db.connection, ...)` works as well; this helper adds the post-commit
hand-off through `transaction.on_commit`, and picks the database alias.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db import connections, transaction

from relaybox.core.message import Message
from relaybox.writer.outbox import Outbox


def add_messages(
    outbox: Outbox, messages: Message | Iterable[Message], *, using: str = "default"
) -> list[Message]:
    """Write `messages` in the current transaction of database `using`."""
    written = outbox.add(connections[using], messages)
    transaction.on_commit(lambda: outbox.committed(written), using=using)
    return written
