"""Domain events recorded on SQLAlchemy entities land in the outbox in the same flush."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import String, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from relaybox import Message, Outbox
from relaybox.integrations.sqlalchemy import HasDomainEvents, track_domain_events
from relaybox.migrations import migrate
from tests.databases import MYSQL_URL, PG_URL, drop, sqlite_url, unique_table


def make_model(table: str) -> tuple[type[Any], type[Any]]:
    class Base(DeclarativeBase):
        pass

    class Order(Base, HasDomainEvents):
        __tablename__ = table
        id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
        status: Mapped[str] = mapped_column(String(20))

        def place(self) -> None:
            self.status = "placed"
            # The id is assigned by the database: build the event at flush time.
            self.record_event(
                lambda: Message(
                    topic="orders", key=str(self.id), type="OrderPlaced", payload={"id": self.id}
                )
            )

    return Base, Order


@pytest.fixture(params=["postgresql", "mysql", "sqlite"])
def orm(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    outbox_table, order_table = unique_table("orm"), unique_table("orders")
    relaybox_url = {"postgresql": PG_URL, "mysql": MYSQL_URL}.get(
        request.param, sqlite_url(tmp_path / "o.db")
    )
    sa_url = {
        "postgresql": PG_URL.replace("postgresql://", "postgresql+psycopg://"),
        "mysql": MYSQL_URL.replace("mysql://", "mysql+pymysql://"),
    }.get(request.param, f"sqlite:///{tmp_path / 'o.db'}")
    asyncio.run(migrate(relaybox_url, table=outbox_table))
    engine = sqlalchemy.create_engine(sa_url, poolclass=sqlalchemy.pool.NullPool)
    base, order = make_model(order_table)
    base.metadata.create_all(engine)
    outbox = Outbox(table=outbox_table)
    factory = sessionmaker(engine)
    track_domain_events(factory, outbox)
    try:
        yield {
            "engine": engine,
            "factory": factory,
            "Order": order,
            "outbox": outbox,
            "table": outbox_table,
        }
    finally:
        base.metadata.drop_all(engine)
        engine.dispose()
        drop(relaybox_url, outbox_table)


def outbox_rows(orm: dict[str, Any]) -> list[tuple[str, str]]:
    with orm["engine"].connect() as conn:
        key = "`key`" if conn.dialect.name in ("mysql", "mariadb") else "key"
        rows = conn.exec_driver_sql(f"SELECT {key}, type FROM {orm['table']} ORDER BY seq")
        return [tuple(row) for row in rows]


def test_events_are_written_with_the_entity_and_announced_after_commit(orm: dict[str, Any]) -> None:
    announced: list[Message] = []
    orm["outbox"].subscribe(announced.extend)
    with orm["factory"]() as session:
        order = orm["Order"](status="new")
        order.place()
        session.add(order)
        session.flush()
        assert outbox_rows(orm) == []  # flushed, not committed: invisible to others
        assert not announced
        session.commit()
        order_id = order.id
    assert outbox_rows(orm) == [(str(order_id), "OrderPlaced")]
    assert [m.key for m in announced] == [str(order_id)]


def test_rollback_discards_entity_and_events(orm: dict[str, Any]) -> None:
    announced: list[Message] = []
    orm["outbox"].subscribe(announced.extend)
    with orm["factory"]() as session:
        order = orm["Order"](status="new")
        order.place()
        session.add(order)
        session.flush()
        session.rollback()
    assert outbox_rows(orm) == []
    assert not announced
    with orm["factory"]() as session:
        assert session.scalars(select(orm["Order"])).all() == []


def test_an_event_on_an_unchanged_entity_is_still_written(orm: dict[str, Any]) -> None:
    with orm["factory"]() as session:
        order = orm["Order"](status="placed")
        session.add(order)
        session.commit()
        order.record_event(Message(topic="orders", key=str(order.id), type="OrderViewed"))
        session.commit()
        assert outbox_rows(orm) == [(str(order.id), "OrderViewed")]


def test_each_event_is_written_once_across_flushes(orm: dict[str, Any]) -> None:
    with orm["factory"]() as session:
        order = orm["Order"](status="new")
        order.place()
        session.add(order)
        session.flush()
        order.status = "paid"
        session.flush()
        session.commit()
    assert len(outbox_rows(orm)) == 1


def test_session_class_level_tracking(orm: dict[str, Any]) -> None:
    # track_domain_events also accepts a Session instance.
    with Session(orm["engine"]) as session:
        track_domain_events(session, orm["outbox"])
        order = orm["Order"](status="new")
        order.place()
        session.add(order)
        session.commit()
    assert len(outbox_rows(orm)) == 1


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
async def test_async_session_writes_events_in_the_same_flush(dialect: str, tmp_path: Path) -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    outbox_table, order_table = unique_table("orm"), unique_table("orders")
    relaybox_url = PG_URL if dialect == "postgresql" else sqlite_url(tmp_path / "a.db")
    sa_url = (
        PG_URL.replace("postgresql://", "postgresql+asyncpg://")
        if dialect == "postgresql"
        else f"sqlite+aiosqlite:///{tmp_path / 'a.db'}"
    )
    await migrate(relaybox_url, table=outbox_table)
    engine = create_async_engine(sa_url, poolclass=sqlalchemy.pool.NullPool)
    base, order = make_model(order_table)

    class TrackedSession(Session):  # AsyncSession runs a sync Session underneath
        pass

    outbox = Outbox(table=outbox_table)
    track_domain_events(TrackedSession, outbox)
    announced: list[Message] = []
    outbox.subscribe(announced.extend)
    factory = async_sessionmaker(engine, sync_session_class=TrackedSession, expire_on_commit=False)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(base.metadata.create_all)
        async with factory() as session:
            entity = order(status="new")
            entity.place()
            session.add(entity)
            await session.commit()
            order_id = entity.id
        async with factory() as session:
            rolled = order(status="new")
            rolled.place()
            session.add(rolled)
            await session.flush()
            await session.rollback()
        async with engine.connect() as conn:
            rows = (await conn.exec_driver_sql(f"SELECT type FROM {outbox_table}")).all()
        assert [tuple(r) for r in rows] == [("OrderPlaced",)]
        assert [m.key for m in announced] == [str(order_id)]
        async with engine.begin() as conn:
            await conn.run_sync(base.metadata.drop_all)
    finally:
        await engine.dispose()
        drop(relaybox_url, outbox_table)
