"""`relaybox parked`: list, replay and discard the messages consumers parked.

Each command opens one connection to the consumer's database, runs in one transaction
and closes it. `replay` applies nothing itself, since the handler lives in the
consumer's process: it marks the messages for replay, and a running `Consumer` of each
one's name applies them, once, within its `replay_interval` (docs/inbox.md).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click

from relaybox.cli import output
from relaybox.cli.urls import database_option
from relaybox.core.identifiers import DEFAULT_INBOX
from relaybox.errors import RelayboxError
from relaybox.inbox import parked as store
from relaybox.inbox.parked import STATUSES, ParkedMessage, Status
from relaybox.operations.inboxes import in_transaction
from relaybox.storage.urls import DatabaseUrl

T = TypeVar("T")

_DB = database_option("The consumer's database URL.")
_TABLE = click.option(
    "--inbox-table", "table", default=DEFAULT_INBOX, show_default=True,
    help="The inbox table; its parked messages are in <table>_parked.",
)  # fmt: skip
_BY = click.option("--by", default=None, help="Who asks, for the audit [default: the OS user].")
_IDS = click.argument("ids", nargs=-1, type=int, required=True)


@click.group()
def parked() -> None:
    """The messages consumers gave up on: list, replay or discard them."""


@parked.command("list")
@_DB
@_TABLE
@click.option("--type", "type_name", default=None, help="Only messages of this type.")
@click.option("--consumer", default=None, help="Only this consumer's.")
@click.option("--status", type=click.Choice(STATUSES), default="parked", show_default=True)
@click.option("--limit", default=20, show_default=True, help="How many, newest first.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON, payloads included.")
def list_parked(
    db_url: str, table: str, type_name: str | None, consumer: str | None, status: Status,
    limit: int, as_json: bool,
) -> None:  # fmt: skip
    """List parked messages with their error, newest first."""

    async def read(connection: Any) -> list[ParkedMessage]:
        return await store.list_parked(connection, table=table, status=status,
                                       consumer=consumer, type=type_name, limit=limit)  # fmt: skip

    rows = _run(db_url, table, read)
    if as_json:
        output.json([_as_json(row) for row in rows])
        return
    if not rows:
        output.line(f"no {status} messages")
        return
    for row in rows:
        when = row.parked_at.strftime("%Y-%m-%d %H:%M:%S")
        output.line(f"{row.id:>8}  {when}  {row.consumer}  {row.message.type or '-'}  "
                    f"{row.reason}  attempts={row.attempts}  id={row.message.id}")  # fmt: skip
        output.line(f"{'':>10}{row.error.splitlines()[-1] if row.error else ''}")


@parked.command()
@_DB
@_TABLE
@_BY
@_IDS
def replay(db_url: str, table: str, by: str | None, ids: tuple[int, ...]) -> None:
    """Mark parked messages (IDS, see `relaybox parked list`) for replay: a running
    consumer of each one's name applies it through its handler, once."""
    count = _run(db_url, table, lambda conn: store.request_replay(conn, ids, table=table, by=by))
    output.line(f"marked {count} message(s) for replay; running consumers apply them")


@parked.command()
@_DB
@_TABLE
@_BY
@click.option("--reason", required=True, help="Why: kept with who discarded them.")
@_IDS
def discard(db_url: str, table: str, by: str | None, reason: str, ids: tuple[int, ...]) -> None:
    """Give up on parked messages (IDS) for good; who and why are kept."""
    count = _run(
        db_url, table,
        lambda conn: store.discard(conn, ids, reason=reason, table=table, by=by),
    )  # fmt: skip
    output.line(f"discarded {count} message(s)")


def _as_json(row: ParkedMessage) -> dict[str, Any]:
    message = row.message
    try:
        payload: dict[str, str] = {"payload": message.payload.decode("utf-8")}
    except UnicodeDecodeError:
        payload = {"payload_base64": base64.b64encode(message.payload).decode()}
    return {
        "id": row.id, "consumer": row.consumer, "status": row.status, "reason": row.reason,
        "error": row.error, "attempts": row.attempts, "parked_at": row.parked_at.isoformat(),
        "changed_at": row.changed_at.isoformat() if row.changed_at else None,
        "changed_by": row.changed_by, "note": row.note, "message_id": message.id,
        "type": message.type, "source": message.source, "topic": message.topic,
        "key": message.key, "content_type": message.content_type,
        "attributes": dict(message.attributes), "headers": dict(message.headers), **payload,
    }  # fmt: skip


def _run(db_url: str, table: str, work: Callable[[Any], Awaitable[T]]) -> T:
    """`work` on a connection to `db_url`, in one transaction; relaybox's errors, with
    the URL's password masked, as the command's."""
    try:
        url = DatabaseUrl.parse(db_url)
        hint = (
            f"no table {table}_parked: create it with `relaybox migrate --inbox "
            f"--db {url.masked} --table {table}`"
        )
        return asyncio.run(in_transaction(url, work, missing_hint=hint))
    except RelayboxError as error:
        raise output.Failure(str(error)) from error
