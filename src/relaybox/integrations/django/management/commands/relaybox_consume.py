"""`manage.py relaybox_consume NAME`: run the consumer settings.RELAYBOX['CONSUMERS']
names NAME until SIGTERM or SIGINT.

Each message is handled once (the inbox of `RELAYBOX["INBOX_TABLE"]`, consumer NAME)
in a transaction on Django's connection: the handler's ORM writes, the inbox record and
any outbox messages it adds commit together, and the broker is acknowledged after.
Handlers are plain functions `handler(message, connection)` given by dotted path per
message type, `"*"` for every type without a handler of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import urllib.parse
from collections.abc import Callable
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils.module_loading import import_string

from relaybox.consumers.base import BrokerConsumer
from relaybox.core.extras import needs_extras
from relaybox.errors import ConfigurationError, RelayboxError
from relaybox.inbox import Consumer, Inbox
from relaybox.integrations.django.conf import EVERY_TYPE, ConsumerSettings, settings
from relaybox.integrations.django.database import transaction
from relaybox.integrations.django.management.setup import stop_signal

#: URL scheme -> (module, class) of the broker consumer.
_BROKERS = {
    "nats": ("nats", "NatsConsumer"), "tls": ("nats", "NatsConsumer"),
    "amqp": ("amqp", "AmqpConsumer"), "amqps": ("amqp", "AmqpConsumer"),
    "kafka": ("kafka", "KafkaConsumer"),
    "redis": ("redis", "RedisConsumer"), "rediss": ("redis", "RedisConsumer"),
    "mqtt": ("mqtt", "MqttConsumer"), "mqtts": ("mqtt", "MqttConsumer"),
}  # fmt: skip


class Command(BaseCommand):  # type: ignore[misc]
    help = "Run the consumer NAME of settings.RELAYBOX['CONSUMERS'] until SIGTERM or SIGINT."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="The consumer's name in RELAYBOX['CONSUMERS'].")
        parser.add_argument("--max-seconds", type=float, help="Stop after this long.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            conf = settings()
            given = conf.consumers.get(options["name"])
            if given is None:
                known = ", ".join(sorted(conf.consumers)) or "none"
                raise ConfigurationError(
                    f"settings.RELAYBOX['CONSUMERS'] has no consumer {options['name']!r} "
                    f"(configured: {known})"
                )
            consumer = _consumer(given, _inbox(given, conf.inbox_table), conf.database)
            asyncio.run(self._run(_broker(given, consumer), given.name, options["max_seconds"]))
        except (RelayboxError, TimeoutError) as error:  # TimeoutError: it never started
            raise CommandError(str(error)) from error

    async def _run(self, broker: BrokerConsumer, name: str, max_seconds: float | None) -> None:
        with stop_signal() as stop:
            async with broker:
                self.stdout.write(f"consumer {name} running")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), max_seconds)
        self.stdout.write(f"consumer {name} stopped")


def _inbox(given: ConsumerSettings, table: str) -> Inbox:
    """The consumer's inbox: its name, the settings' table, its `INBOX` options."""
    try:
        return Inbox(consumer=given.name, table=table, **given.inbox)
    except TypeError as error:  # an option Inbox does not take
        raise ConfigurationError(f"consumer {given.name!r} INBOX: {error}") from None


def _consumer(given: ConsumerSettings, inbox: Inbox, database: str) -> Consumer:
    """The `Consumer` of the configured handlers, on Django's connection of `database`."""
    try:
        handlers = {kind: import_string(path) for kind, path in given.handlers.items()}
    except ImportError as error:
        raise ConfigurationError(f"consumer {given.name!r}: {error}") from error
    consumer = Consumer(
        handlers.pop(EVERY_TYPE, None),
        inbox=inbox,
        transaction=functools.partial(transaction, database),
    )
    for kind, handler in handlers.items():
        consumer.handler(kind)(handler)
    if consumer.is_async:
        raise ConfigurationError(
            f"consumer {given.name!r}: its handlers run in Django's transactions, so they "
            "are plain `def` functions, not `async def`"
        )
    return consumer


def _broker(given: ConsumerSettings, consumer: Consumer) -> BrokerConsumer:
    """The broker consumer that the URL's scheme names, with the configured options."""
    scheme = urllib.parse.urlsplit(given.url).scheme.lower()
    if scheme not in _BROKERS:
        raise ConfigurationError(
            f"consumer {given.name!r}: URL scheme {scheme!r} is not one of "
            + ", ".join(sorted(_BROKERS))
        )
    module, name = _BROKERS[scheme]
    with needs_extras(f"consumer {given.name!r}"):
        kind: Callable[..., BrokerConsumer] = import_string(f"relaybox.consumers.{module}.{name}")
    try:
        return kind(given.url, consumer, **given.options)
    except TypeError as error:  # an option the broker consumer does not take
        raise ConfigurationError(f"consumer {given.name!r} OPTIONS: {error}") from None
