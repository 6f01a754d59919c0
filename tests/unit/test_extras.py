"""A client library that is not installed is a MissingDependencyError naming the extra."""

from __future__ import annotations

import sys

import pytest

from relaybox import ConfigurationError, MissingDependencyError
from relaybox.core.extras import needs_extras
from relaybox.migrations import migrate
from relaybox.publishers import open_publisher
from relaybox.storage import open_storage


def _hide(monkeypatch: pytest.MonkeyPatch, *packages: str) -> None:
    """Make `packages` (and every submodule already imported) fail to import."""
    for name in list(sys.modules):
        if name.partition(".")[0] in packages:
            monkeypatch.setitem(sys.modules, name, None)
    for package in packages:
        monkeypatch.setitem(sys.modules, package, None)


def test_a_broker_url_without_its_client_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide(monkeypatch, "nats")
    monkeypatch.delitem(sys.modules, "relaybox.publishers.nats", raising=False)
    monkeypatch.delitem(sys.modules, "relaybox.publishers.nats_protocol", raising=False)
    with pytest.raises(MissingDependencyError, match=r"nats.*pip install 'relaybox\[nats\]'"):
        open_publisher("nats://127.0.0.1:4222")


async def test_a_database_url_without_its_driver_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _hide(monkeypatch, "psycopg")
    with pytest.raises(MissingDependencyError, match=r"relaybox\[psycopg\]") as caught:
        await open_storage("postgresql+psycopg://user:secret@127.0.0.1:1/test")
    assert "secret" not in str(caught.value)  # the URL is masked
    assert isinstance(caught.value, ConfigurationError)


async def test_migrate_without_any_postgres_driver_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _hide(monkeypatch, "asyncpg", "psycopg")
    with pytest.raises(MissingDependencyError, match=r"relaybox\[postgres\]"):
        await migrate("postgresql://postgres@127.0.0.1:1/test", table="nowhere")


async def test_migrate_with_a_named_driver_that_is_missing_names_its_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _hide(monkeypatch, "asyncmy")
    with pytest.raises(MissingDependencyError, match=r"relaybox\[asyncmy\]"):
        await migrate("mysql+asyncmy://root@127.0.0.1:1/test", table="nowhere")


def test_other_import_errors_pass_unchanged() -> None:
    with pytest.raises(ModuleNotFoundError), needs_extras("this"):
        import relaybox_no_such_module  # type: ignore[import-not-found]  # noqa: F401
