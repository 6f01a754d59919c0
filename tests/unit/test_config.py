"""Where the options of the relay, the console and the consumers come from: the command
line, then RELAYBOX_<OPTION>, then relaybox.toml, then the settings objects' defaults;
what a bad file or variable says; and the reference in docs/configuration.md."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from relaybox.cli import reference
from relaybox.cli.config import Configured, nearest, settings_options
from relaybox.cli.console import ConsoleSettings, console
from relaybox.cli.main import main
from relaybox.consumers.amqp import AmqpConsumer
from relaybox.consumers.base import SharedSettings
from relaybox.errors import ConfigurationError
from relaybox.relay.settings import RelaySettings

DOCS = Path(__file__).parents[2] / "docs" / "configuration.md"
PASSWORD = "Hunter2secret"


class Built(Exception):
    """Raised in place of starting the relay, with what it was given."""


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.startswith("RELAYBOX_")]:
        monkeypatch.delenv(name)


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What `relaybox relay` hands the Relay it builds (which then stops the command)."""
    from relaybox.cli import relay as command

    seen: list[dict[str, Any]] = []

    def capture(databases: Any, brokers: Any, **kwargs: Any) -> None:
        seen.append({"databases": databases, "brokers": brokers, **kwargs})
        raise Built

    monkeypatch.setattr(command, "Relay", capture)
    return seen


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "relaybox.toml"
    path.write_text(text)
    return str(path)


def _relay(args: list[str], env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(main, ["relay", *args], env=env)


def test_an_option_comes_from_the_command_line_then_the_environment_then_the_file(
    tmp_path: Path, built: list[dict[str, Any]]
) -> None:
    config = _toml(tmp_path, """
[relay]
db = "memory://"
table = "from_file"
batch_size = 7
lease = 12
hold_keys = true
retry_base = 2

[relay.brokers]
orders = "noop://"
audit = "memory://"
""")  # fmt: skip
    env = {"RELAYBOX_LEASE": "13", "RELAYBOX_TABLE": "from_env", "RELAYBOX_MAX_IN_FLIGHT": "3"}
    result = _relay(["--config", config, "--table", "from_cli"], env)
    assert isinstance(result.exception, Built), result.output
    (given,) = built
    settings: RelaySettings = given["settings"]
    assert given["table"] == "from_cli"
    assert given["databases"] == ["memory://"]
    assert given["brokers"] == {"orders": "noop://", "audit": "memory://"}
    assert (settings.batch_size, settings.lease_seconds, settings.max_in_flight) == (7, 13.0, 3)
    assert settings.hold_keys
    assert settings.retry.base_delay == 2.0
    assert settings.idle_interval == RelaySettings().idle_interval


def test_the_file_is_found_through_relaybox_config_and_flags_through_variables(
    tmp_path: Path, built: list[dict[str, Any]]
) -> None:
    config = _toml(tmp_path, '[relay]\ndb = "memory://"\n[relay.brokers]\na = "noop://"\n')
    env = {"RELAYBOX_CONFIG": config, "RELAYBOX_HOLD_KEYS": "true",
           "RELAYBOX_NO_PARTITION_LEASES": "1"}  # fmt: skip
    result = _relay([], env)
    assert isinstance(result.exception, Built), result.output
    settings: RelaySettings = built[0]["settings"]
    assert settings.hold_keys
    assert not settings.partition_leases


@pytest.mark.parametrize(
    ("text", "env", "said"),
    [
        ("[relay]\nbatchsize = 3\n", {}, "key 'batchsize' is unknown (did you mean 'batch_size'?)"),
        ("[relays]\n", {}, "section 'relays' is unknown"),
        ("[relay\n", {}, "is not valid TOML"),
        ('[relay]\nbatch_size = "many"\n', {}, "[relay] batch_size: 'many' is not a valid integer"),
        ("[relay]\nbatch_size = [1]\n", {}, "[relay] batch_size must be a single value"),
        ("[relay.brokers]\na = 1\n", {}, "[relay] brokers must be a table"),
        ("", {"RELAYBOX_BATCH_SIZE": "x"}, "RELAYBOX_BATCH_SIZE (--batch-size): 'x' is not"),
        ("", {"RELAYBOX_HOLD_KEYS": "maybe"}, "RELAYBOX_HOLD_KEYS (--hold-keys): 'maybe' is not"),
        ("[relay]\nbatch_size = 0\n", {}, ">= 1 (given by relaybox.toml [relay] batch_size)"),
        ("", {"RELAYBOX_IDLE_INTERVAL": "-1"}, "(given by RELAYBOX_IDLE_INTERVAL)"),
    ],
)  # fmt: skip
def test_a_bad_file_or_variable_is_named_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, env: dict[str, str], said: str
) -> None:
    monkeypatch.chdir(tmp_path)
    _toml(tmp_path, text)
    result = _relay(["--config", "relaybox.toml"], env)
    assert result.exit_code in (1, 2)
    assert said in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "text",
    [
        f'[relay]\ndb = "postgresql://relay:{PASSWORD}@db/shop"\n',
        f'[relay]\ndb = ["memory://", "mysql://relay:{PASSWORD}@db/shop"]\n',
        f'[relay.brokers]\nhook = "https://hooks.example/in?secret={PASSWORD}"\n',
        f'[console]\ninbox_db = "postgresql://c:{PASSWORD}@db/inbox"\n',
    ],
)
def test_the_file_refuses_a_secret_and_does_not_echo_it(tmp_path: Path, text: str) -> None:
    config = _toml(tmp_path, text)
    command = "console" if text.startswith("[console]") else "relay"
    result = CliRunner().invoke(main, [command, "--config", config])
    assert result.exit_code == 1
    assert "holds a password or secret" in result.output
    assert PASSWORD not in result.output


