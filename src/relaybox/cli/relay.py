"""`relaybox relay`: run the relay as a process until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click

from relaybox.cli import output, urls
from relaybox.cli.config import Configured, given_by, nearest
from relaybox.cli.setup import set_up
from relaybox.cli.urls import BROKER_ENV, DB_ENV
from relaybox.core.circuit import CircuitPolicy
from relaybox.core.identifiers import DEFAULT_TABLE
from relaybox.core.retry import RetryPolicy
from relaybox.errors import ConfigurationError, RelayboxError
from relaybox.relay import loops
from relaybox.relay.engine import Relay
from relaybox.relay.settings import RelaySettings

_early_signal: list[int] = []
_P = TypeVar("_P", RetryPolicy, CircuitPolicy)


def _remember_signal(signum: int, _frame: object) -> None:
    _early_signal.append(signum)


def catch_early_signals() -> None:
    """Remember a SIGTERM or SIGINT that comes before `serve` has its event loop, so
    that the relay stops as soon as it started instead of dying half-started."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _remember_signal)


@contextlib.contextmanager
def early_signals_caught() -> Iterator[None]:
    """`catch_early_signals` for the block only: then the handlers from before it are
    back and nothing is remembered, for a relay run inside a process that goes on (a
    Django management command called from code)."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    catch_early_signals()
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _early_signal.clear()


def relay_settings(**options: Any) -> RelaySettings:
    """`RelaySettings` from plain values, as a configuration file gives them: `retry`
    and `circuit` as dicts of `RetryPolicy` and `CircuitPolicy` fields; an unknown name
    is a `ConfigurationError` that lists the known ones."""
    nested = {"retry": RetryPolicy, "circuit": CircuitPolicy}
    known = {field.name: field for field in dataclasses.fields(RelaySettings)}
    for name, value in options.items():
        kind = nested.get(name)
        if name not in known or (kind is not None and not isinstance(value, dict)):
            fields = ", ".join(sorted(known))
            raise ConfigurationError(f"relay option {name!r} is not one of: {fields}")
        if kind is not None:
            options[name] = _policy(kind, name, value)
    try:
        return RelaySettings(**options)
    except TypeError as error:  # a value of the wrong type
        raise ConfigurationError(f"relay options: {error}") from None


def _policy(kind: type[_P], name: str, values: dict[str, Any]) -> _P:
    try:
        return kind(**values)
    except TypeError:
        fields = ", ".join(field.name for field in dataclasses.fields(kind))
        raise ConfigurationError(f"relay option {name!r} takes: {fields}") from None


async def serve(
    relay: Relay, *, max_seconds: float | None = None, http: tuple[str, int] | None = None
) -> None:
    """Run until a signal (or `max_seconds`), then stop gracefully; with `http`
    (host, port), serve the status endpoints there meanwhile."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if _early_signal:  # it came while we were starting: start, then stop at once
        stop.set()
    server = None
    try:
        if http is not None:  # bound first: a port in use stops us before we join
            from relaybox.observability.http import StatusServer  # --http's alone

            server = StatusServer(relay, *http)
            await server.start()
            relay.sample_stats(STATS_EVERY)
        await relay.start()
        output.line(
            f"relay {relay.worker} running; targets: {', '.join(relay.publishers)}; "
            f"event loop: {loops.running_loop_name()}"
        )
        if server is not None:
            output.line(f"status endpoints on {server.url} (/metrics, /api/outbox, /healthz)")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max_seconds)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if server is not None:
            await server.close()
        await relay.stop()
    output.line(f"relay {relay.worker} stopped")


def _settings(ctx: click.Context, build: Callable[[], RelaySettings]) -> RelaySettings:
    """`build()`, with an error that names where the values came from when they do not
    go together."""
    try:
        return build()
    except ConfigurationError as error:
        raise ConfigurationError(f"{error}{given_by(ctx)}") from None


#: With --http, each table's counts are read this often (and when scraped, if older).
STATS_EVERY = 15.0

#: Every option's default is the settings object's own: one home for each.
_DEFAULTS = RelaySettings()
_RETRY = _DEFAULTS.retry
_CIRCUIT = _DEFAULTS.circuit


