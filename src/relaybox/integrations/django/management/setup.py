"""What the management commands share: the relaybox URL of a Django database, and
running until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import urllib.parse
from collections.abc import Iterator

from django.db import connections

from relaybox.errors import ConfigurationError
from relaybox.integrations.django.conf import RelayboxSettings
from relaybox.storage.urls import DatabaseUrl

_SCHEMES = {"postgresql": "postgresql", "mysql": "mysql"}


def database_url(conf: RelayboxSettings) -> str:
    """The URL relaybox's async drivers reach the settings' database by: `DATABASE_URL`
    where given, else the server, database, user and password of its DATABASES entry
    (over TCP; a Unix socket or TLS options need `DATABASE_URL`)."""
    if conf.database_url is not None:
        DatabaseUrl.parse(conf.database_url)  # a bad one fails here, masked
        return conf.database_url
    alias = conf.database
    if alias not in connections:
        raise ConfigurationError(f"settings.RELAYBOX['DATABASE']: no database {alias!r}")
    connection = connections[alias]
    given = connection.settings_dict
    name = str(given.get("NAME") or "")
    if connection.vendor == "sqlite":
        if not name or name == ":memory:" or "mode=memory" in name:
            raise ConfigurationError(
                f"database {alias!r} is an in-memory SQLite database, which no other "
                "connection can reach: give it a file"
            )
        if name.startswith("file:"):
            raise _needs_url(alias, "a SQLite URI filename")
        return f"sqlite:///{name}"
    scheme = _SCHEMES.get(connection.vendor)
    if scheme is None:
        raise ConfigurationError(
            f"relaybox runs on PostgreSQL, MySQL/MariaDB and SQLite, not {connection.vendor}"
        )
    user = urllib.parse.quote(str(given.get("USER") or ""), safe="")
    password = urllib.parse.quote(str(given.get("PASSWORD") or ""), safe="")
    credentials = f"{user}:{password}@" if password else f"{user}@" if user else ""
    host = str(given.get("HOST") or "127.0.0.1")
    if host.startswith("/"):
        raise _needs_url(alias, "a Unix socket")
    host = f"[{host}]" if ":" in host else host
    port = f":{given['PORT']}" if given.get("PORT") else ""
    return f"{scheme}://{credentials}{host}{port}/{urllib.parse.quote(name, safe='')}"


def _needs_url(alias: str, what: str) -> ConfigurationError:
    return ConfigurationError(
        f"database {alias!r} is reached through {what}: give relaybox's URL for it in "
        "settings.RELAYBOX['DATABASE_URL']"
    )


@contextlib.contextmanager
def stop_signal() -> Iterator[asyncio.Event]:
    """An event set by SIGTERM or SIGINT, for as long as the block runs (in the event
    loop): the command stops cleanly instead of dying."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
