"""The wheel and sdist as `python -m build` makes them: what they hold, that their
metadata passes `twine check`, and that the wheel installed alone into a fresh virtual
environment imports and runs its command, SQL files included.

The build runs as a user's would (an isolated build environment, the sdist first and the
wheel built from it), so a file the sdist leaves out fails here too. About 20 s."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import tarfile
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import relaybox
from tests.databases import PG_URL
from tests.examples.test_celery_example import receipt_task_runs_once
from tests.examples.test_web_examples import SERVERS, nats_broker, order_arrives_on_nats

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "relaybox"
NAME = f"relaybox-{relaybox.__version__}"

pytestmark = pytest.mark.packaging


def _run(*command: str | Path, cwd: Path) -> str:
    """Run `command` outside this checkout's import path and return what it printed."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    done = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "build", "--outdir", out, ROOT, cwd=out)
    return out


def _package_files() -> set[str]:
    """Every file of the source package, as the wheel names it."""
    return {
        path.relative_to(PACKAGE.parent).as_posix()
        for path in PACKAGE.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


def test_the_wheel_holds_every_file_of_the_package(dist: Path) -> None:
    with zipfile.ZipFile(dist / f"{NAME}-py3-none-any.whl") as wheel:
        names = set(wheel.namelist())
        entry_points = wheel.read(f"{NAME}.dist-info/entry_points.txt").decode()
        metadata = wheel.read(f"{NAME}.dist-info/METADATA").decode()
    packaged = {name for name in names if name.startswith("relaybox/")}
    assert packaged == _package_files()
    for needed in (
        "relaybox/py.typed",
        "relaybox/console/static/index.html",
        "relaybox/console/static/console.js",
        "relaybox/console/static/console.css",
        "relaybox/sql/postgresql/migrations/0001_initial.sql",
        "relaybox/sql/mysql/inbox/migrations/0001_initial.sql",
        "relaybox/sql/sqlite/queries.sql",
        "relaybox/integrations/django/migrations/0001_initial.py",
    ):
        assert needed in names
    assert "relaybox = relaybox.cli.main:main" in entry_points
    assert "relaybox = relaybox.testing.plugin" in entry_points
    # The licence travels with the wheel, its text included.
    assert "License-Expression: MIT" in metadata
    assert "License-File: LICENSE" in metadata
    assert f"{NAME}.dist-info/licenses/LICENSE" in names


def test_the_sdist_holds_the_sources_tests_and_docs(dist: Path) -> None:
    with tarfile.open(dist / f"{NAME}.tar.gz") as sdist:
        names = {name.removeprefix(f"{NAME}/") for name in sdist.getnames()}
    needed_files = ("pyproject.toml", "README.md", "CHANGELOG.md", "LICENSE", "mkdocs.yml")
    for needed in (*needed_files, "PKG-INFO"):
        assert needed in names
    assert {f"src/{name}" for name in _package_files()} <= names
    assert "docs/index.md" in names
    assert "tests/packaging/test_distributions.py" in names


def test_twine_accepts_both_distributions(dist: Path) -> None:
    built = sorted(dist.iterdir())
    assert [path.name for path in built] == [f"{NAME}-py3-none-any.whl", f"{NAME}.tar.gz"]
    printed = _run(sys.executable, "-m", "twine", "check", "--strict", *built, cwd=dist)
    assert printed.count("PASSED") == 2


def test_the_wheel_installed_alone_runs_its_command(dist: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    wheel = dist / f"{NAME}-py3-none-any.whl"
    # This environment's pip installs into the new one: the wheel and what its metadata
    # requires (click), nothing from this checkout.
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet", wheel, cwd=tmp_path)

    where = _run(python, "-c", "import relaybox; print(relaybox.__file__)", cwd=tmp_path)
    assert Path(where.strip()).is_relative_to(venv)
    relaybox_command = venv / "bin" / "relaybox"
    assert relaybox.__version__ in _run(relaybox_command, "--version", cwd=tmp_path)
    schema = _run(relaybox_command, "schema", "--dialect", "sqlite", cwd=tmp_path)
    assert "CREATE TABLE" in schema
    assert "relaybox_outbox" in schema

    # The migrations are read from the installed package's SQL files.
    database = tmp_path / "shop.db"
    _run(relaybox_command, "migrate", "--db", f"sqlite:///{database}", cwd=tmp_path)
    with sqlite3.connect(database) as conn:
        versions = conn.execute("SELECT version FROM relaybox_outbox_migrations").fetchall()
    shipped = sorted(int(path.name[:4]) for path in (PACKAGE / "sql/sqlite/migrations").iterdir())
    assert sorted(version for (version,) in versions) == shipped


@pytest.fixture
def postgres_database() -> Iterator[str]:
    """A PostgreSQL database of the test's own, dropped afterwards."""
    import psycopg

    name = f"relaybox_pkg_{uuid.uuid4().hex[:12]}"
    admin = PG_URL.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield name
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_a_django_project_on_the_wheel_with_django_and_postgres_delivers(
    dist: Path, tmp_path: Path, postgres_database: str
) -> None:
    """A fresh virtual environment with only `relaybox[django,postgres]` from the built
    wheel (and Django's own PostgreSQL driver): examples/django migrates, writes an
    order and its message, and its relay command delivers the message."""
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    wheel = dist / f"{NAME}-py3-none-any.whl"
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet",
         f"{wheel}[django,postgres]", "psycopg[binary]", cwd=tmp_path)  # fmt: skip
    project = tmp_path / "django"
    shutil.copytree(ROOT / "examples" / "django", project,
                    ignore=shutil.ignore_patterns("__pycache__", "*.db"))  # fmt: skip
    delivered = tmp_path / "delivered.jsonl"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(SHOP_POSTGRES=postgres_database, SHOP_BROKER=f"file://{delivered}")

    def manage(*arguments: str) -> str:
        done = subprocess.run([str(python), "manage.py", *arguments], cwd=project, env=env,
                              capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    manage("migrate", "-v", "0")
    assert "order 1 placed" in manage("place_order", "book")
    relay = subprocess.Popen(
        [str(python), "manage.py", "relaybox_relay"], cwd=project, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (delivered.exists() and delivered.read_text().strip()):
            assert relay.poll() is None, relay.communicate()[0]
            assert time.monotonic() < deadline, "the relay delivered nothing within 60 s"
            time.sleep(0.1)
    finally:
        relay.send_signal(signal.SIGTERM)
        output, _ = relay.communicate(timeout=60)
    assert relay.returncode == 0, output
    (line,) = delivered.read_text().splitlines()
    event = json.loads(line)
    assert (event["topic"], event["data"]) == ("orders", {"order": 1, "item": "book"})


#: A module of relaybox that needs each extra's libraries, by extra.
EXTRA_MODULES = {
    "postgres": "relaybox.storage.postgres", "psycopg": "psycopg", "mysql": "aiomysql",
    "asyncmy": "asyncmy", "sqlite": "aiosqlite", "sqlalchemy": "relaybox.integrations.sqlalchemy",
    "django": "relaybox.integrations.django.database", "alembic": "relaybox.integrations.alembic",
    "flask": "relaybox.integrations.flask", "fastapi": "fastapi",
    "nats": "relaybox.publishers.nats", "amqp": "relaybox.publishers.amqp",
    "kafka": "relaybox.publishers.kafka", "redis": "relaybox.publishers.redis",
    "mqtt": "relaybox.publishers.mqtt", "http": "relaybox.publishers.http",
    "celery": "relaybox.publishers.celery", "tracing": "relaybox.observability.otel",
    "metrics": "relaybox.observability.prometheus", "cli": "rich.progress",
    "console": "relaybox.console.app",
}  # fmt: skip


def test_every_extra_installs_from_the_wheel_and_its_modules_import(
    dist: Path, tmp_path: Path
) -> None:
    """`relaybox[all]` from the built wheel into a fresh virtual environment: pip finds
    every requirement consistent, and a module needing each extra imports from there."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    every = re.fullmatch(r"relaybox\[(.*)\]", extras["all"][0])
    assert every is not None
    named = {*every[1].split(","), *(e for e in ("nats", "amqp", "kafka", "redis", "mqtt",
                                                  "http", "celery") if e in extras)}  # fmt: skip
    named.discard("brokers")
    assert named == set(EXTRA_MODULES)  # a new extra needs its module here
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    wheel = dist / f"{NAME}-py3-none-any.whl"
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet",
         f"{wheel}[all]", cwd=tmp_path)  # fmt: skip
    _run(sys.executable, "-m", "pip", "--python", python, "check", cwd=tmp_path)
    imports = "; ".join(f"import {module}" for module in sorted(EXTRA_MODULES.values()))
    _run(python, "-c", f"{imports}; import relaybox; print(relaybox.__file__)", cwd=tmp_path)


def _venv_as_the_readme_installs(example: str, dist: Path, tmp_path: Path) -> Path:
    """A fresh virtual environment holding what the `pip install` line of the example's
    README installs, relaybox coming from the built wheel; its Python is returned."""
    readme = (ROOT / "examples" / example / "README.md").read_text()
    (line,) = (line for line in readme.splitlines() if line.startswith("pip install "))
    wheel = dist / f"{NAME}-py3-none-any.whl"
    named = shlex.split(line, comments=True)[2:]
    requirements = [f"{wheel}{name.removeprefix('relaybox')}" if name.startswith("relaybox[")
                    else name for name in named]  # fmt: skip
    assert requirements != named, f"the README of {example} installs no relaybox[...]"
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet",
         *requirements, cwd=tmp_path)  # fmt: skip
    _run(sys.executable, "-m", "pip", "--python", python, "check", cwd=tmp_path)
    where = _run(python, "-c", "import relaybox; print(relaybox.__file__)", cwd=tmp_path)
    assert Path(where.strip()).is_relative_to(venv)
    return python


@pytest.mark.parametrize("example", sorted(SERVERS))
def test_a_web_example_on_the_wheel_with_what_its_readme_installs_delivers(
    example: str, dist: Path, tmp_path: Path
) -> None:
    """examples/fastapi under uvicorn and examples/flask under gunicorn, served from a
    fresh virtual environment with only their README's `pip install`: an order posted
    over HTTP arrives on NATS (a server of this checkout's, the broker not the app)."""
    python = _venv_as_the_readme_installs(example, dist, tmp_path)
    with nats_broker() as broker:
        order_arrives_on_nats(example, python, broker, tmp_path)


async def test_the_celery_example_on_the_wheel_with_what_its_readme_installs_delivers(
    dist: Path, tmp_path: Path
) -> None:
    """examples/celery's shop and worker from a fresh virtual environment with only its
    README's `pip install`: the order's receipt task goes through Redis and runs once."""
    python = _venv_as_the_readme_installs("celery", dist, tmp_path)
    await receipt_task_runs_once(python, tmp_path)
