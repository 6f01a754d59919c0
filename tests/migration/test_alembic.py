"""relaybox's tables built and dropped by a real Alembic, in a script directory of the
application's own: the schema they give is the one `relaybox migrate` gives, and both
keep one record of versions."""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import pytest
from alembic import command
from alembic.config import Config

from relaybox import sql
from relaybox.errors import ConfigurationError
from relaybox.migrations import migrate
from tests.databases import MYSQL_URL, PG_URL, drop, execute, fetch_all, sqlite_url, unique_table
from tests.migration.test_migrations import _catalog

ENV = """
from alembic import context
from sqlalchemy import create_engine, pool

config = context.config
options = {"version_table": config.get_main_option("version_table")}
if context.is_offline_mode():
    context.configure(
        dialect_name=config.get_main_option("dialect"), literal_binds=True, **options
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    engine = create_engine(config.get_main_option("sqlalchemy.url"), poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, **options)
        with context.begin_transaction():
            context.run_migrations()
"""

#: The first revision builds version 2 of the outbox and the whole inbox; the second,
#: written when relaybox brought version 3, upgrades the outbox.
CREATE = """
from alembic import op
from relaybox.integrations.alembic import create_inbox, create_outbox, drop_inbox, drop_outbox

revision = "a1"
down_revision = None


def upgrade():
    create_outbox(op, table={outbox!r}, version=2)
    create_inbox(op, table={inbox!r})


def downgrade():
    drop_inbox(op, table={inbox!r})
    drop_outbox(op, table={outbox!r})
"""
UPGRADE = """
from alembic import op
from relaybox.integrations.alembic import upgrade_outbox

revision = "a2"
down_revision = "a1"


def upgrade():
    upgrade_outbox(op, table={outbox!r}{after})


def downgrade():
    pass
"""

#: SQLAlchemy's URLs of the test databases, by relaybox's dialect.
_SQLALCHEMY = {
    "postgresql": PG_URL.replace("postgresql://", "postgresql+psycopg://"),
    "mysql": MYSQL_URL.replace("mysql://", "mysql+pymysql://"),
}


def _alembic(
    tmp_path: Path, url: str, dialect: str, outbox: str, inbox: str, after: str = ""
) -> Config:
    """An Alembic project in `tmp_path` with the two revisions, and its own version table;
    `after` is more arguments of the upgrade."""
    scripts = tmp_path / "migrations"
    (scripts / "versions").mkdir(parents=True)
    (scripts / "env.py").write_text(ENV)
    for name, body in (("a1_create.py", CREATE), ("a2_upgrade.py", UPGRADE)):
        text = textwrap.dedent(body).format(outbox=outbox, inbox=inbox, after=after)
        (scripts / "versions" / name).write_text(text)
    config = Config()
    config.set_main_option("script_location", str(scripts))
    config.set_main_option("sqlalchemy.url", url)
    config.set_main_option("dialect", dialect)
    config.set_main_option("version_table", f"{outbox}_alembic")
    return config


def _versions(url: str, table: str) -> set[int]:
    return {int(row[0]) for row in fetch_all(url, f"SELECT version FROM {table}_migrations")}


def _left(url: str, dialect: str, table: str) -> list[tuple[object, ...]]:
    """What is left in the database whose name starts with `table`: tables, and on
    PostgreSQL functions and types."""
    if dialect == "sqlite":
        return fetch_all(url, f"SELECT name FROM sqlite_master WHERE name LIKE '{table}%'")
    query = f"SELECT table_name FROM information_schema.tables WHERE table_name LIKE '{table}%'"
    if dialect == "postgresql":
        query += (
            f" UNION ALL SELECT proname::text FROM pg_proc WHERE proname LIKE '{table}%'"
            f" UNION ALL SELECT typname::text FROM pg_type WHERE typname LIKE '{table}%'"
            " AND typname NOT LIKE '\\_%' AND typname NOT LIKE '%\\_alembic'"
        )
    return fetch_all(url, query)


@pytest.mark.parametrize("dialect", sql.DIALECTS)
async def test_alembic_upgrades_and_downgrades_what_relaybox_migrate_would_build(
    dialect: sql.Dialect, tmp_path: Path
) -> None:
    url = {"postgresql": PG_URL, "mysql": MYSQL_URL}.get(dialect, sqlite_url(tmp_path / "a.db"))
    outbox, inbox, reference = unique_table("alo"), unique_table("ali"), unique_table("alr")
    config = _alembic(tmp_path, _SQLALCHEMY.get(dialect, url), dialect, outbox, inbox)
    latest = sql.migrations(dialect, outbox)[-1][0]
    try:
        command.upgrade(config, "a1")
        assert _versions(url, outbox) == {1, 2}
        command.upgrade(config, "head")
        assert _versions(url, outbox) == set(range(1, latest + 1))
        assert (await migrate(url, table=outbox)).applied == ()
        assert (await migrate(url, table=inbox, kind="inbox")).applied == ()
        await migrate(url, table=reference)
        assert _catalog(dialect, outbox, tmp_path / "a.db", "outbox") == _catalog(
            dialect, reference, tmp_path / "a.db", "outbox"
        )

        command.downgrade(config, "base")
        assert _left(url, dialect, outbox) == [(f"{outbox}_alembic",)]
        assert _left(url, dialect, inbox) == []
    finally:
        for table in (outbox, inbox, reference):
            drop(url, table)
        execute(url, f"DROP TABLE IF EXISTS {outbox}_alembic")


def test_offline_alembic_writes_the_migrations_and_their_record(tmp_path: Path) -> None:
    """`alembic upgrade --sql` reads nothing: creating writes every migration up to the
    pinned version; upgrading, which cannot tell where the database is, asks for it."""
    outbox, inbox = unique_table("alo"), unique_table("ali")
    config = _alembic(tmp_path, "postgresql://", "postgresql", outbox, inbox)
    config.output_buffer = io.StringIO()
    command.upgrade(config, "a1", sql=True)
    script = config.output_buffer.getvalue()
    assert f"INSERT INTO {outbox}_migrations (version, name) VALUES (2, 'operator')" in script
    assert "VALUES (3, " not in script.split(f"INSERT INTO {inbox}_migrations")[0]
    assert f"CREATE OR REPLACE FUNCTION {outbox}_claim(" in script
    assert "::" in script  # PostgreSQL's casts in the functions, untouched by bind params
    with pytest.raises(ConfigurationError, match="pass after=VERSION"):
        command.upgrade(config, "a1:a2", sql=True)

    told = _alembic(tmp_path / "told", "postgresql://", "postgresql", outbox, inbox, ", after=2")
    told.output_buffer = io.StringIO()
    command.upgrade(told, "a1:a2", sql=True)
    script = told.output_buffer.getvalue()
    assert f"INSERT INTO {outbox}_migrations (version, name) VALUES (3, 'activity')" in script
    assert f"CREATE TABLE IF NOT EXISTS {outbox}_activity" in script
    assert "VALUES (2, " not in script
