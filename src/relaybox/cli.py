"""The `relaybox` command line."""

from __future__ import annotations

import asyncio

import click

from relaybox import sql
from relaybox.bench import bench
from relaybox.core.identifiers import DEFAULT_INBOX, DEFAULT_TABLE
from relaybox.demo import demo
from relaybox.errors import RelayboxError
from relaybox.migrations import migrate as run_migrations
from relaybox.relay.command import relay
from relaybox.storage.urls import DatabaseUrl


@click.group()
@click.version_option(package_name="relaybox")
def main() -> None:
    """relaybox: a transactional outbox and inbox."""


_TABLE_HELP = f"Table name [default: {DEFAULT_TABLE}, or {DEFAULT_INBOX} with --inbox]."
_INBOX_HELP = "The inbox's tables (consumer side) instead of the outbox's."


@main.command()
@click.option("--db", "db_url", required=True, envvar="RELAYBOX_DB", help="Database URL.")
@click.option("--table", default=None, help=_TABLE_HELP)
@click.option("--inbox", is_flag=True, help=_INBOX_HELP)
def migrate(db_url: str, table: str | None, inbox: bool) -> None:
    """Create or upgrade the outbox (or inbox) tables; safe to run again."""
    try:
        masked = DatabaseUrl.parse(db_url).masked
        kind: sql.Kind = "inbox" if inbox else "outbox"
        report = asyncio.run(run_migrations(db_url, table=table, kind=kind))
    except RelayboxError as exc:
        raise click.ClickException(str(exc)) from exc
    if report.applied:
        applied = ", ".join(f"{v:04d}" for v in report.applied)
        click.echo(
            f"{report.table} on {masked}: applied {applied}; now at version {report.version}"
        )
    else:
        click.echo(f"{report.table} on {masked}: up to date at version {report.version}")


@main.command()
@click.option("--dialect", type=click.Choice(sql.DIALECTS), required=True)
@click.option("--table", default=None, help=_TABLE_HELP)
@click.option("--inbox", is_flag=True, help=_INBOX_HELP)
def schema(dialect: sql.Dialect, table: str | None, inbox: bool) -> None:
    """Print the DDL, for teams that run their own migrations (Alembic, Django)."""
    try:
        if inbox:
            click.echo(sql.schema(dialect, table or DEFAULT_INBOX, "inbox"))
        else:
            click.echo(sql.schema(dialect, table or DEFAULT_TABLE))
    except RelayboxError as exc:
        raise click.ClickException(str(exc)) from exc


main.add_command(demo)
main.add_command(relay)
main.add_command(bench)
