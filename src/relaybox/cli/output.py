"""Everything the `relaybox` commands print goes through here.

Rows hold text that came from anywhere: keys, topics and headers from the writers,
errors from brokers and receivers. A terminal acts on some characters instead of showing
them (ESC starts a sequence that can retitle the window, clear the screen, rewrite what
was printed or, on some terminals, answer back; a bidi override reorders the rest of the
line), so no character that is not printable reaches it as it is: each is shown as its
Python escape (`\\x1b`, `\\u202e`). A line break inside a value is escaped too, so a
value can never fake a line of the listing. JSON is printed with every non-ASCII
character escaped, which covers the same characters.
"""

from __future__ import annotations

import json as _json
import sys
from collections.abc import Callable
from typing import Any

import click


def printable(text: object) -> str:
    """`text` with every character Python does not count as printable (C0 and C1
    controls, DEL, line and paragraph separators, bidi and other format characters)
    written as its escape."""
    value = str(text)
    if value.isprintable():
        return value
    return "".join(char if char.isprintable() else _escape(char) for char in value)


_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: str) -> str:
    code = ord(char)
    if char in _SHORT:
        return _SHORT[char]
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def line(text: object = "", *, err: bool = False) -> None:
    """Print one line, escaped whole."""
    click.echo(printable(text), err=err)


def lines(text: str) -> None:
    """Print text of several lines, each escaped."""
    for each in text.split("\n"):
        line(each)


def json(value: Any) -> None:
    """Print `value` as indented JSON, with only ASCII characters."""
    click.echo(_json.dumps(value, indent=2, ensure_ascii=True))


class Failure(click.ClickException):
    """A command's error; click prints its message escaped, as `Error: ...`."""

    def format_message(self) -> str:
        return printable(self.message)


def progress() -> tuple[Callable[[int, int], None] | None, Callable[[], None]]:
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
