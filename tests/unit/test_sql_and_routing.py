from __future__ import annotations

import re
import uuid
from typing import Any

import pytest

import relaybox
from relaybox import InvalidTableNameError, Message, Target, UnknownTargetError, sql
from relaybox.core.identifiers import validate_table_name
from relaybox.core.partitions import key_lock_id, partition_and_lock, partition_for
from relaybox.core.records import Routing
from relaybox.sql.inserts import basic_insert, inserts
from relaybox.sql.params import restyle_with_order, row_params
from relaybox.storage.urls import DatabaseUrl


@pytest.mark.parametrize("name", ["outbox", "app.outbox", "_x1"])
def test_valid_table_names(name: str) -> None:
    assert validate_table_name(name) == name


@pytest.mark.parametrize("name", ["", "Outbox", "a;drop", "a.b.c", "1abc", "x" * 42, "a b"])
def test_invalid_table_names(name: str) -> None:
    with pytest.raises(InvalidTableNameError):
        validate_table_name(name)
    with pytest.raises(InvalidTableNameError):
        relaybox.Outbox(table=name)


def test_restyle_between_parameter_styles() -> None:
    assert restyle_with_order("a = $1 AND b LIKE '5%' AND c = $2", "numeric_dollar", "format") == (
        "a = %s AND b LIKE '5%%' AND c = %s",
        (0, 1),
    )
    assert restyle_with_order("x = %s, y = '%%'", "format", "qmark") == ("x = ?, y = '%'", (0,))
    assert restyle_with_order("x = ?, y = ?", "qmark", "numeric_dollar")[0] == "x = $1, y = $2"
    assert restyle_with_order("$2, $1", "numeric_dollar", "qmark") == ("?, ?", (1, 0))


@pytest.mark.parametrize("dialect", sql.DIALECTS)
def test_every_dialect_has_the_queries_the_code_uses(dialect: sql.Dialect) -> None:
    queries = sql.queries(dialect, "t")
    names = set(queries)
    # A placeholder in a comment would be counted as a parameter by positional drivers.
    assert not [
        n for n, q in queries.items() if any(ln.lstrip().startswith("--") for ln in q.splitlines())
    ]
    assert "insert_one" in names
    assert (
        {"insert_many"} if dialect == "postgresql" else {"insert_values", "insert_row"}
    ) <= names
    assert sql.migrations(dialect, "t")[0][0] == 1
    assert "CREATE TABLE" in sql.schema(dialect, "my_outbox")


def test_the_functions_a_table_brings_are_read_off_its_schema() -> None:
    found = sql.functions("postgresql", "my_outbox")
    assert sorted(found) == sorted(re.findall(r"FUNCTION (my_outbox_\w+)\(", sql.schema(
        "postgresql", "my_outbox")))  # fmt: skip
    assert {"my_outbox_claim", "my_outbox_heartbeat", "my_outbox_read_past"} <= set(found)
    assert sql.functions("sqlite", "my_outbox") == sql.functions("mysql", "my_outbox") == []


def test_rows_one_per_target_with_stable_partitions() -> None:
    routing = Routing.of(["events", Target("partner", external=True)], ["events"])
    message = Message(topic="t", key="customer-1", targets=["events", "partner"])
    rows = routing.rows([message, Message(topic="t")])
    assert [(r[1], r[2]) for r in rows] == [("events", False), ("partner", True), ("events", False)]
    assert rows[0][5] == rows[1][5] == partition_for("customer-1", message.id)
    assert partition_for("customer-1", uuid.uuid4()) == rows[0][5]  # key, not id, decides
    assert 0 <= rows[2][5] < 2**31
    with pytest.raises(UnknownTargetError, match="known targets: events, partner"):
        routing.rows([Message(topic="t", targets=["elsewhere"])])
    with pytest.raises(UnknownTargetError):
        Routing.of(["a"], ["b"])


def test_the_stored_hash_keeps_the_former_partitions_of_the_default_count() -> None:
    """Rows written before the hash was stored hold crc32 % 64; relays now take the
    stored hash modulo their count, which agrees for every count dividing 64."""
    import zlib

    from relaybox.core.partitions import partition_of

    for key in ("customer-1", "k", "order-123456"):
        former = zlib.crc32(key.encode()) % 64
        stored = partition_for(key, uuid.uuid4())
        for count in (1, 2, 8, 16, 64):
            assert partition_of(former, count) == partition_of(stored, count)


def test_row_params_per_dialect() -> None:
    (row,) = Routing().rows([Message(topic="t", delay=1.5)])
    assert row_params("postgresql", row) == row
    mysql = row_params("mysql", row)
    assert mysql[0] == str(row[0])
    assert mysql[2] == 0
    assert mysql[-1] == 1_500_000
    assert mysql[14].tzinfo is None
    sqlite = row_params("sqlite", row)
    assert isinstance(sqlite[14], str)
    assert sqlite[-1] == 1.5


def test_database_urls() -> None:
    url = DatabaseUrl.parse("postgresql+psycopg://u:s%40cret@db:5433/app")
    assert (url.dialect, url.driver, url.host, url.port, url.password) == (
        "postgresql",
        "psycopg",
        "db",
        5433,
        "s@cret",
    )
    assert "s%40cret" not in url.masked
    assert "***" in url.masked
    assert url.libpq_dsn().startswith("postgresql://")
    assert DatabaseUrl.parse("sqlite:///rel/x.db").database == "rel/x.db"
    assert DatabaseUrl.parse("sqlite:////abs/x.db").database == "/abs/x.db"
    with pytest.raises(relaybox.ConfigurationError, match="unsupported"):
        DatabaseUrl.parse("oracle://x")