@click.command(
    cls=Configured,
    section="relay",
    tables=("brokers", "broker_files"),
    secrets=("databases", "brokers"),
)
@click.option(
    "--db",
    "databases",
    multiple=True,
    envvar=DB_ENV,
    metavar="URL",
    help=f"Database URL; repeat for one processor per database. Also {DB_ENV} "
    "(several separated by spaces).",
)
@click.option(
    "--db-file",
    "db_files",
    multiple=True,
    type=click.Path(dir_okay=False),
    metavar="PATH",
    help="Read a database URL from this file (keeps its password out of `ps`); repeatable.",
)
@click.option(
    "--broker",
    "brokers",
    multiple=True,
    envvar=BROKER_ENV,
    metavar="NAME=URL",
    help=f"Target NAME=URL (memory://, noop://, file://PATH, ...); repeatable. Also "
    f"{BROKER_ENV} (several separated by spaces).",
)
@click.option(
    "--broker-file",
    "broker_files",
    multiple=True,
    metavar="NAME=PATH",
    help="Read target NAME's URL from the file PATH (keeps its secrets out of `ps`); repeatable.",
)
@click.option("--table", default=DEFAULT_TABLE, show_default=True, help="The outbox table.")
@click.option(
    "--mode",
    type=click.Choice(["table", "log"]),
    default="table",
    show_default=True,
    help="log: stream what LogOutbox writers emitted from the table's replication slot "
    "(PostgreSQL), with the table relay beside it for what could not be published.",
)
@click.option(
    "--batch-size", default=_DEFAULTS.batch_size, show_default=True,
    help="Rows per read; one statement settles them.",
)  # fmt: skip
@click.option(
    "--max-in-flight", type=click.IntRange(min=1), default=_DEFAULTS.max_in_flight,
    show_default="3 on PostgreSQL, 2 on MySQL and SQLite; in a fleet, each relay's share",
    help="Batches being published at once.",
)  # fmt: skip
@click.option(
    "--max-claim-bytes",
    default=_DEFAULTS.max_claim_bytes,
    show_default=True,
    help="Payload bytes one batch may hold (a larger message goes alone).",
)
@click.option(
    "--lease", "lease_seconds", default=_DEFAULTS.lease_seconds, show_default=True,
    help="Seconds a relay's hold on a row or partition lasts without renewal.",
)  # fmt: skip
@click.option(
    "--publish-timeout", default=_DEFAULTS.publish_timeout, show_default=True,
    help="Seconds one publish call may take; longer is a transient failure.",
)  # fmt: skip
@click.option(
    "--partitions",
    default=_DEFAULTS.partitions,
    show_default=True,
    help="Partitions the relays of a table share (every relay of the table alike).",
)
@click.option(
    "--no-partition-leases",
    is_flag=True,
    help="Claim from every partition, leasing each row (every relay of the table alike).",
)
@click.option(
    "--retry-base", default=_RETRY.base_delay, show_default=True, help="First retry delay, s."
)
@click.option(
    "--retry-max", default=_RETRY.max_delay, show_default=True, help="Largest retry delay, s."
)
@click.option(
    "--retry-jitter", default=_RETRY.jitter, show_default=True,
    help="Each delay is randomised within this share either way.",
)  # fmt: skip
@click.option(
    "--max-attempts", default=_RETRY.max_attempts, show_default=True,
    help="Failed attempts before a message is abandoned (or held).",
)  # fmt: skip
@click.option(
    "--circuit-threshold", default=_CIRCUIT.failure_threshold, show_default=True,
    help="Consecutive failed publish calls of a target that open its circuit.",
)  # fmt: skip
@click.option(
    "--circuit-open", default=_CIRCUIT.open_seconds, show_default=True,
    help="Seconds before a probe.",
)  # fmt: skip
@click.option(
    "--circuit-max-open",
    default=_CIRCUIT.max_open_seconds,
    show_default=True,
    help="Longest pause between probes (each failed probe doubles it).",
)
@click.option(
    "--idle-interval", default=_DEFAULTS.idle_interval, show_default=True,
    help="The longest wait between two reads when there is nothing to do, s.",
)  # fmt: skip
@click.option(
    "--fast-poll-window",
    default=_DEFAULTS.fast_poll_window,
    show_default=True,
    help="Seconds of fast polling after a NOTIFY or a read that found rows; longer than "
    "the writers' notify interval. 0: the adaptive poll alone.",
)
@click.option(
    "--fast-poll-interval",
    default=_DEFAULTS.fast_poll_interval,
    show_default=True,
    help="The shortest wait between reads within the fast window, s: after a read that "
    "found rows, and after an empty one while a quarter of the time since rows were last "
    "found (or a NOTIFY came) is shorter.",
)
@click.option(
    "--no-listen",
    is_flag=True,
    help="On PostgreSQL, wake on the poll alone, not on the writers' NOTIFY: for a "
    "pooler in transaction mode, where a LISTEN reaches no relay.",
)
@click.option(
    "--published-retention",
    default=_DEFAULTS.published_retention,
    show_default=True,
    help="Seconds to keep published rows; 0 deletes them on publish.",
)
@click.option(
    "--abandoned-retention", default=_DEFAULTS.abandoned_retention, show_default=True,
    help="Seconds to keep abandoned rows.",
)  # fmt: skip
@click.option(
    "--hold-keys",
    is_flag=True,
    help="Hold a keyed message the relay gives up on, with its key's later messages behind "
    "it, until an operator replays or discards it (keyless ones are abandoned).",
)
@click.option(
    "--cleanup-interval", default=_DEFAULTS.cleanup_interval, show_default=True,
    help="Seconds between purges of rows past their retention.",
)  # fmt: skip
@click.option(
    "--shutdown-timeout", default=_DEFAULTS.shutdown_timeout, show_default=True,
    help="Seconds in-flight batches get to finish on SIGTERM or SIGINT.",
)  # fmt: skip
@click.option(
    "--activity-interval",
    default=_DEFAULTS.activity_interval,
    show_default=True,
    help="Seconds between writes of the relay's activity for the console; 0: none.",
)
@click.option(
    "--http",
    default=None,
    envvar="RELAYBOX_HTTP",
    metavar="HOST:PORT",
    help="Serve /metrics, /api/outbox, /healthz and /readyz there (e.g. 127.0.0.1:9464).",
)
@click.option(
    "--opentelemetry",
    is_flag=True,
    help="Trace each publish and report the metrics through the OpenTelemetry providers "
    "this process was given (by opentelemetry-instrument, say); needs relaybox[tracing].",
)
@click.option(
    "--setup-topology",
    is_flag=True,
    help="First create what each target's URL says it needs on its broker, as "
    "`relaybox setup` does.",
)
@click.option(
    "--loop",
    type=click.Choice(loops.LOOPS),
    default="auto",
    show_default=True,
    help="The event loop: auto takes uvloop where it is installed (relaybox installs it "
    "off Windows), asyncio's own loop otherwise.",
)
@click.option("--max-seconds", type=float, default=None, help="Stop after this long.")
@click.option(
    "--log-level", default="INFO", show_default=True,
    help="The level of the log lines the command prints.",
)  # fmt: skip
def relay(
    databases: tuple[str, ...], db_files: tuple[str, ...], brokers: tuple[str, ...],
    broker_files: tuple[str, ...], table: str, mode: str, batch_size: int,
    max_in_flight: int | None, lease_seconds: float, publish_timeout: float, partitions: int,
    no_partition_leases: bool, retry_base: float, retry_max: float, retry_jitter: float,
    max_attempts: int, circuit_threshold: int, circuit_open: float, circuit_max_open: float,
    idle_interval: float, fast_poll_window: float, fast_poll_interval: float, no_listen: bool,
    max_claim_bytes: int,
    published_retention: float, abandoned_retention: float, hold_keys: bool,
    cleanup_interval: float, shutdown_timeout: float, activity_interval: float,
    http: str | None, opentelemetry: bool, setup_topology: bool, loop: str,
    max_seconds: float | None, log_level: str,
) -> None:  # fmt: skip
    """Deliver committed outbox messages to brokers until SIGTERM or SIGINT.

    Every option may also come from the environment (RELAYBOX_<OPTION>, e.g.
    RELAYBOX_BATCH_SIZE) or the [relay] section of a TOML file (--config). Database and
    broker URLs may come from the environment (RELAYBOX_DB, RELAYBOX_BROKER) or from
    files (--db-file, --broker-file) instead of the command line, where every user of
    the machine can read them; of a URL option and its file option, only those from the
    nearest source count (the command line, the environment, then the file)."""
    catch_early_signals()  # until the event loop takes over
    logs = urls.masked_logging(log_level)
    ctx = click.get_current_context()
    try:
        settings = _settings(ctx, lambda: RelaySettings(
            batch_size=batch_size, max_in_flight=max_in_flight, lease_seconds=lease_seconds,
            publish_timeout=publish_timeout, partitions=partitions,
            partition_leases=not no_partition_leases, max_claim_bytes=max_claim_bytes,
            retry=RetryPolicy(base_delay=retry_base, max_delay=retry_max, jitter=retry_jitter,
                              max_attempts=max_attempts),
            circuit=CircuitPolicy(failure_threshold=circuit_threshold, open_seconds=circuit_open,
                                  max_open_seconds=max(circuit_open, circuit_max_open)),
            idle_interval=idle_interval,
            min_poll_interval=min(_DEFAULTS.min_poll_interval, idle_interval),
            fast_poll_window=fast_poll_window,
            fast_poll_interval=min(fast_poll_interval, idle_interval),
            listen=not no_listen,
            published_retention=published_retention, abandoned_retention=abandoned_retention,
            cleanup_interval=cleanup_interval, shutdown_timeout=shutdown_timeout,
            hold_keys=hold_keys,
            activity_interval=activity_interval or None,
        ))  # fmt: skip
        address = None
        if http is not None:  # fails before anything starts
            from relaybox.observability.http import parse_address

            address = parse_address(http)
        chosen = nearest(ctx, {"databases": databases, "db_files": db_files})
        databases, db_files = chosen["databases"], chosen["db_files"]
        chosen = nearest(ctx, {"brokers": brokers, "broker_files": broker_files})
        brokers, broker_files = chosen["brokers"], chosen["broker_files"]
        database_urls = urls.databases(databases, db_files)
        broker_urls = urls.brokers(brokers, broker_files)
        logs.hide([*database_urls, *broker_urls.values()])
        if setup_topology:
            for line in loops.run(set_up(broker_urls), loop=loop):
                output.line(f"setup {line}")
        relay_class: type[Relay] = Relay
        if mode == "log":
            from relaybox.relay.log_stream import LogRelay

            relay_class = LogRelay
        engine = relay_class(database_urls, broker_urls, table=table, settings=settings)
        if opentelemetry:
            from relaybox.observability.otel import instrument_relay

            instrument_relay(engine)
        loops.run_relay(serve(engine, max_seconds=max_seconds, http=address), loop=loop)
    except RelayboxError as exc:
        raise output.Failure(str(exc)) from exc
