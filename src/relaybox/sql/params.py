"""Adapting SQL text and row values to a dialect and a driver's parameter style.

relaybox's .sql files use each dialect's native style: `$n` for PostgreSQL, `%s` for
MySQL, `?` for SQLite. A writer joining the caller's connection must speak that
driver's style instead (psycopg wants `%s`, Django's SQLite wrapper `%s`, SQLAlchemy's
asyncpg dialect `$n`), so the text is re-rendered once per style and cached.
"""

from __future__ import annotations

import datetime
import functools
import re
from collections.abc import Sequence
from typing import Any, Literal

from relaybox.core.records import InsertRow

ParamStyle = Literal["numeric_dollar", "format", "pyformat", "qmark"]

_NATIVE_STYLE: dict[str, ParamStyle] = {
    "postgresql": "numeric_dollar",
    "mysql": "format",
    "sqlite": "qmark",
}
_PLACEHOLDER: dict[ParamStyle, re.Pattern[str]] = {
    "numeric_dollar": re.compile(r"\$(\d+)"),
    "format": re.compile(r"%s"),
    "pyformat": re.compile(r"%s"),
    "qmark": re.compile(r"\?"),
}


def native_style(dialect: str) -> ParamStyle:
    return _NATIVE_STYLE[dialect]


@functools.lru_cache(maxsize=256)
def restyle_with_order(
    query: str, source: ParamStyle, target: ParamStyle
) -> tuple[str, tuple[int, ...]]:
    """Re-render `query` for `target`, with the parameter order the new text expects.

    `$n` placeholders may repeat or come out of order; positional styles cannot say
    that, so the caller passes `[params[i] for i in order]` instead of `params`.
    """
    pieces = _PLACEHOLDER[source].split(query)
    if source == "numeric_dollar":  # split keeps the captured numbers
        texts, order = pieces[0::2], tuple(int(n) - 1 for n in pieces[1::2])
    else:
        texts, order = pieces, tuple(range(len(pieces) - 1))
    identity = tuple(range(len(set(order))))
    if source == target:
        return query, identity
    if source in ("format", "pyformat"):
        texts = [text.replace("%%", "%") for text in texts]
    if target == "numeric_dollar":  # numbered: keep the numbering, no reordering needed
        marks = [f"${index + 1}" for index in order]
        return "".join(t + m for t, m in zip(texts, [*marks, ""], strict=True)), identity
    if target in ("format", "pyformat"):
        texts = [text.replace("%", "%%") for text in texts]
    return ("?" if target == "qmark" else "%s").join(texts), order


def styled(query: str, dialect: str, style: ParamStyle) -> tuple[str, tuple[int, ...] | None]:
    """`query` (in `dialect`'s native style) for `style`, with the parameter order it
    needs, or None when the parameters go in as they are (see `in_order`)."""
    text, order = restyle_with_order(query, native_style(dialect), style)
    return text, (None if order == tuple(range(len(order))) else order)


def in_order(params: Sequence[Any], order: tuple[int, ...] | None) -> Sequence[Any]:
    """`params` as a query from `styled` takes them."""
    return params if order is None else [params[i] for i in order]


def row_params(dialect: str, row: InsertRow) -> tuple[Any, ...]:
    """The values of one insert row as `dialect`'s queries.sql `insert_one` expects them.

    PostgreSQL takes native types. MySQL takes the id as text, the flag as an integer,
    a naive UTC datetime and the delay in microseconds; SQLite takes text timestamps
    ('YYYY-MM-DD HH:MM:SS.ffffff', UTC) and the delay in seconds.
    """
    if dialect == "postgresql":
        return row
    (id_, target, external, topic, key, partition, type_, content_type, payload, headers,
     correlation_id, causation_id, tenant_id, aggregate_id, occurred_at, delay) = row  # fmt: skip
    utc = occurred_at.astimezone(datetime.UTC).replace(tzinfo=None)
    occurred: Any
    delay_param: float | int
    if dialect == "mysql":
        occurred, delay_param = utc, round(delay * 1_000_000)
    else:
        occurred, delay_param = utc.strftime("%Y-%m-%d %H:%M:%S.%f"), float(delay)
    return (str(id_), target, int(external), topic, key, partition, type_, content_type,
            payload, headers, correlation_id, causation_id, tenant_id, aggregate_id,
            occurred, delay_param)  # fmt: skip


def moment(dialect: str, when: datetime.datetime) -> Any:
    """A point in time as `dialect`'s queries take it: PostgreSQL an aware datetime,
    MySQL a naive UTC one, SQLite the UTC text its own strftime('%Y-%m-%d %H:%M:%f')
    writes (so that its text compares with the stored times as times do)."""
    utc = when.astimezone(datetime.UTC)
    if dialect == "postgresql":
        return utc
    if dialect == "mysql":
        return utc.replace(tzinfo=None)
    return utc.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
