"""Handlers the consume command is configured with, by dotted path."""

from __future__ import annotations

from typing import Any

from relaybox.core.incoming import Incoming


def record_order(message: Incoming, connection: Any) -> None:
    """One order per message applied, written through the ORM in the inbox's transaction."""
    from tests.integration.djangoshop.models import Order

    Order.objects.using(connection.alias).create(item=message.id)


async def record_order_async(message: Incoming, connection: Any) -> None:
    """A handler the consume command refuses: Django's transactions are sync."""
