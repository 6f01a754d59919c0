"""Every ```python block of the pages under docs/ is executed here, or says why not.

A page's blocks run in order in one namespace, as a reader would type them, each page on
its own: SQLite files under the test's directory, the `memory://` broker, and PostgreSQL
in a schema of the test's own where the page's example needs psycopg. A page's setup
(`SETUPS`) supplies what the page leaves to the reader (`DSN`, `DB_URL`, a handler) and
may swap a literal URL for a local one; a swap the page no longer needs fails the test,
and so does a check the setup makes once the page has run.

A block that is not run carries a marker on the line before it, so none is passed over
silently:

- `<!-- excerpt: examples/PATH -->`: the block is copied from that file, which a test
  runs; it must appear there verbatim.
- `<!-- fragment: WHY -->`: a piece of a larger program (the application's own models,
  a connection opened elsewhere, `...` where the application's code goes), or a
  signature rather than code.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import dataclasses
import decimal
import inspect
import re
import sys
import types
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from relaybox.migrations import migrate
from tests.databases import PG_URL, sqlite_url, unique_table

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FENCE = "```python"
EXCERPT = re.compile(r"<!-- excerpt: (\S+) -->")
FRAGMENT = re.compile(r"<!-- fragment: (\S.*?) -->")


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
    """One ```python block of a page, with the marker on the line before it, if any."""

    page: str
    line: int
    code: str
    excerpt: str | None
    fragment: str | None

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"


def blocks(page: str, path: Path | None = None) -> list[Block]:
    """The python blocks of `page` (docs/PAGE, or the file at `path`), in order."""
    lines = (path or DOCS / page).read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    for number, line in enumerate(lines):
        if line.strip() != FENCE:
            continue
        end = next(i for i in range(number + 1, len(lines)) if lines[i].strip() == "```")
        before = next((text for text in reversed(lines[:number]) if text.strip()), "")
        excerpt, fragment = EXCERPT.fullmatch(before), FRAGMENT.fullmatch(before)
        found.append(
            Block(
                page=page,
                line=number + 1,
                code="\n".join(lines[number + 1 : end]) + "\n",
                excerpt=excerpt.group(1) if excerpt else None,
                fragment=fragment.group(1) if fragment else None,
            )
        )
    return found


PAGES = sorted(
    page
    for page in (path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))
    if blocks(page)
)


def _compile(block: Block, code: str) -> Any:
    return compile(code, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


def _run(block: Block, code: str, namespace: dict[str, Any]) -> None:
    """Run the block; one with a top-level `await` or `async with` on an event loop."""
    compiled = _compile(block, code)
    if compiled.co_flags & inspect.CO_COROUTINE:
        asyncio.run(eval(compiled, namespace))
    else:
        exec(compiled, namespace)


@dataclasses.dataclass(slots=True)
class Setting:
    """What a page's setup gives its blocks: names to start from, literals to swap."""

    namespace: dict[str, Any] = dataclasses.field(default_factory=dict)
    swaps: dict[str, str] = dataclasses.field(default_factory=dict)


Setup = Callable[[Path], contextlib.AbstractContextManager[Setting]]


def _sqlite(path: Path, table: str | None = None) -> str:
    url = sqlite_url(path)
    asyncio.run(migrate(url, table=table))
    return url


@contextlib.contextmanager
def getting_started(tmp_path: Path) -> Iterator[Setting]:
    """The psycopg example on PostgreSQL, in a schema of its own (its `Outbox()` writes
    to the default table name); the relay examples on SQLite and the memory broker."""
    schema = unique_table("docs")
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        asyncio.run(migrate(PG_URL, table=f"{schema}.relaybox_outbox"))
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {schema}.orders (id bigint PRIMARY KEY, total numeric)")
        database = _sqlite(tmp_path / "shop.db")
        yield Setting(
            namespace={
                "psycopg": psycopg,
                "DSN": f"{PG_URL}?options=-csearch_path%3D{schema}",
                "order_id": 42,
                "total": decimal.Decimal("129.90"),
                "DB_URL": database,
                "BROKER_URL": "memory://",
            },
            swaps={"postgresql://localhost/shop": database, "nats://localhost:4222": "memory://"},
        )
        with psycopg.connect(PG_URL) as conn:
            rows = conn.execute(f"SELECT topic, key FROM {schema}.relaybox_outbox").fetchall()
        assert rows == [("orders", "42")]
    finally:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


@contextlib.contextmanager
def django(tmp_path: Path) -> Iterator[Setting]:
    """The consumer's handler is the reader's."""
    yield Setting(namespace={"handle": lambda message, connection: None})


@contextlib.asynccontextmanager
async def _transaction() -> AsyncIterator[None]:
    """Stands for the consumer's transaction, which the page's first example makes."""
    yield None


@contextlib.contextmanager
def inbox(tmp_path: Path) -> Iterator[Setting]:
    """The first example only defines `main`: tests/inbox/test_docs_example.py runs it
    (an embedded NATS server) and checks what it returns. The typed handler's block
    needs the transaction the first example makes inside `main`."""
    yield Setting(namespace={"dataclasses": dataclasses, "transaction": _transaction})


@contextlib.contextmanager
def observability(tmp_path: Path) -> Iterator[Setting]:
    """The relay's database, its broker and the consumer's parts are the reader's."""
    from relaybox import Consumer, Inbox, Relay
    from relaybox.consumers.nats import NatsConsumer

    yield Setting(
        namespace={
            "Relay": Relay,
            "Consumer": Consumer,
            "NatsConsumer": NatsConsumer,
            "database_url": _sqlite(tmp_path / "shop.db"),
            "broker_url": "nats://127.0.0.1:4222",
            "handler": lambda message, connection: None,
            "inbox": Inbox(consumer="docs"),
            "begin": _transaction,
        }
    )


async def _served(app: Any, path: str) -> int:
    """The status of a GET of `path` from `app`, inside the application's lifespan."""
    import httpx

    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client,
    ):
        return (await client.get(path)).status_code


