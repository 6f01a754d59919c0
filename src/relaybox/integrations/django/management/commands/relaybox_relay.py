"""`manage.py relaybox_relay`: the relay of `relaybox relay`, configured from
settings.RELAYBOX: the outbox table on Django's database, the brokers by target, the
relay options."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from relaybox.cli.relay import early_signals_caught, relay_settings, serve
from relaybox.cli.urls import masked_logging
from relaybox.errors import ConfigurationError, RelayboxError
from relaybox.integrations.django.conf import settings
from relaybox.integrations.django.management.setup import database_url
from relaybox.observability.http import parse_address
from relaybox.relay import loops
from relaybox.relay.engine import Relay


class Command(BaseCommand):  # type: ignore[misc]
    help = (
        "Deliver committed outbox messages to the brokers of RELAYBOX['BROKERS'] until "
        "SIGTERM or SIGINT."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--http", metavar="HOST:PORT",
            help="Serve /metrics, /api/outbox, /healthz and /readyz there.",
        )  # fmt: skip
        parser.add_argument(
            "--loop", choices=loops.LOOPS, default="auto",
            help="The event loop: auto takes uvloop where it is installed.",
        )  # fmt: skip
        parser.add_argument("--max-seconds", type=float, help="Stop after this long.")
        parser.add_argument(
            "--log-level", default="INFO",
            help="Where the project configured no logging: log at this level to stderr, "
            "with URLs masked.",
        )  # fmt: skip

    def handle(self, *args: Any, **options: Any) -> None:
        with early_signals_caught():
            try:
                self._run(options)
            except RelayboxError as error:
                raise CommandError(str(error)) from error

    def _run(self, options: dict[str, Any]) -> None:
        conf = settings()
        if not conf.brokers:
            raise ConfigurationError(
                "settings.RELAYBOX['BROKERS'] names no broker: give {target: URL}"
            )
        tuning = relay_settings(**conf.relay)
        address = None if options["http"] is None else parse_address(options["http"])
        database = database_url(conf)
        masked_logging(options["log_level"]).hide([database, *conf.brokers.values()])
        relay = Relay([database], dict(conf.brokers), table=conf.outbox_table, settings=tuning)
        work = serve(relay, max_seconds=options["max_seconds"], http=address)
        loops.run_relay(work, loop=options["loop"])
