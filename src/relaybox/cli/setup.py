"""`relaybox setup`: create what each target needs on its broker (exchanges, queues,
bindings, streams, topics, consumer groups), as its URL's options say."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import click

from relaybox.cli import output, urls
from relaybox.cli.config import nearest
from relaybox.cli.urls import BROKER_ENV
from relaybox.errors import RelayboxError
from relaybox.publishers import setup_topology


async def set_up(targets: Mapping[str, str]) -> list[str]:
    """Set up every target in turn; a line for each thing seen to, or for a target
    that needs nothing. The first failure stops it (what was done stays done)."""
    lines: list[str] = []
    for name, url in targets.items():
        declared = await setup_topology(url)
        lines += [f"{name}: {item}" for item in declared] or [f"{name}: nothing to set up"]
    return lines


@click.command()
@click.option(
    "--broker",
    "brokers",
    multiple=True,
    envvar=BROKER_ENV,
    metavar="NAME=URL",
    help=f"Target NAME=URL, as `relaybox relay` takes it; repeatable. Also {BROKER_ENV}.",
)
@click.option(
    "--broker-file",
    "broker_files",
    multiple=True,
    metavar="NAME=PATH",
    help="Read target NAME's URL from the file PATH; repeatable.",
)
def setup(brokers: tuple[str, ...], broker_files: tuple[str, ...]) -> None:
    """Create what each target's URL says it needs on its broker, leaving what exists:
    RabbitMQ exchanges, queues and bindings; NATS JetStream streams; Kafka topics;
    Redis consumer groups; a Celery target's exchange and queue. Safe to run again."""
    try:
        chosen = nearest(click.get_current_context(),
                         {"brokers": brokers, "broker_files": broker_files})  # fmt: skip
        targets = urls.brokers(chosen["brokers"], chosen["broker_files"])
        for line in asyncio.run(set_up(targets)):
            output.line(line)
    except RelayboxError as exc:
        raise output.Failure(str(exc)) from exc
