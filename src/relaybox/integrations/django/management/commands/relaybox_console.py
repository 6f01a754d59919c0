"""`manage.py relaybox_console`: the operator's web console of `relaybox console` over
the outbox of settings.RELAYBOX, and over its inbox when consumers are configured."""

from __future__ import annotations

import asyncio
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from relaybox.cli.console import DEFAULT_LISTEN, TOKEN_ENV, listen_address, read_token, serve
from relaybox.errors import RelayboxError
from relaybox.integrations.django.conf import settings
from relaybox.integrations.django.management.setup import database_url
from relaybox.operations.inboxes import InboxWatch


class Command(BaseCommand):  # type: ignore[misc]
    help = (
        "Serve the operator's web console over the outbox (and the inbox) of "
        f"settings.RELAYBOX. Changes need the token of {TOKEN_ENV} or --token-file."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT")
        parser.add_argument("--read-only", action="store_true")
        parser.add_argument("--token-file", metavar="PATH")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            conf = settings()
            host, port = listen_address(options["listen"])
            url = database_url(conf)
            inboxes = [InboxWatch(url, conf.inbox_table)] if conf.consumers else []
            token = read_token(options["token_file"])
            work = serve([url], conf.outbox_table, inboxes, host, port, token=token,
                         read_only=options["read_only"])  # fmt: skip
            asyncio.run(work)
        except RelayboxError as error:
            raise CommandError(str(error)) from error
