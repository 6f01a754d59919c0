"""`relaybox console`: the operator's web console over one or more outbox tables."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import pathlib

import click

from relaybox.cli import output, urls
from relaybox.cli.config import Configured, nearest
from relaybox.cli.urls import DB_ENV
from relaybox.core.extras import needs_extras
from relaybox.core.identifiers import DEFAULT_INBOX, DEFAULT_TABLE
from relaybox.errors import ConfigurationError, RelayboxError
from relaybox.operations.inboxes import InboxWatch
from relaybox.operations.messages import Operations

TOKEN_ENV = "RELAYBOX_CONSOLE_TOKEN"
DEFAULT_LISTEN = "127.0.0.1:8470"


@dataclasses.dataclass(frozen=True, slots=True)
class ConsoleSettings:
    """What tunes the console besides its databases and its token, which are secrets."""

    #: The outbox table of every database.
    table: str = DEFAULT_TABLE
    #: The inbox table of every consumers' database.
    inbox_table: str = DEFAULT_INBOX
    #: HOST:PORT (or PORT, on 127.0.0.1) to serve on.
    listen: str = DEFAULT_LISTEN
    #: Show messages, refuse every change, whether a token is given or not.
    read_only: bool = False


_DEFAULTS = ConsoleSettings()


@click.command(cls=Configured, section="console", secrets=("databases", "inbox_databases"))
@click.option(
    "--db", "databases", multiple=True, envvar=DB_ENV, metavar="URL",
    help=f"Database URL; repeatable (one table each). Also {DB_ENV}, separated by spaces.",
)  # fmt: skip
@click.option(
    "--db-file", "db_files", multiple=True, type=click.Path(dir_okay=False), metavar="PATH",
    help="Read a database URL from this file (keeps the password out of `ps`); repeatable.",
)  # fmt: skip
@click.option("--table", default=_DEFAULTS.table, show_default=True, help="The outbox table.")
@click.option(
    "--inbox-db", "inbox_databases", multiple=True, metavar="URL",
    help="A consumers' database whose inbox to watch; repeatable.",
)  # fmt: skip
@click.option(
    "--inbox-db-file", "inbox_db_files", multiple=True, type=click.Path(dir_okay=False),
    metavar="PATH", help="Read a consumers' database URL from this file; repeatable.",
)  # fmt: skip
@click.option(
    "--inbox-table", default=_DEFAULTS.inbox_table, show_default=True,
    help="The inbox table of each --inbox-db.",
)  # fmt: skip
@click.option(
    "--listen", default=_DEFAULTS.listen, show_default=True, metavar="HOST:PORT",
    help="Where to serve; another host than 127.0.0.1 lets other machines read messages.",
)  # fmt: skip
@click.option("--read-only", is_flag=True, help="Show messages, refuse every change.")
@click.option(
    "--token-file", type=click.Path(dir_okay=False), default=None, metavar="PATH",
    help=f"Read the token that changes need from this file (or {TOKEN_ENV}). "
    "Without a token the console is read-only.",
)  # fmt: skip
def console(
    databases: tuple[str, ...],
    db_files: tuple[str, ...],
    table: str,
    inbox_databases: tuple[str, ...],
    inbox_db_files: tuple[str, ...],
    inbox_table: str,
    listen: str,
    read_only: bool,
    token_file: str | None,
) -> None:
    """Serve the web console: watch the relays' deliveries and the consumers' work;
    find stuck messages, see why and what waits behind them, replay, discard, delay,
    expedite, hold or release them, with an audit record; backfill a target.

    Every option may also come from the environment (RELAYBOX_<OPTION>) or the
    [console] section of a TOML file (--config). The token is never taken on the
    command line or from that file, where others may read it: give it in
    RELAYBOX_CONSOLE_TOKEN or a file (--token-file)."""
    try:
        settings = ConsoleSettings(table, inbox_table, listen, read_only)
        host, port = listen_address(settings.listen)
        ctx = click.get_current_context()
        chosen = nearest(ctx, {"databases": databases, "db_files": db_files})
        found = urls.databases(chosen["databases"], chosen["db_files"])
        chosen = nearest(
            ctx, {"inbox_databases": inbox_databases, "inbox_db_files": inbox_db_files}
        )
        given = [*chosen["inbox_databases"], *map(urls.read_url, chosen["inbox_db_files"])]
        inboxes = [InboxWatch(url, settings.inbox_table) for url in given]
        token = read_token(token_file)
        asyncio.run(
            serve(found, settings.table, inboxes, host, port, token=token,
                  read_only=settings.read_only)
        )  # fmt: skip
    except RelayboxError as exc:
        raise output.Failure(str(exc)) from exc


def listen_address(address: str) -> tuple[str, int]:
    """`HOST:PORT` (an IPv6 host in brackets) or `PORT` (on 127.0.0.1)."""
    host, sep, port = address.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", address
    if not (port.isascii() and port.isdigit() and 0 < int(port) <= 65535 and host):
        raise ConfigurationError(f"--listen {address!r}: give HOST:PORT, like {DEFAULT_LISTEN}")
    return host.strip("[]"), int(port)


def read_token(path: str | None) -> str | None:
    """The token from the file, else from the environment; None: read-only."""
    if path is None:
        return os.environ.get(TOKEN_ENV) or None
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigurationError(f"cannot read the token from {path}: {error}") from None
    if not text or any(c.isspace() for c in text):
        raise ConfigurationError(f"{path} must hold the token (and nothing else)")
    return text


async def serve(
    databases: list[str],
    table: str,
    inboxes: list[InboxWatch],
    host: str,
    port: int,
    *,
    token: str | None,
    read_only: bool,
) -> None:
    """Serve the console over the outbox `table` of each of `databases` and over
    `inboxes` until the process is stopped; with no `token`, read-only."""
    with needs_extras("relaybox console"):
        import uvicorn

    from relaybox.console import create_app

    async with contextlib.AsyncExitStack() as stack:
        tables = [
            await stack.enter_async_context(Operations.opened(url, table)) for url in databases
        ]
        app = create_app(tables, token=token, read_only=read_only, inboxes=inboxes)
        mode = "read-only" if read_only or token is None else "changes need the token"
        shown = f"[{host}]" if ":" in host else host
        output.line(f"relaybox console on http://{shown}:{port}/ ({mode})")
        for each in tables:
            output.line(f"  {each.name}")
        for inbox in inboxes:
            output.line(f"  inbox {inbox.name}")
        config = uvicorn.Config(app, host=host, port=port, lifespan="off", log_level="warning")
        await uvicorn.Server(config).serve()
