"""The `relaybox` command line."""

from __future__ import annotations

import asyncio
import importlib
import sys
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

import click

from relaybox import sql
from relaybox.cli import output
from relaybox.cli.urls import database_option
from relaybox.core.identifiers import DEFAULT_INBOX, DEFAULT_TABLE
from relaybox.errors import RelayboxError
from relaybox.operations import admin
from relaybox.storage.urls import DatabaseUrl


class _LazyGroup(click.Group):
    """Commands whose module is imported only when the command is asked for: running a
    relay or a migration loads neither the benchmark nor the demo."""

    LAZY: Mapping[str, str] = {
        "console": "relaybox.cli.console:console",
        "config": "relaybox.cli.config:config",
        "parked": "relaybox.cli.parked:parked",
        "relay": "relaybox.cli.relay:relay",
        "setup": "relaybox.cli.setup:setup",
        "bench": "relaybox.tools.bench:bench",
        "demo": "relaybox.tools.demo:demo",
        "messages": "relaybox.cli.messages:messages",
        "show": "relaybox.cli.messages:show",
        "replay": "relaybox.cli.messages:replay",
        "discard": "relaybox.cli.messages:discard",
        "delay": "relaybox.cli.messages:delay",
        "expedite": "relaybox.cli.messages:expedite",
        "hold": "relaybox.cli.messages:hold",
        "release": "relaybox.cli.messages:release",
        "backfill": "relaybox.cli.messages:backfill_command",
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.LAZY])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = self.LAZY.get(cmd_name)
        if target is None:
            return super().get_command(ctx, cmd_name)
        module, name = target.split(":")
        command: click.Command = getattr(importlib.import_module(module), name)
        return command


@click.group(cls=_LazyGroup)
@click.version_option(package_name="relaybox")
def main() -> None:
    """relaybox: a transactional outbox and inbox."""


_TABLE_HELP = f"Table name [default: {DEFAULT_TABLE}, or {DEFAULT_INBOX} with --inbox]."
_INBOX_HELP = "The inbox's tables (consumer side) instead of the outbox's."


@main.command()
@database_option()
@click.option("--table", default=None, help=_TABLE_HELP)
@click.option("--inbox", is_flag=True, help=_INBOX_HELP)
@click.option(
    "--log",
    is_flag=True,
    help="Also create the table's replication slot for log mode (PostgreSQL, "
    "wal_level=logical): before the first LogOutbox writes.",
)
def migrate(db_url: str, table: str | None, inbox: bool, log: bool) -> None:
    """Create or upgrade the outbox (or inbox) tables; safe to run again."""
    try:
        masked = DatabaseUrl.parse(db_url).masked
        kind: sql.Kind = "inbox" if inbox else "outbox"
        from relaybox.migrations import migrate as run_migrations  # only this command's

        report = asyncio.run(run_migrations(db_url, table=table, kind=kind))
        if log:
            from relaybox.core.log_records import log_slot
            from relaybox.storage.pg_log import create_slot

            created = asyncio.run(create_slot(db_url, report.table))
            state = "created" if created else "already there"
            output.line(f"replication slot {log_slot(report.table)} on {masked}: {state}")
    except RelayboxError as exc:
        raise output.Failure(str(exc)) from exc
    if report.applied:
        applied = ", ".join(f"{v:04d}" for v in report.applied)
        output.line(
            f"{report.table} on {masked}: applied {applied}; now at version {report.version}"
        )
    else:
        output.line(f"{report.table} on {masked}: up to date at version {report.version}")


@main.command()
@click.option("--dialect", type=click.Choice(sql.DIALECTS), required=True)
@click.option("--table", default=None, help=_TABLE_HELP)
@click.option("--inbox", is_flag=True, help=_INBOX_HELP)
@click.option(
    "--from",
    "after",
    type=click.IntRange(min=0),
    default=None,
    help="Only the migrations after this schema version (0: all of them), each followed "
    "by its record in <table>_migrations, as `relaybox migrate` keeps it.",
)
def schema(dialect: sql.Dialect, table: str | None, inbox: bool, after: int | None) -> None:
    """Print the DDL, for teams that run their own migrations (Alembic, Django, SQL)."""
    kind: sql.Kind = "inbox" if inbox else "outbox"
    table = table or (DEFAULT_INBOX if inbox else DEFAULT_TABLE)
    try:
        if after is None:
            output.lines(sql.schema(dialect, table, kind))
        else:
            output.lines(_migrations_after(dialect, table, kind, after))
    except RelayboxError as exc:
        raise output.Failure(str(exc)) from exc


