"""`relaybox messages`, `show`, and the changes an operator makes to messages:
`replay`, `discard`, `delay`, `expedite`, `hold` and `release`.

Every command calls relaybox.operations.messages, as the console does, so the two never
disagree. A change takes the seqs given, or every message a filter matches (`--all`
with no other filter: every message the change applies to); `--dry-run` says how many
rows and which keys it would touch and changes nothing. Each change is audited with who
made it (`--by`) and why (`--reason`). A command exits 1 when nothing matched.
"""

from __future__ import annotations

import asyncio
import datetime
import getpass
import sys
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import click

from relaybox.cli import output
from relaybox.cli.urls import database_option
from relaybox.core.identifiers import DEFAULT_TABLE
from relaybox.core.inspection import (
    MAX_PAGE,
    MAX_SEQ,
    AuditAction,
    Change,
    MessageFilter,
    MessageState,
    MessageSummary,
)
from relaybox.errors import ConfigurationError, RelayboxError
from relaybox.operations import views
from relaybox.operations.messages import APPLIES_TO, Operations, Outcome, Plan

T = TypeVar("T")
Command = Callable[..., Any]

_DB = database_option()
_TABLE = click.option("--table", default=DEFAULT_TABLE, show_default=True, help="Outbox table.")
_JSON = click.option("--json", "as_json", is_flag=True, help="Print JSON.")
_SEQ = click.IntRange(1, MAX_SEQ)
_STATES = [state.value for state in MessageState]


def _run(work: Callable[[Operations], Awaitable[T]], db_url: str, table: str) -> T:
    async def opened() -> T:
        async with Operations.opened(db_url, table) as operations:
            return await work(operations)

    return _sync(opened())


def _sync(work: Coroutine[Any, Any, T]) -> T:
    try:
        return asyncio.run(work)
    except RelayboxError as exc:
        raise output.Failure(str(exc)) from exc


def _when(text: str | None, name: str) -> datetime.datetime | None:
    """An ISO 8601 time; one without a zone is taken as UTC."""
    if text is None:
        return None
    try:
        value = datetime.datetime.fromisoformat(text)
    except ValueError as exc:
        raise click.BadParameter(f"{text!r} is not an ISO 8601 time", param_hint=name) from exc
    return value if value.tzinfo is not None else value.replace(tzinfo=datetime.UTC)


def _id(text: str | None) -> uuid.UUID | None:
    if text is None:
        return None
    try:
        return uuid.UUID(text)
    except ValueError as exc:
        raise click.BadParameter(f"{text!r} is not a UUID", param_hint="--id") from exc


_FILTERS = (
    click.option("--state", "states", multiple=True, type=click.Choice(_STATES),
                 help="Only messages in this state (repeat for several)."),
    click.option("--target", default=None, help="Only this target's."),
    click.option("--topic", default=None, help="Only this topic's."),
    click.option("--key", default=None, help="Only this key's."),
    click.option("--type", "type_", default=None, help="Only this message type."),
    click.option("--id", "id_", default=None, help="Only the message with this id."),
    click.option("--correlation-id", default=None),
    click.option("--causation-id", default=None),
    click.option("--tenant-id", default=None),
    click.option("--aggregate-id", default=None),
    click.option("--min-seq", type=_SEQ, default=None, help="Seqs from this one."),
    click.option("--max-seq", type=_SEQ, default=None, help="Seqs up to this one."),
    click.option("--since", default=None, help="Written at or after (ISO 8601; UTC if no zone)."),
    click.option("--until", default=None, help="Written at or before (ISO 8601)."),
)  # fmt: skip


def _filters(command: Command) -> Command:
    for option in reversed(_FILTERS):
        command = option(command)
    return command


def _filter(options: dict[str, Any]) -> MessageFilter:
    """The filter the options give; pops them from `options`."""
    try:
        return MessageFilter(
            states=frozenset(MessageState(s) for s in options.pop("states")),
            target=options.pop("target"), topic=options.pop("topic"), key=options.pop("key"),
            type=options.pop("type_"), id=_id(options.pop("id_")),
            correlation_id=options.pop("correlation_id"),
            causation_id=options.pop("causation_id"), tenant_id=options.pop("tenant_id"),
            aggregate_id=options.pop("aggregate_id"), min_seq=options.pop("min_seq"),
            max_seq=options.pop("max_seq"), since=_when(options.pop("since"), "--since"),
            until=_when(options.pop("until"), "--until"),
        )  # fmt: skip
    except ConfigurationError as exc:
        raise click.UsageError(str(exc)) from exc