def test_public_surface() -> None:
    exported = set(relaybox.__all__)
    assert {"Outbox", "Message", "Target", "RelayboxError", "Storage", "Status"} <= exported
    assert all(hasattr(relaybox, name) for name in exported)
    public = {n for n in vars(relaybox) if not n.startswith("_") and n[0].isupper()}
    assert public <= exported, public - exported


def test_schema_qualified_names_where_the_dialect_has_schemas() -> None:
    assert "CREATE TABLE IF NOT EXISTS app.outbox" in sql.schema("postgresql", "app.outbox")
    assert "app_outbox_keyed_ix" in sql.schema("postgresql", "app.outbox")
    with pytest.raises(InvalidTableNameError, match="plain name"):
        sql.schema("sqlite", "app.outbox")


@pytest.mark.parametrize(
    ("targets", "defaults", "match"),
    [
        (["a"], [], "at least one"),
        (["a"], ["a", "a"], "twice"),
        (["a", "a"], None, "twice"),
    ],
)
def test_routing_rejects_settings_that_would_lose_or_duplicate_messages(
    targets: list[str], defaults: list[str] | None, match: str
) -> None:
    with pytest.raises(relaybox.ConfigurationError, match=match):
        relaybox.Outbox(targets=targets, default_targets=defaults)


def test_relay_settings_reject_a_partition_count_below_one() -> None:
    with pytest.raises(relaybox.ConfigurationError, match="positive"):
        relaybox.RelaySettings(partitions=0)


def test_restyle_reorders_repeated_numbered_parameters() -> None:
    text, order = restyle_with_order("f($5) AND a = $1 AND e = $5", "numeric_dollar", "format")
    assert text == "f(%s) AND a = %s AND e = %s"
    assert order == (4, 0, 4)
    same, identity = restyle_with_order("a = $1, b = $2", "numeric_dollar", "numeric_dollar")
    assert same == "a = $1, b = $2"
    assert identity == (0, 1)


def test_one_table_spelt_two_ways_takes_the_same_locks() -> None:
    from relaybox.core.partitions import claim_lock_key, key_lock_id

    assert key_lock_id("outbox", "k") == key_lock_id("public.outbox", "k")
    assert key_lock_id("outbox", "k") == key_lock_id("OUTBOX", "k")
    assert claim_lock_key("outbox") == claim_lock_key("public.Outbox")
    assert key_lock_id("outbox", "k") != key_lock_id("outbox", "j")
    assert key_lock_id("outbox", "k") != key_lock_id("events", "k")


@pytest.mark.parametrize(
    ("fields", "name", "count"),
    [
        ({}, "insert_one_basic", 10),
        ({"headers": {"h": "v"}}, "insert_one_now", 16),
        ({"correlation_id": "c"}, "insert_one_now", 16),
        ({"aggregate_id": "a"}, "insert_one_now", 16),
        ({"targets": ["partner"]}, "insert_one_now", 16),  # an external target
        ({"delay": 1}, "insert_one", 17),
    ],
)
def test_postgresql_leaves_out_only_columns_at_their_defaults(
    fields: dict[str, Any], name: str, count: int
) -> None:
    routing = Routing.of(["default", Target("partner", external=True)], ["default"])
    rows = routing.rows([Message(topic="t", key="k", **fields)])
    (statement,) = inserts("postgresql", "t", "numeric_dollar", rows)
    assert statement.query == sql.queries("postgresql", "t")[name]
    assert len(statement.params) == count
    assert statement.params[-1] == key_lock_id("t", "k")  # the key lock, always last


@pytest.mark.parametrize("fields", [{}, {"headers": {"h": "v"}}, {"delay": 1}])
def test_text_values_carry_the_same_id_partition_and_lock(fields: dict[str, Any]) -> None:
    rows = Routing().rows([Message(topic="t", key="k", **fields)])
    (typed,) = inserts("postgresql", "t", "format", rows)
    (text,) = inserts("postgresql", "t", "format", rows, text_values=True)
    assert text.query == typed.query
    assert uuid.UUID(text.params[0]) == typed.params[0]
    assert [type(p) for p in text.params if type(p) in (int, uuid.UUID)] == []
    assert [str(p) for p in typed.params[1:]] == [str(p) for p in text.params[1:]]


@pytest.mark.parametrize("style", ["numeric_dollar", "format"])
@pytest.mark.parametrize("notify", [None, "relaybox_t"])
@pytest.mark.parametrize("text_values", [False, True])
@pytest.mark.parametrize(
    ("fields", "basic"),
    [({}, True), ({"key": None}, True), ({"payload": b"\x00raw"}, True),
     ({"headers": {"h": "v"}}, False), ({"tenant_id": "t"}, False),
     ({"correlation_id": "c"}, False), ({"causation_id": "u"}, False),
     ({"aggregate_id": "a"}, False), ({"delay": 2}, False)],
)  # fmt: skip
def test_basic_insert_is_the_statement_inserts_makes_from_the_row(
    style: Any, notify: str | None, text_values: bool, fields: dict[str, Any], basic: bool
) -> None:
    message = Message(topic="t", **{"key": "k", **fields})
    made = basic_insert("t", style, message, "default", notify, text_values)
    (row,) = Routing.of(["default"], None).rows([message])
    (expected,) = inserts("postgresql", "t", style, [row], notify=notify, text_values=text_values)
    assert made == (expected if basic else None)  # None: the writer takes the general path


@pytest.mark.parametrize("key", ["k", "order-42", "ключ", None])
def test_partition_and_lock_agree_with_their_separate_functions(key: str | None) -> None:
    message_id = uuid.uuid4()
    assert partition_and_lock("app.outbox", key, message_id) == (
        partition_for(key, message_id),
        key_lock_id("app.outbox", key),
    )
