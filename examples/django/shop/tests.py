"""The shop's tests, run by Django's test runner: `python manage.py test shop`.

Each `TestCase` test runs inside a transaction that Django rolls back afterwards, so
nothing here is ever committed: the outbox is read on the test's own connection, with
a query on the table that `outbox()` writes to.
"""

import json
from io import StringIO

from django.conf import settings
from django.core.management import call_command
from django.db import connection, transaction
from django.test import TestCase, override_settings

from relaybox import Message
from relaybox.integrations.django import add_messages, outbox
from shop.models import Order


def outbox_rows():
    """(topic, key, payload as JSON) of each message in the outbox, oldest first."""
    key = connection.ops.quote_name("key")  # a reserved word on MySQL and MariaDB
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT topic, {key}, payload FROM {outbox().table} ORDER BY seq")
        return [(topic, key, json.loads(bytes(payload))) for topic, key, payload in cursor]


class PlaceOrderTests(TestCase):
    def test_an_order_and_its_message_are_written_together(self):
        with self.captureOnCommitCallbacks(execute=True) as callbacks:
            call_command("place_order", "book", stdout=StringIO())
        order = Order.objects.get()
        self.assertEqual(order.item, "book")
        payload = {"order": order.pk, "item": "book"}
        self.assertEqual(outbox_rows(), [("orders", str(order.pk), payload)])
        self.assertEqual(len(callbacks), 1)  # the outbox hears of it once committed

    def test_a_rolled_back_order_writes_no_message(self):
        with self.assertRaises(ValueError), transaction.atomic():
            order = Order.objects.create(item="book")
            add_messages(outbox(), Message(topic="orders", key=str(order.pk), payload={}))
            raise ValueError("payment declined")
        self.assertFalse(Order.objects.exists())
        self.assertEqual(outbox_rows(), [])

    def test_the_outbox_is_the_one_of_the_relaybox_setting(self):
        self.assertEqual(outbox().table, settings.RELAYBOX["OUTBOX_TABLE"])
        with override_settings(RELAYBOX={**settings.RELAYBOX, "OUTBOX_TABLE": "other"}):
            self.assertEqual(outbox().table, "other")