def _line(m: MessageSummary) -> str:
    when = m.created_at.strftime("%Y-%m-%d %H:%M:%S")
    return (f"{m.seq:>10}  {m.state.value:<9}  {when}  {m.target}  {m.topic}  key={m.key}  "
            f"type={m.type}  attempts={m.attempts}")  # fmt: skip


@click.command()
@_DB
@_TABLE
@_JSON
@_filters
@click.option("--order", type=click.Choice(["newest", "oldest"]), default="newest",
              show_default=True)  # fmt: skip
@click.option("--limit", type=click.IntRange(1, MAX_PAGE), default=20, show_default=True)
@click.option("--after", type=_SEQ, default=None, help="The page past this seq (a cursor).")
def messages(
    db_url: str, table: str, as_json: bool, order: str, limit: int, after: int | None,
    **options: Any,
) -> None:  # fmt: skip
    """Find messages, live and finished, by state, target, topic, key, type, ids, seq or
    time. Pages follow seq order: the last line gives the --after of the next page.
    Exits 1 when nothing matched."""
    where = _filter(options)
    page = _run(
        lambda ops: ops.search(where, limit=limit, after=after, newest_first=order == "newest"),
        db_url, table,
    )  # fmt: skip
    if as_json:
        output.json({"messages": [views.summary(m) for m in page.messages],
                     "next_after": page.next_after})  # fmt: skip
    else:
        for m in page.messages:
            output.line(_line(m))
            if m.last_error:
                output.line(f"{'':>12}{m.last_error}")
        if page.next_after is not None:
            output.line(f"more: --after {page.next_after}")
    if not page.messages:
        if not as_json:
            output.line("no message matched", err=True)
        sys.exit(1)


@click.command()
@_DB
@_TABLE
@_JSON
@click.argument("seq", type=_SEQ)
def show(db_url: str, table: str, as_json: bool, seq: int) -> None:
    """One message in full: envelope, headers, payload, attempts, last error, and its
    place in its key's queue. Exits 1 when there is no such message."""
    view = _run(lambda ops: ops.show(seq), db_url, table)
    if view is None:
        raise output.Failure(f"no message with seq {seq} in {table}")
    shown = views.message(view)
    if as_json:
        output.json(shown)
        return
    skip = {"headers", "payload", "queue"}
    for name, value in shown.items():
        if name not in skip:
            output.line(f"{name:<15} {'-' if value is None else value}")
    output.line("headers")
    for name, value in shown["headers"].items():
        output.line(f"  {name}: {value}")
    body = shown["payload"]
    size = f"{body['size']} bytes{', cut' if body['truncated'] else ''}"
    output.line(f"payload ({body['content_type']}, {body['kind']}, {size})")
    output.lines(body["text"])
    queue = view.queue
    if queue is None:
        output.line("no key: it waits for no message and holds none back")
        return
    output.line(f"waits for ({len(queue.ahead)}):")
    for m in queue.ahead:
        output.line("  " + _line(m))
    more = " and more" if queue.more_behind else ""
    output.line(f"waiting behind it ({len(queue.behind)}{more}):")
    for m in queue.behind:
        output.line("  " + _line(m))
    if queue.published_after:
        output.line(f"later messages of its key already published ({len(queue.published_after)}):")
        for m in queue.published_after:
            output.line("  " + _line(m))


# -- changes -------------------------------------------------------------------------------

_PAST = {
    AuditAction.REPLAY: "replayed", AuditAction.DISCARD: "discarded",
    AuditAction.DELAY: "delayed", AuditAction.EXPEDITE: "expedited",
    AuditAction.HOLD: "held", AuditAction.RELEASE: "released",
}  # fmt: skip


def _describe(states: frozenset[MessageState]) -> str:
    names = sorted(s.value.replace("_", " ") for s in states)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _progress() -> tuple[Callable[[int, int], None] | None, Callable[[], None]]:
    """A progress bar on the terminal (rich, when installed), shown once the work turns
    out to take more than one page."""
    if not sys.stderr.isatty():
        return None, lambda: None
    try:
        from rich.console import Console
        from rich.progress import Progress
    except ImportError:
        return None, lambda: None
    bar = Progress(console=Console(stderr=True), transient=True)
    task = bar.add_task("working", total=None)
    shown = False

    def update(done: int, total: int) -> None:
        nonlocal shown
        if not shown and total > 500:
            bar.start()
            shown = True
        bar.update(task, completed=done, total=total)

    return update, bar.stop


