"""A relay that holds partitions has its storage plan the read and the settle while its
first heartbeat runs (a storage that can: `PlansAhead`), and a failure to do so costs
nothing but the planning."""

from __future__ import annotations

from relaybox import Relay
from relaybox.core.partitions import DEFAULT_PARTITIONS
from relaybox.core.records import Routing
from relaybox.errors import StorageOperationalError
from relaybox.ports import PlansAhead
from relaybox.publishers.memory import MemoryPublisher
from relaybox.storage.memory import MemoryStorage
from tests.relay_support import eventually, fast_settings, messages


class Planning(MemoryStorage):
    """The in-memory storage, recording what it is asked to plan (and failing if told)."""

    def __init__(self, *, fail: bool = False) -> None:
        super().__init__()
        self.planned: list[tuple[object, ...]] = []
        self._fail = fail

    async def plan_read(self, partition_count: int = DEFAULT_PARTITIONS) -> None:
        self.planned.append(("read", partition_count))
        if self._fail:
            raise StorageOperationalError("the database went away")

    async def plan_settle(
        self, partition_count: int = DEFAULT_PARTITIONS, *, delete: bool = True
    ) -> None:
        self.planned.append(("settle", partition_count, delete))
        if self._fail:
            raise StorageOperationalError("the database went away")


async def test_a_relay_plans_its_read_and_its_settle_once_at_its_start() -> None:
    storage = Planning()
    assert isinstance(storage, PlansAhead)
    assert not isinstance(MemoryStorage(), PlansAhead)
    relay = Relay(storage, {"default": MemoryPublisher()}, settings=fast_settings(partitions=8))
    async with relay:
        (processor,) = relay.processors
        await eventually(lambda: processor.metrics.heartbeats >= 2)
    assert sorted(storage.planned) == [("read", 8), ("settle", 8, True)]


async def test_a_relay_that_keeps_published_rows_plans_that_settle() -> None:
    storage = Planning()
    settings = fast_settings(partitions=4, published_retention=60.0)
    async with Relay(storage, {"default": MemoryPublisher()}, settings=settings):
        await eventually(lambda: len(storage.planned) == 2)
    assert sorted(storage.planned) == [("read", 4), ("settle", 4, False)]


async def test_planning_that_fails_leaves_the_relay_publishing() -> None:
    storage = Planning(fail=True)
    await storage.write(Routing.of(["default"], None).rows(messages(["a", "b"], per_key=3)))
    publisher = MemoryPublisher()
    async with Relay(storage, {"default": publisher}, settings=fast_settings()):
        await eventually(lambda: len(publisher.published) == 6)
    assert len(storage.planned) == 2
    assert [m.key for m in publisher.published if m.key == "a"] == ["a"] * 3
