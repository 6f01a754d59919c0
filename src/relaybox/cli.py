"""The `relaybox` command line."""

from __future__ import annotations

import asyncio

import click

from relaybox import sql
from relaybox.bench import bench
from relaybox.core.identifiers import DEFAULT_TABLE
from relaybox.demo import demo
from relaybox.errors import RelayboxError
from relaybox.migrations import migrate as run_migrations
from relaybox.relay.command import relay
from relaybox.storage.urls import DatabaseUrl


@click.group()
@click.version_option(package_name="relaybox")
def main() -> None:
    """relaybox: a transactional outbox and inbox."""


@main.command()
@click.option("--db", "db_url", required=True, envvar="RELAYBOX_DB", help="Database URL.")
@click.option("--table", default=DEFAULT_TABLE, show_default=True, help="Outbox table name.")
def migrate(db_url: str, table: str) -> None:
    """Create or upgrade the outbox tables; safe to run again."""
    try:
        masked = DatabaseUrl.parse(db_url).masked
        report = asyncio.run(run_migrations(db_url, table=table))
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
@click.option("--table", default=DEFAULT_TABLE, show_default=True, help="Outbox table name.")
def schema(dialect: sql.Dialect, table: str) -> None:
    """Print the DDL, for teams that run their own migrations (Alembic, Django)."""
    try:
        click.echo(sql.schema(dialect, table))
    except RelayboxError as exc:
        raise click.ClickException(str(exc)) from exc


main.add_command(demo)
main.add_command(relay)
main.add_command(bench)
