"""No secret leaves relaybox: not in a command's output, an error, a log line, the JSON of
`/api/outbox` or `relaybox bench`'s report, whichever form the URL gave it in.

The test PostgreSQL trusts every local login, so a URL may carry any password and still
connect: each test hands one over and looks for it in everything relaybox says.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
from click.testing import CliRunner

from relaybox import Relay
from relaybox.cli.main import main
from relaybox.errors import ConfigurationError, RelayboxError
from relaybox.migrations import migrate
from relaybox.observability.snapshot import snapshot
from relaybox.operations import admin
from relaybox.publishers import open_publisher
from relaybox.storage import open_storage
from relaybox.storage.urls import DatabaseUrl
from tests.brokers.test_http import webhook_harness
from tests.databases import PG_URL, drop, sqlite_url, unique_table
from tests.relay_support import fast_settings

SECRET = "Sekr3t"
RELAYBOX = str(Path(sys.executable).with_name("relaybox"))


def with_password(url: str, password: str = SECRET) -> str:
    """`url` (`scheme://user@...`) with `password` in its userinfo."""
    scheme, _, rest = url.partition("://")
    user, _, where = rest.partition("@")
    return f"{scheme}://{user}:{password}@{where}"


def with_query_password(url: str, password: str = SECRET) -> str:
    return f"{url}{'&' if '?' in url else '?'}password={password}"


def told(error: BaseException) -> str:
    """Everything a traceback of `error` prints, its causes included."""
    return "".join(traceback.format_exception(error))


async def test_the_bench_report_holds_no_secret_of_its_command_line(tmp_path: Path) -> None:
    async with webhook_harness() as webhook:
        hook = f"http://relay:{SECRET}@127.0.0.1:{webhook.server.port}/hook?secret={SECRET}"
        command = [
            RELAYBOX, "bench", "--db", sqlite_url(tmp_path / "bench.db"), "--broker", hook,
            "--messages", "20", "--paced-seconds", "0", "--idle-seconds", "0", "--skip-raw",
        ]  # fmt: skip
        done = await asyncio.to_thread(
            subprocess.run, command, capture_output=True, text=True, timeout=120
        )
        delivered = len(webhook.server.accepted)
    assert done.returncode == 0, done.stderr
    assert delivered >= 20  # the URL did its job: the webhook took every message
    report = json.loads(done.stdout)
    assert "--broker" in report["command"]
    assert SECRET not in done.stdout + done.stderr


async def test_the_demo_summary_names_its_broker_masked(tmp_path: Path) -> None:
    from relaybox.tools import demo

    async with webhook_harness() as webhook:
        hook = f"http://relay:{SECRET}@127.0.0.1:{webhook.server.port}/hook?secret={SECRET}"
        summary = await demo.run(5, 100.0, hook, tmp_path / "orders.db")
    assert "127.0.0.1" in summary["broker"]
    assert SECRET not in json.dumps(summary)


@pytest.mark.parametrize("form", [with_password, with_query_password])
def test_status_and_migrate_print_the_database_url_masked(form: object) -> None:
    url = form(PG_URL)  # type: ignore[operator]
    table = unique_table("secrets")
    try:
        migrated = CliRunner().invoke(main, ["migrate", "--db", url, "--table", table])
        status = CliRunner().invoke(main, ["status", "--db", url, "--table", table])
    finally:
        drop(PG_URL, table)
    assert migrated.exit_code == 0, migrated.output
    assert status.exit_code == 0, status.output
    assert "***" in migrated.output
    assert "***" in status.output
    assert SECRET not in migrated.output + status.output


@pytest.mark.parametrize("form", [with_password, with_query_password])
async def test_api_outbox_serves_database_urls_and_errors_masked(form: object) -> None:
    table = unique_table("secrets")
    reachable = form(PG_URL)  # type: ignore[operator]
    unreachable = form("postgresql://postgres@127.0.0.1:1/test")  # type: ignore[operator]
    await migrate(reachable, table=table)
    try:
        relay = Relay([reachable, unreachable], {"default": "memory://"}, table=table,
                      settings=fast_settings())  # fmt: skip
        async with relay:
            served = json.dumps(await snapshot(relay))
    finally:
        drop(PG_URL, table)
    assert served.count("***") >= 2
    assert "cannot connect to the database" in served
    assert SECRET not in served


#: A password whose %-escape does not decode: libpq quotes it when it refuses the URL.
UNDECODABLE = "Sekr3t%zz"


@pytest.mark.parametrize("driver", ["psycopg", "asyncpg"])
@pytest.mark.parametrize("form", [with_password, with_query_password])
async def test_a_driver_quoting_the_password_is_scrubbed(driver: str, form: object) -> None:
    url = form(PG_URL.replace("postgresql://", f"postgresql+{driver}://"), UNDECODABLE)  # type: ignore[operator]
    table = unique_table("secrets")
    failures: list[BaseException] = []
    for attempt in (
        lambda: admin.table_stats(url, table),
        lambda: migrate(url, table=table),
        lambda: open_storage(url, table=table),
    ):
        try:
            await attempt()
        except RelayboxError as error:
            failures.append(error)
        finally:
            drop(PG_URL, table)
    said = "".join(map(told, failures))
    assert "Sekr3t" not in said
    if driver == "psycopg":  # asyncpg takes the escape as it is, and connects
        assert len(failures) == 3
        assert "percent-encoded" in said  # the driver's reason is kept


def test_the_command_line_scrubs_what_the_driver_said() -> None:
    url = with_password(PG_URL.replace("postgresql://", "postgresql+psycopg://"), UNDECODABLE)
    for command in (["status", "--db", url], ["migrate", "--db", url]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code != 0
        assert "percent-encoded" in result.output
        assert "Sekr3t" not in result.output


@pytest.mark.parametrize(
    "url",
    [
        f"nats://relay:{SECRET}@127.0.0.1:4222?nosuchoption=1",
        f"mqtt://relay:{SECRET}@127.0.0.1:notaport",
        f"amqp://guest:{SECRET}@[::1",
        f"redis://:{SECRET}@127.0.0.1:6379/0?timeout=soon",
        f"mqtt://relay:{SECRET}@127.0.0.1:1883?qos=7",
        f"https://hooks.example/x?secret={SECRET}&batch=maybe",
        f"kafka://relay:{SECRET}@127.0.0.1:9092",
        f"kafka://127.0.0.1:9092?security_protocol=SASL_SSL&sasl_password={SECRET}",
        f"oracle://relay:{SECRET}@db",
        f"relay:{SECRET}@127.0.0.1:4222",
    ],
)
def test_a_bad_broker_url_is_refused_with_its_secrets_masked(url: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        open_publisher(url)
    assert SECRET not in told(raised.value)
    via_cli = CliRunner().invoke(main, ["relay", "--db", "memory://", "--broker", f"t={url}"])
    assert via_cli.exit_code != 0
    assert SECRET not in via_cli.output


@pytest.mark.parametrize(
    "value", [f"nats://relay:{SECRET}@h", f"=nats://relay:{SECRET}@h", f"relay:{SECRET}@h"]
)
def test_a_malformed_broker_option_is_refused_masked(value: str) -> None:
    result = CliRunner().invoke(main, ["relay", "--db", "memory://", "--broker", value])
    assert result.exit_code != 0
    assert "NAME=URL" in result.output
    assert SECRET not in result.output


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://relay:{SECRET}@h1:5432,h2:x/db",
        f"mysql://root:{SECRET}@h1,h2/test",
        f"postgresql://relay@[::1/db?password={SECRET}",
        f"postgresql://relay@db/x?password={SECRET}&command_timeout=never",
    ],
)
def test_a_bad_database_url_is_refused_with_its_secrets_masked(url: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        DatabaseUrl.parse(url)
    assert SECRET not in told(raised.value)


def test_a_kafka_url_with_credentials_is_refused_rather_than_ignored() -> None:
    with pytest.raises(ConfigurationError, match="takes no user or password") as raised:
        open_publisher(f"kafka://relay:{SECRET}@127.0.0.1:9092")
    assert "ssl_certfile" in str(raised.value)  # says what to do instead
    from relaybox.consumers.kafka import parse_servers

    with pytest.raises(ConfigurationError, match="credentials") as consumer:
        parse_servers(f"kafka://relay:{SECRET}@127.0.0.1:9092")
    assert SECRET not in told(raised.value) + told(consumer.value)


def test_a_database_url_shows_itself_masked() -> None:
    url = DatabaseUrl.parse(with_query_password(with_password(PG_URL), "Other1"))
    assert SECRET not in repr(url)
    assert "Other1" not in repr(url)
    assert {SECRET, "Other1"} <= url.secrets