def test_the_console_token_is_not_a_key_of_the_file(tmp_path: Path) -> None:
    config = _toml(tmp_path, f'[console]\ntoken = "{PASSWORD}"\n')
    result = CliRunner().invoke(main, ["console", "--config", config])
    assert "[console] key 'token' is unknown" in result.output
    assert PASSWORD not in result.output


def test_the_console_reads_its_section_and_its_defaults_are_its_settings(tmp_path: Path) -> None:
    config = _toml(tmp_path, '[console]\nlisten = "0.0.0.0:9000"\nread_only = true\n')
    ctx = console.make_context("console", ["--config", config], default_map=None)
    assert (ctx.params["listen"], ctx.params["read_only"]) == ("0.0.0.0:9000", True)
    defaults = console.make_context("console", []).params
    assert (
        ConsoleSettings(
            defaults["table"], defaults["inbox_table"], defaults["listen"], defaults["read_only"]
        )
        == ConsoleSettings()
    )


def test_of_a_url_and_its_file_only_the_nearest_source_counts(tmp_path: Path) -> None:
    secret = tmp_path / "db.url"
    secret.write_text("memory://")
    config = _toml(tmp_path, f'[relay]\ndb_file = "{secret}"\n')
    ctx = console.make_context("console", ["--config", config])
    given = {"databases": ("sqlite:///env.db",), "db_files": (str(secret),)}
    ctx.set_parameter_source("databases", click.core.ParameterSource.ENVIRONMENT)
    ctx.set_parameter_source("db_files", click.core.ParameterSource.DEFAULT_MAP)
    assert nearest(ctx, given) == {"databases": ("sqlite:///env.db",), "db_files": ()}
    ctx.set_parameter_source("db_files", click.core.ParameterSource.COMMANDLINE)
    assert nearest(ctx, given) == {"databases": (), "db_files": (str(secret),)}
    ctx.set_parameter_source("databases", click.core.ParameterSource.COMMANDLINE)
    assert nearest(ctx, given) == given


#: RelaySettings fields only code sets, each with the reason.
CODE_ONLY = {
    "min_poll_interval",  # derived from --idle-interval
    "cleanup_batch",
    "activity_retention",
}
#: The relay's option for each field of RelaySettings (and of its policies).
FIELD_OPTIONS = {
    "batch_size": "batch_size", "max_claim_bytes": "max_claim_bytes",
    "max_in_flight": "max_in_flight", "lease_seconds": "lease_seconds",
    "publish_timeout": "publish_timeout", "partitions": "partitions",
    "idle_interval": "idle_interval", "fast_poll_interval": "fast_poll_interval",
    "fast_poll_window": "fast_poll_window", "published_retention": "published_retention",
    "abandoned_retention": "abandoned_retention", "cleanup_interval": "cleanup_interval",
    "shutdown_timeout": "shutdown_timeout", "hold_keys": "hold_keys",
    "activity_interval": "activity_interval", "partition_leases": "no_partition_leases",
    "listen": "no_listen",
    "retry.base_delay": "retry_base", "retry.max_delay": "retry_max",
    "retry.jitter": "retry_jitter", "retry.max_attempts": "max_attempts",
    "circuit.failure_threshold": "circuit_threshold", "circuit.open_seconds": "circuit_open",
    "circuit.max_open_seconds": "circuit_max_open",
}  # fmt: skip


def test_every_relay_setting_has_an_option_defaulting_to_the_settings_own() -> None:
    from relaybox.cli.relay import relay

    defaults = RelaySettings()
    fields = {field.name for field in dataclasses.fields(RelaySettings)}
    nested = {name.split(".")[0] for name in FIELD_OPTIONS if "." in name}
    assert fields - nested - CODE_ONLY == {n for n in FIELD_OPTIONS if "." not in n}
    params = relay.make_context("relay", []).params
    for field, option in FIELD_OPTIONS.items():
        value: Any = defaults
        for part in field.split("."):
            value = getattr(value, part)
        expected = not value if option.startswith("no_") else value
        assert params[option] == expected, field


