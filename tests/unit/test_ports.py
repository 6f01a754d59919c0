"""The storage ports stay narrow, and each dialect binds the shared queries' parameters."""

from __future__ import annotations

import inspect

import pytest

from relaybox import ports
from relaybox.storage.mysql import bind_numbered
from relaybox.storage.sql import Seqs, error_text

STORAGE_PORTS = (ports.Storage, ports.PartitionStorage, ports.RowLeaseStorage,
                 ports.OperatorStorage, ports.TableWriter)  # fmt: skip


def _methods(port: type) -> set[str]:
    return {
        name
        for klass in port.__mro__
        if klass not in (object,) and klass.__module__ == ports.__name__
        for name, value in vars(klass).items()
        if inspect.isfunction(value) and not name.startswith("_")
    }


@pytest.mark.parametrize("port", STORAGE_PORTS, ids=lambda p: p.__name__)
def test_no_storage_port_has_more_than_twelve_methods(port: type) -> None:
    assert 1 <= len(_methods(port)) <= 12


def test_the_ports_split_the_jobs() -> None:
    jobs = [_methods(p) - {"close"} for p in STORAGE_PORTS[1:]]
    assert all(a.isdisjoint(b) for i, a in enumerate(jobs) for b in jobs[i + 1 :])
    assert "recover_expired" not in set().union(*jobs)


def test_numbered_parameters_become_positional_ones() -> None:
    query, params = bind_numbered("UPDATE t SET a = $3 WHERE b IN ($1) AND c = $2 OR d = $2",
                                  [Seqs([3, 1, 2]), "tok", 5.0])  # fmt: skip
    assert query == "UPDATE t SET a = %s WHERE b IN (%s, %s, %s) AND c = %s OR d = %s"
    assert params == [5.0, 1, 2, 3, "tok", "tok"]


def test_an_empty_list_matches_nothing_and_percent_signs_survive_formatting() -> None:
    query, params = bind_numbered("SELECT '%' FROM t WHERE seq IN ($1)", [Seqs([])])
    assert (query, params) == ("SELECT '%%' FROM t WHERE seq IN (NULL)", [])
    assert bind_numbered("SELECT %s", ["x"]) == ("SELECT %s", ["x"])  # positional as is


def test_an_error_is_stored_as_text_every_database_takes() -> None:
    assert error_text("bad \x00 byte \ud800 here") == "bad \ufffd byte ? here"
    assert error_text("fine: ü") == "fine: ü"
