"""The INSERT statements a writer runs, per dialect, parameter style and row count."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

from relaybox import sql
from relaybox.core.records import InsertRow
from relaybox.sql.params import ParamStyle, native_style, restyle, row_params

#: Rows per multi-row INSERT on MySQL and SQLite (16 parameters each, well under limits).
CHUNK_ROWS = 1000


@dataclasses.dataclass(frozen=True, slots=True)
class Statement:
    query: str
    params: Sequence[Any]


@functools.lru_cache(maxsize=512)
def _text(dialect: str, table: str, style: ParamStyle, name: str, rows: int = 1) -> str:
    queries = sql.queries(dialect, table)
    if name == "insert_values":
        query = queries["insert_values"] + " " + ", ".join([queries["insert_row"]] * rows)
    else:
        query = queries[name]
    return restyle(query, native_style(dialect), style)


def inserts(
    dialect: str, table: str, style: ParamStyle, rows: Sequence[InsertRow]
) -> list[Statement]:
    """The statements that write `rows`: one for a single row, one per chunk for many."""
    if len(rows) == 1:
        row = rows[0]
        if dialect == "postgresql" and not row[-1]:  # no delay: available_at = now()
            return [Statement(_text(dialect, table, style, "insert_one_now"), row[:-1])]
        return [Statement(_text(dialect, table, style, "insert_one"), row_params(dialect, row))]
    if dialect == "postgresql":
        columns = [list(column) for column in zip(*rows, strict=True)]
        return [Statement(_text(dialect, table, style, "insert_many"), columns)]
    statements = []
    for start in range(0, len(rows), CHUNK_ROWS):
        chunk = rows[start : start + CHUNK_ROWS]
        params = [value for row in chunk for value in row_params(dialect, row)]
        statements.append(
            Statement(_text(dialect, table, style, "insert_values", len(chunk)), params)
        )
    return statements