def _migrations_after(dialect: sql.Dialect, table: str, kind: sql.Kind, after: int) -> str:
    """The statements of the migrations of `table` after version `after`, as `relaybox
    migrate` runs them, each migration recorded in `<table>_migrations` so that `relaybox
    migrate` later finds it applied."""
    steps = sql.migrations(dialect, table, kind)
    latest = steps[-1][0]
    if after > latest:
        raise RelayboxError(f"--from {after}: this relaybox knows {kind} versions up to {latest}")
    parts = [
        f"-- {table}: from schema version {after} to {latest}",
        sql.tracking(dialect, table) + ";",
    ]
    # PostgreSQL's DDL is transactional: each migration and its record, or neither.
    begin, commit = ("BEGIN;\n", "\nCOMMIT;") if dialect == "postgresql" else ("", "")
    for version, name, script in steps:
        if version > after:
            statements = "".join(f"{statement};\n" for statement in sql.statements(script))
            record = sql.RECORD_MIGRATION.format(table=table) + f"({version}, '{name}');"
            parts.append(f"-- migration {version:04d}_{name}\n{begin}{statements}{record}{commit}")
    return "\n\n".join(parts)


T = TypeVar("T")


class _Unreadable(output.Failure):
    """`relaybox status` could not read the table: 2, where a passed limit is 1."""

    exit_code = 2


def _run(work: Coroutine[Any, Any, T], error: type[output.Failure] = output.Failure) -> T:
    try:
        return asyncio.run(work)
    except RelayboxError as exc:
        raise error(str(exc)) from exc


_DB = database_option()
_TABLE = click.option("--table", default=DEFAULT_TABLE, show_default=True, help="Outbox table.")
_JSON = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


@main.command()
@_DB
@_TABLE
@_JSON
@click.option("--max-pending", type=int, default=None, help="Alert above this many pending.")
@click.option("--max-failed", type=int, default=None, help="Alert above this many failed.")
@click.option("--max-abandoned", type=int, default=None, help="Alert above this many abandoned.")
@click.option(
    "--max-age", type=float, default=None, help="Alert when the oldest pending waited longer (s)."
)
@click.option(
    "--max-held", type=int, default=None, help="Alert above this many held (keys waiting)."
)
def status(
    db_url: str, table: str, as_json: bool, max_pending: int | None, max_failed: int | None,
    max_abandoned: int | None, max_age: float | None, max_held: int | None,
) -> None:  # fmt: skip
    """The outbox's signals: counts by status, held messages and the keys they hold
    back, the oldest pending age, leases. Exits 1 when a --max-* limit is passed and 2
    when the table cannot be read (a check for cron or a probe)."""
    stats = _run(admin.table_stats(db_url, table), _Unreadable)
    limits = admin.Thresholds(max_pending, max_failed, max_abandoned, max_age, max_held)
    alerts = limits.breaches(stats)
    if as_json:
        output.json({
            "table": table, "counts": stats.by_status(), "held": stats.held,
            "held_keys": stats.held_keys,
            "oldest_pending_age_seconds": stats.oldest_pending_age,
            "active_leases": stats.active_leases, "alerts": alerts,
        })  # fmt: skip
    else:
        output.line(f"{table} on {DatabaseUrl.parse(db_url).masked}")
        for name, count in stats.by_status().items():
            output.line(f"  {name:<15} {count:>10}")
        output.line(f"  {'held':<15} {stats.held:>10}")
        output.line(f"  {'held keys':<15} {stats.held_keys:>10}")
        age = stats.oldest_pending_age
        output.line(f"  {'oldest pending':<15} {'-' if age is None else f'{age:.1f} s':>10}")
        output.line(f"  {'active leases':<15} {stats.active_leases:>10}")
        for alert in alerts:
            output.line(f"ALERT: {alert}", err=True)
    if alerts:
        sys.exit(1)


@main.command()
@_DB
@_TABLE
@_JSON
@click.option(
    "--limit",
    default=20,
    show_default=True,
    type=click.IntRange(1, admin.MAX_LIMIT),
    help="How many, newest first.",
)
@click.option("--target", default=None, help="Only this target's.")
def abandoned(db_url: str, table: str, as_json: bool, limit: int, target: str | None) -> None:
    """List abandoned messages with their last error, newest first (replay them with
    `relaybox replay`)."""
    rows = _run(admin.list_abandoned(db_url, table, limit=limit, target=target))
    if as_json:
        output.json([
            {"seq": m.seq, "id": str(m.id), "target": m.target, "topic": m.topic, "key": m.key,
             "type": m.type, "attempts": m.attempts, "last_error": m.last_error,
             "abandoned_at": m.abandoned_at.isoformat(), "occurred_at": m.occurred_at.isoformat()}
            for m in rows
        ])  # fmt: skip
        return
    if not rows:
        output.line("no abandoned messages")
        return
    for m in rows:
        when = m.abandoned_at.strftime("%Y-%m-%d %H:%M:%S")
        output.line(f"{m.seq:>10}  {when}  {m.target}  {m.topic}  key={m.key}  "
                    f"attempts={m.attempts}  id={m.id}")  # fmt: skip
        output.line(f"{'':>12}{m.last_error or '(no error recorded)'}")
