"""The NOTIFY channel's name, the INSERT variants that carry it, the writer's option."""

from __future__ import annotations

import re

import pytest

from relaybox import ConfigurationError, InvalidTableNameError, Message, Outbox, sql
from relaybox.core.identifiers import notify_channel
from relaybox.sql.inserts import inserts


@pytest.mark.parametrize(
    ("table", "channel"),
    [("relaybox_outbox", "relaybox_relaybox_outbox"), ("app.outbox", "relaybox_app__outbox")],
)
def test_channel_names(table: str, channel: str) -> None:
    assert notify_channel(table) == channel


def test_the_longest_table_names_still_give_a_valid_distinct_channel() -> None:
    longest = "s" * 31 + "." + "t" * 41
    other = "s" * 31 + "." + "t" * 40 + "u"
    assert len(notify_channel(longest)) == 63  # pg_notify rejects longer channel names
    assert re.fullmatch(r"[a-z0-9_]+", notify_channel(longest))
    assert notify_channel(longest) != notify_channel(other)
    assert notify_channel(longest) == notify_channel(longest)  # stable across processes


def test_a_bad_table_name_gives_no_channel() -> None:
    with pytest.raises(InvalidTableNameError):
        notify_channel('x"; DROP TABLE y')


@pytest.mark.parametrize(
    "name", ["insert_one", "insert_one_now", "insert_one_basic", "insert_many"]
)
def test_the_notify_variants_differ_only_by_the_notify(name: str) -> None:
    queries = sql.queries("postgresql", "t")
    without = re.sub(r", pg_notify\(\$\d+::text, ''\)( AS woke)?", "", queries[name + "_notify"])
    assert without == queries[name]


def test_inserts_pass_the_channel_last_and_only_on_postgresql() -> None:
    rows = Outbox(table="t").rows([_message(), _message()])[1]
    for style in ("numeric_dollar", "format"):
        for batch in (rows, rows[:1]):
            (statement,) = inserts("postgresql", "t", style, batch, notify="relaybox_t")
            assert "pg_notify" in statement.query
            assert list(statement.params).count("relaybox_t") == 1
    (many,) = inserts("postgresql", "t", "numeric_dollar", rows, notify="relaybox_t")
    assert many.params[17] == "relaybox_t"  # $18
    assert all("pg_notify" not in s.query for s in inserts("postgresql", "t", "format", rows))
    assert all("pg_notify" not in s.query for s in inserts("sqlite", "t", "qmark", rows))


@pytest.mark.parametrize(("notify", "interval"), [(True, 0.05), (False, None), (0, 0.0), (2, 2.0)])
def test_the_notify_option(notify: bool | float, interval: float | None) -> None:
    assert Outbox(notify=notify).notify_interval == interval
    assert Outbox().notify_interval is None  # off unless asked for: see Outbox's docstring


@pytest.mark.parametrize("notify", [-1, float("nan"), "yes"])
def test_a_bad_notify_option_is_refused(notify: object) -> None:
    with pytest.raises(ConfigurationError):
        Outbox(notify=notify)  # type: ignore[arg-type]


def test_the_debounce_lets_one_add_per_interval_through() -> None:
    outbox = Outbox(notify=60)
    assert outbox._take_notify("postgresql") == outbox.notify_channel
    assert outbox._take_notify("postgresql") is None
    assert outbox._take_notify("mysql") is None
    outbox._give_back_notify(outbox.notify_channel)  # its statement failed
    assert outbox._take_notify("postgresql") == outbox.notify_channel


def _message() -> Message:
    return Message(topic="t", key="k", payload={})
