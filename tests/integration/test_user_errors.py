"""What a user gets wrong, on the real databases: each gives a relaybox error that says
what to do (a one-line message and a non-zero exit on the command line), never a
driver's error or a traceback."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from relaybox import ConfigurationError, Relay, SchemaError
from relaybox.cli.main import main
from relaybox.migrations import migrate
from relaybox.publishers.memory import MemoryPublisher
from relaybox.publishers.options import BrokerUrl
from relaybox.storage import open_storage
from relaybox.storage.urls import DatabaseUrl
from tests.databases import MYSQL_URL, PG_URL, drop, sqlite_url, unique_table


def _cli(*args: str) -> Result:
    result = CliRunner().invoke(main, list(args))
    assert "Traceback" not in result.output + result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)
    return result


# -- a database never migrated --------------------------------------------------------


@pytest.mark.parametrize(
    "url", [PG_URL, PG_URL.replace("postgresql://", "postgresql+psycopg://"), MYSQL_URL, "sqlite"]
)
def test_a_never_migrated_table_is_said_not_to_exist(url: str, tmp_path: Path) -> None:
    if url == "sqlite":
        url = sqlite_url(tmp_path / "empty.db")
        (tmp_path / "empty.db").touch()
    table = unique_table("never")
    with pytest.raises(SchemaError) as raised:
        asyncio.run(open_storage(url, table=table))
    said = str(raised.value)
    assert f"the outbox table {table} (or a table beside it) does not exist" in said
    assert f"relaybox migrate --db {DatabaseUrl.parse(url).masked} --table {table}" in said


# -- SQLite: a path that is not there --------------------------------------------------


@pytest.mark.parametrize("command", ["status", "abandoned"])
def test_a_mistyped_sqlite_path_is_refused_and_no_file_is_made(
    command: str, tmp_path: Path
) -> None:
    typo = tmp_path / "typo.db"
    result = _cli(command, "--db", sqlite_url(typo))
    assert result.exit_code != 0
    assert f"no SQLite database at {typo}" in result.stderr
    assert "relaybox migrate" in result.stderr
    assert not typo.exists()


def test_a_relay_on_a_missing_sqlite_file_refuses_it_and_makes_none(tmp_path: Path) -> None:
    typo = tmp_path / "typo.db"

    async def start() -> None:
        async with Relay(sqlite_url(typo), {"default": MemoryPublisher()}):
            pass

    with pytest.raises(SchemaError, match="no SQLite database"):
        asyncio.run(start())
    assert not typo.exists()


def test_migrate_still_creates_the_sqlite_file(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    assert _cli("migrate", "--db", sqlite_url(path)).exit_code == 0
    assert _cli("status", "--db", sqlite_url(path)).exit_code == 0


def test_a_sqlite_path_with_uri_characters_opens(tmp_path: Path) -> None:
    path = tmp_path / "a dir?#%" / "out box.db"
    path.parent.mkdir()
    assert _cli("migrate", "--db", sqlite_url(path)).exit_code == 0
    result = _cli("status", "--db", sqlite_url(path), "--json")
    assert result.exit_code == 0, result.stderr


# -- URLs ----------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["postgresql", "postgresql+psycopg"])
def test_a_postgresql_url_may_list_several_hosts(scheme: str) -> None:
    """The first host refuses (nothing listens on port 1); the driver goes on to the next."""
    table = unique_table("hosts")
    url = PG_URL.replace("postgresql://", f"{scheme}://").replace(
        "127.0.0.1:5432", "127.0.0.1:1,127.0.0.1:5432"
    )
    assert DatabaseUrl.parse(url).hosts == (("127.0.0.1", 1), ("127.0.0.1", 5432))
    try:
        assert _cli("migrate", "--db", url, "--table", table).exit_code == 0
        result = _cli("status", "--db", url, "--table", table, "--json")
        assert result.exit_code == 0, result.stderr
    finally:
        drop(PG_URL, table)


def test_a_mysql_url_with_several_hosts_is_refused_clearly() -> None:
    result = _cli("status", "--db", "mysql://root:secret@h1:3306,h2:3306/test")
    assert result.exit_code != 0
    assert "names 2 hosts; a mysql URL takes one" in result.stderr
    assert "secret" not in result.stderr


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "soon"])
def test_a_mysql_timeout_that_is_not_a_positive_number_is_refused(value: str) -> None:
    with pytest.raises(ConfigurationError, match=f"connect_timeout='{value}'"):
        DatabaseUrl.parse(f"{MYSQL_URL}?connect_timeout={value}")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1"])
def test_a_broker_option_that_is_not_finite_or_is_negative_is_refused(value: str) -> None:
    for option in ("timeout", "fail_until"):
        with pytest.raises(ConfigurationError, match=f"{option}='{value}'"):
            BrokerUrl(f"nats://127.0.0.1:4222?{option}={value}").number(option, 5.0)


def test_a_url_urllib_cannot_split_is_refused_with_its_password_masked() -> None:
    result = _cli("status", "--db", "postgresql://u:s3cret@[::1/test")
    assert result.exit_code != 0
    assert "bad database URL postgresql://u:***@[::1/test" in result.stderr
    result = _cli("demo", "--orders", "1", "--broker", "nats://u:s3cret@[::1")
    assert result.exit_code != 0
    assert "bad broker URL nats://u:***@[::1" in result.stderr
    assert "s3cret" not in result.output + result.stderr


def test_the_demo_refuses_an_unknown_broker_in_one_line() -> None:
    result = _cli("demo", "--orders", "1", "--broker", "xyz://")
    assert result.exit_code != 0
    assert "no publisher for broker URL scheme 'xyz'" in result.stderr


# -- operator commands ------------------------------------------------------------------


@pytest.fixture
def migrated(tmp_path: Path) -> str:
    url = sqlite_url(tmp_path / "ops.db")
    asyncio.run(migrate(url))
    return url


def test_replaying_a_seq_that_is_not_there_says_so_and_fails(migrated: str) -> None:
    result = _cli("replay", "--db", migrated, "9999")
    assert result.exit_code == 1
    assert "nothing replayed: none of the seqs given is abandoned" in result.stderr
    result = _cli("replay", "--db", migrated, "99999999999999999999")
    assert result.exit_code != 0
    assert "seqs run from 1 to" in result.stderr


def test_replay_all_with_nothing_abandoned_says_so_and_fails(migrated: str) -> None:
    result = _cli("replay", "--db", migrated, "--all", "--yes")
    assert result.exit_code == 1
    assert "nothing replayed: no message matched that is abandoned or held" in result.stderr


@pytest.mark.parametrize("limit", ["99999999999999999999", "0", "-3"])
def test_an_abandoned_limit_out_of_range_is_refused(limit: str) -> None:
    result = _cli("abandoned", "--db", PG_URL, "--limit", limit)
    assert result.exit_code == 2
    assert "--limit" in result.stderr