def _print_plan(plan: Plan, table: str, *, dry_run: bool) -> None:
    verb = plan.action.value
    keys = [f"{target}/{key}" if key is not None else f"{target} (no key)"
            for target, key in plan.keys]  # fmt: skip
    head = f"would {verb}" if dry_run else f"{verb}:"
    output.line(f"{head} {plan.count} message(s) of {len(keys)} key(s) in {table}")
    for key in keys[:20]:
        output.line(f"  {key}")
    if len(keys) > 20:
        output.line(f"  and {len(keys) - 20} more keys")
    if plan.published_ahead:
        output.line(f"already published after them, so consumers saw these first "
                    f"({len(plan.published_ahead)}):")  # fmt: skip
        for m in plan.published_ahead[:20]:
            output.line("  " + _line(m))


def _change(action: AuditAction) -> Callable[[Command], click.Command]:
    """A command that plans `action` over seqs or a filter and carries it out."""

    def make(body: Command) -> click.Command:
        def command(
            db_url: str, table: str, as_json: bool, seqs: tuple[int, ...], every: bool,
            dry_run: bool, yes: bool, by: str | None, reason: str | None, **options: Any,
        ) -> None:  # fmt: skip
            delay = float(options.pop("seconds", 0.0))
            where = _filter(options)
            if seqs and (every or not where.empty):
                raise click.UsageError("give seqs or a filter, not both")
            if not seqs and not every and where.empty:
                raise output.Failure(f"name the seqs of messages to {action.value}, "
                                     "or a filter (--all: every one it applies to)")  # fmt: skip
            selection: list[int] | MessageFilter = list(seqs) if seqs else where
            try:
                change = Change(by or _user(), reason)
            except ConfigurationError as exc:
                raise click.UsageError(str(exc)) from exc
            outcome = _run(
                lambda ops: _carry_out(ops, action, selection, change, table,
                                       dry_run=dry_run, yes=yes or as_json, delay=delay,
                                       quiet=as_json),
                db_url, table,
            )  # fmt: skip
            _report(outcome, table, as_json=as_json, named=len(set(seqs)))

        command.__doc__ = body.__doc__
        command.__name__ = action.value
        decorated: Command = command
        for option in reversed(_CHANGE_OPTIONS):
            decorated = option(decorated)
        decorated = _filters(decorated)
        return click.command(name=action.value)(decorated)

    return make


def _user() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return "relaybox-cli"


_CHANGE_OPTIONS = (
    _DB, _TABLE, _JSON,
    click.argument("seqs", nargs=-1, type=_SEQ),
    click.option("--all", "every", is_flag=True,
                 help="Every message the change applies to (that the filters match)."),
    click.option("--dry-run", is_flag=True, help="Say what would change; change nothing."),
    click.option("--yes", is_flag=True, help="Do not ask before changing by a filter."),
    click.option("--by", default=None, help="Who asks, for the audit [default: the OS user]."),
    click.option("--reason", default=None, help="Why, for the audit."),
)  # fmt: skip


async def _carry_out(
    ops: Operations, action: AuditAction, selection: list[int] | MessageFilter,
    change: Change, table: str, *, dry_run: bool, yes: bool, delay: float, quiet: bool,
) -> Outcome:  # fmt: skip
    plan = await ops.plan(action, selection)
    if dry_run or not plan.count:
        return Outcome(plan, 0, dry_run=dry_run)
    if isinstance(selection, MessageFilter) and not yes:
        if not quiet:
            _print_plan(plan, table, dry_run=True)
        if not click.confirm(f"{action.value.capitalize()} {plan.count} message(s)?"):
            raise output.Failure("nothing changed")
    update, stop = _progress()
    try:
        return await ops.apply(plan, change, delay=delay, progress=update)
    finally:
        stop()


def _report(outcome: Outcome, table: str, *, as_json: bool, named: int) -> None:
    plan = outcome.plan
    if as_json:
        output.json(views.outcome(outcome))
    elif outcome.dry_run:
        _print_plan(plan, table, dry_run=True)
    elif outcome.changed:
        output.line(f"{_PAST[plan.action]} {outcome.changed} message(s)")
    wanted = _describe(APPLIES_TO[plan.action])
    if not plan.count:
        what = "none of the seqs given is" if named else "no message matched that is"
        raise output.Failure(f"nothing {_PAST[plan.action]}: {what} {wanted} in {table}")
    if named and plan.count < named and not as_json:
        output.line(f"{named - plan.count} of the {named} seqs given are not {wanted}", err=True)
    if not outcome.dry_run and outcome.changed < plan.count:
        raise output.Failure(
            f"{plan.count - outcome.changed} of {plan.count} message(s) moved on before the "
            f"change reached them and were left alone"
        )


