"""relaybox as a Django app: add `"relaybox.integrations.django"` to INSTALLED_APPS.

It brings migrations that create relaybox's outbox and inbox tables (`manage.py
migrate`), the commands `relaybox_relay`, `relaybox_console` and `relaybox_consume`,
and the writer and the inbox on Django's connection:

    from relaybox.integrations.django import add_messages, outbox

    with transaction.atomic():
        order = Order.objects.create(...)
        add_messages(outbox(), Message(topic="orders", key=str(order.pk), payload=...))

docs/django.md describes the settings (`RELAYBOX = {...}`) and each command.
"""

from relaybox.integrations.django.database import add_messages, outbox, transaction

__all__ = ["add_messages", "outbox", "transaction"]