@contextlib.contextmanager
def operations(tmp_path: Path) -> Iterator[Setting]:
    """The console mounted in a FastAPI application: its lifespan opens the table and
    the mounted console answers."""
    setting = Setting(
        namespace={
            "DATABASE_URL": _sqlite(tmp_path / "shop.db", table="outbox"),
            "CONSOLE_TOKEN": "a-console-token-of-the-docs",
        }
    )
    yield setting
    assert asyncio.run(_served(setting.namespace["app"], "/ops/")) == 200


SETUPS: dict[str, Setup] = {
    "getting-started.md": getting_started,
    "django.md": django,
    "inbox.md": inbox,
    "observability.md": observability,
    "operations.md": operations,
}


@contextlib.contextmanager
def _nothing(tmp_path: Path) -> Iterator[Setting]:
    yield Setting()


@contextlib.contextmanager
def _module(page: str) -> Iterator[dict[str, Any]]:
    """A module for the page's blocks to run in (a dataclass looks its module up), and
    gone again afterwards."""
    module = types.ModuleType("docs_" + re.sub(r"\W", "_", page.removesuffix(".md")))
    sys.modules[module.__name__] = module
    try:
        yield module.__dict__
    finally:
        del sys.modules[module.__name__]


def _swapped(code: str, swaps: dict[str, str]) -> str:
    for old, new in swaps.items():
        code = code.replace(old, new)
    return code


@pytest.mark.parametrize("page", PAGES)
def test_every_python_block_runs_or_says_why_not(page: str, tmp_path: Path) -> None:
    found = blocks(page)
    with SETUPS.get(page, _nothing)(tmp_path) as setting, _module(page) as namespace:
        namespace.update(setting.namespace)
        for old in setting.swaps:
            assert any(old in block.code for block in found), f"{page} no longer has {old!r}"
        for block in found:
            if block.excerpt is not None:
                source = (ROOT / block.excerpt).read_text(encoding="utf-8")
                assert block.code in source, f"{block.where} is not in {block.excerpt}"
            elif block.fragment is None:
                _run(block, _swapped(block.code, setting.swaps), namespace)
        setting.namespace.update(namespace)  # what the page made, for the setup's checks


def test_a_block_without_a_marker_is_run(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- fragment: the reader's own connection -->\n\n"
        f"{FENCE}\nconn.execute(...)\n```\n\n"
        f"{FENCE}\nimport json\n```\n\n"
        "<!-- excerpt: examples/testing/shop.py -->\n"
        f"{FENCE}\nimport sqlite3\n```\n",
        encoding="utf-8",
    )
    fragment, plain, excerpt = blocks("page.md", page)
    assert (fragment.fragment, fragment.excerpt) == ("the reader's own connection", None)
    assert (plain.fragment, plain.excerpt, plain.code) == (None, None, "import json\n")
    assert (excerpt.excerpt, excerpt.line) == ("examples/testing/shop.py", 12)