@_change(AuditAction.REPLAY)
def replay() -> None:
    """Replay abandoned or held messages: pending again under their own seq, with a
    fresh attempt count, so each goes out before the later messages of its key that are
    still waiting. The dry run names the later messages of those keys already published
    (those a retention keeps)."""


@_change(AuditAction.DISCARD)
def discard() -> None:
    """Delete messages for good (any state but in flight), with an audit record; a
    discarded held message lets its key's later messages go."""


@_change(AuditAction.EXPEDITE)
def expedite() -> None:
    """Make pending, delayed or retrying messages due now."""


@_change(AuditAction.HOLD)
def hold() -> None:
    """Hold the keys of the messages given: the first live message of each key waits
    until released, replayed or discarded, and the key's later messages wait behind it."""


@_change(AuditAction.RELEASE)
def release() -> None:
    """Release held messages: due now with a fresh attempt count."""


def _delay_command() -> click.Command:
    base = _change(AuditAction.DELAY)(_delay_doc)
    return click.option(
        "--seconds", type=click.FloatRange(min=0, min_open=True), required=True,
        help="How long from now.",
    )(base)  # fmt: skip


def _delay_doc() -> None:
    """Push pending, delayed or retrying messages back: due --seconds from now (a
    delayed message of a key holds back the key's later ones)."""


delay = _delay_command()


@click.command("backfill")
@_DB
@_TABLE
@_JSON
@_filters
@click.option("--name", required=True, help="The job's name: run again with it to go on.")
@click.option("--to", "to", required=True, help="The target to publish the copies to.")
@click.option("--external", is_flag=True, help="The target is external (stripped envelope).")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=None,
              help="At most this many messages per second.")  # fmt: skip
@click.option("--dry-run", is_flag=True, help="Say what would be copied; copy nothing.")
@click.option("--by", default=None, help="Who asks, for the record [default: the OS user].")
@click.option("--reason", default=None, help="Why, for the record.")
def backfill_command(
    db_url: str, table: str, as_json: bool, name: str, to: str, external: bool,
    rate: float | None, dry_run: bool, by: str | None, reason: str | None, **options: Any,
) -> None:  # fmt: skip
    """Publish retained messages again, in seq order, to a target (one added later, or
    an existing one): the published messages of the filter's --target (and the other
    filters) are copied as new messages to --to. Stopped at any point, it goes on from
    where it was when run again with the same --name, and copies each message once.
    Exits 1 when nothing was left to copy."""
    from relaybox.core.message import Target
    from relaybox.operations.backfill import backfill

    where = _filter(options)
    try:
        change = Change(by or _user(), reason)
        target = Target(to, external=external)
    except RelayboxError as exc:
        raise click.UsageError(str(exc)) from exc

    async def run(ops: Operations) -> Any:
        update, stop = _progress()
        try:
            return await backfill(ops, name, where, target, change, rate=rate,
                                  dry_run=dry_run, progress=update)  # fmt: skip
        finally:
            stop()

    outcome = _run(run, db_url, table)
    plan, job = outcome.plan, outcome.job
    if as_json:
        output.json({
            "name": name, "to": to, "dry_run": outcome.dry_run, "to_copy": plan.count,
            "keys": plan.keys, "keys_live_on_target": plan.keys_live_on_target,
            "copied": outcome.copied, "cursor": None if job is None else job.cursor,
            "finished": job is not None and job.finished_at is not None,
        })  # fmt: skip
    else:
        head = "would copy" if outcome.dry_run else "to copy:"
        output.line(f"{head} {plan.count} message(s) of {plan.keys} key(s) to {to}")
        if plan.keys_live_on_target:
            output.line(f"{len(plan.keys_live_on_target)} of these keys have messages live "
                        f"for {to} now; their copies go out after those:")  # fmt: skip
            for key in plan.keys_live_on_target[:20]:
                output.line(f"  {key}")
        if not outcome.dry_run and job is not None:
            state = "finished" if job.finished_at is not None else "stopped"
            output.line(f"copied {outcome.copied} message(s); {name} {state} at seq "
                        f"{job.cursor}, {job.copied} copied in all")  # fmt: skip
    if not plan.count:
        if not as_json:
            output.line("nothing left to copy", err=True)
        sys.exit(1)