def test_the_consumer_settings_load_from_arguments_then_environment_then_file(
    tmp_path: Path,
) -> None:
    config = _toml(tmp_path, "[consumer]\nprefetch = 50\nmax_attempts = 8\ntimeout = 3\n")
    environ = {"RELAYBOX_CONSUMER_MAX_ATTEMPTS": "9", "RELAYBOX_CONSUMER_TIMEOUT": "4.5"}
    environ["RELAYBOX_CONSUMER_PREFETCH"] = ""  # set empty: not set, as for the relay
    settings = SharedSettings.load(config, environ=environ, timeout=6.0, reconnect_wait=None)
    assert settings == SharedSettings(prefetch=50, max_attempts=9, timeout=6.0)
    from_variable = SharedSettings.load(environ={"RELAYBOX_CONFIG": config})
    assert from_variable.prefetch == 50
    assert "fetch_timeout" not in settings.arguments(AmqpConsumer)
    assert settings.arguments(AmqpConsumer)["prefetch"] == 50


@pytest.mark.parametrize(
    ("text", "environ", "said"),
    [
        ("[consumer]\nprefetc = 5\n", {}, "'prefetc' is unknown (did you mean 'prefetch'?)"),
        ('[consumer]\nprefetch = "x"\n', {}, "[consumer] prefetch: 'x' is not a valid int"),
        ("[consumer]\nprefetch = 1.5\n", {}, "prefetch: 1.5 is not a valid int"),
        ("", {"RELAYBOX_CONSUMER_TIMEOUT": "soon"}, "RELAYBOX_CONSUMER_TIMEOUT: 'soon' is not"),
    ],
)  # fmt: skip
def test_a_bad_consumer_setting_is_named(
    tmp_path: Path, text: str, environ: dict[str, str], said: str
) -> None:
    config = _toml(tmp_path, text)
    with pytest.raises(ConfigurationError) as raised:
        SharedSettings.load(config, environ=environ)
    assert said in str(raised.value)


def test_a_program_declares_the_consumer_settings_as_options(tmp_path: Path) -> None:
    seen: list[SharedSettings] = []

    @click.command(cls=Configured, section="consumer")
    @settings_options(SharedSettings, scope="consumer")
    def program(settings: SharedSettings) -> None:
        seen.append(settings)

    config = _toml(tmp_path, "[consumer]\nprefetch = 50\nmax_attempts = 8\nreconnect_wait = 2\n")
    env = {"RELAYBOX_CONSUMER_MAX_ATTEMPTS": "9"}
    result = CliRunner().invoke(program, ["--config", config, "--reconnect-wait", "3"], env=env)
    assert result.exit_code == 0, result.output
    assert seen == [SharedSettings(prefetch=50, max_attempts=9, reconnect_wait=3.0)]
    bad = CliRunner().invoke(program, ["--config", config], env={"RELAYBOX_CONSUMER_PREFETCH": "x"})
    assert "RELAYBOX_CONSUMER_PREFETCH (--prefetch)" in bad.output


def test_the_documented_options_are_those_of_the_code(tmp_path: Path) -> None:
    text = DOCS.read_text(encoding="utf-8")
    assert reference.updated(text) == text, (
        "run: relaybox config reference --docs docs/configuration.md"
    )
    stale = tmp_path / "configuration.md"
    stale.write_text(text.replace("| `RELAYBOX_BATCH_SIZE` |", "| `RELAYBOX_BATCHSIZE` |"))
    args = ["config", "reference", "--docs", str(stale)]
    assert CliRunner().invoke(main, [*args, "--check"]).exit_code == 1
    assert CliRunner().invoke(main, args).exit_code == 0
    assert stale.read_text(encoding="utf-8") == text


def test_a_relay_of_a_fleet_keeps_its_share_of_the_batches_in_flight() -> None:
    """Unset, max_in_flight shrinks with the share of partitions held, rounded down and
    never under one; holding every partition, or set, it is the whole limit."""
    unset, set_ = RelaySettings(), RelaySettings(max_in_flight=3)
    assert [unset.in_flight_share(3, share) for share in (1.0, 0.99, 0.5, 0.34, 0.25, 0.0)] == [
        3, 2, 1, 1, 1, 1]  # fmt: skip
    assert [unset.in_flight_share(2, share) for share in (1.0, 0.5, 0.25)] == [2, 1, 1]
    assert [set_.in_flight_share(3, share) for share in (1.0, 0.5, 0.25)] == [3, 3, 3]
    # Publishes that take longer than reads: as many as fit, within the limit.
    assert [unset.in_flight_share(3, 0.25, waits) for waits in (0.5, 1.5, 2.0, 9.0)] == [
        1, 2, 2, 3]  # fmt: skip
    assert RelaySettings(max_in_flight=2).in_flight_share(2, 0.25, 9.0) == 2
