"""`manage.py place_order ITEM`: the order and its "orders" message, in one transaction."""

from django.core.management.base import BaseCommand
from django.db import transaction

from relaybox import Message
from relaybox.integrations.django import add_messages, outbox
from shop.models import Order


class Command(BaseCommand):
    help = "Place an order for ITEM and announce it on the topic 'orders'."

    def add_arguments(self, parser):
        parser.add_argument("item")

    def handle(self, *args, item, **options):
        with transaction.atomic():
            order = Order.objects.create(item=item)
            payload = {"order": order.pk, "item": order.item}
            add_messages(outbox(), Message(topic="orders", key=str(order.pk), payload=payload))
        self.stdout.write(f"order {order.pk} placed")
