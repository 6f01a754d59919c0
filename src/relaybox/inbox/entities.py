"""`EntityConsumer`: each message's effects exactly once for a consumer whose state has
no relational transaction to share with an inbox record (a Redis key, a JSON document
per aggregate).

Two ports carry it (`relaybox.ports.EntityStore`, `relaybox.ports.DedupStore`). For a
message M of entity E:

1. load E (or a new one);
2. if the dedup store holds M, stop: it was done. This comes after the load: of two
   copies racing, the one that loaded an older version fails its save and loads again,
   then finds M in the dedup store or in E's outbox. Checked before the load, both
   copies could pass it;
3. if E's outbox has no entry for M: run the handler on E's state and put the new
   state, and the messages it produced (their ids fixed now), under outbox[M];
4. save E if its version has not moved, state and outbox in one write; if it moved,
   start again at 1 (at most `max_conflicts` times, then `EntityConflictError`: the
   message is not acknowledged and comes again);
5. send outbox[M] through the publishers, each confirmed, or raise: redelivered, the
   message sends the same messages, with the same ids, again;
6. add M to the dedup store;
7. remove outbox[M] from E (a versioned save too, reloading on a conflict);
8. return: the broker consumer acknowledges.

A crash between any two steps leaves either nothing (before 4), an outbox entry that
the next delivery sends again (4 to 6), or a dedup entry that makes it a duplicate (6
on; its outbox entry, if still there, is removed then). So the effects apply once and
every outgoing message goes out at least once, under one id. docs/entities.md says
what the stores must guarantee for that to hold.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from relaybox.core.entities import Entity, Outgoing, check_id
from relaybox.core.incoming import Incoming
from relaybox.core.message import Message
from relaybox.core.records import StoredMessage
from relaybox.errors import (
    BrokerError,
    ConfigurationError,
    EntityConflictError,
    InboxError,
    UnknownTargetError,
)
from relaybox.inbox.consumer import DEFAULT_MAX_ATTEMPTS, Processed
from relaybox.ports import DedupStore, EntityStore, Publisher

logger = logging.getLogger(__name__)

#: What a handler returns: the entity's new state and the messages to send.
Effects = tuple[Any, Iterable[Message]]
EntityHandler = Callable[[Any, Incoming], Effects | Awaitable[Effects]]
#: Keeps a message that can never be applied (`park(message, error)`), somewhere an
#: operator looks; it is then recorded as done.
Park = Callable[[Incoming, str], Awaitable[None]]
#: Saves tried per step before a message is handed back to the broker.
DEFAULT_MAX_CONFLICTS = 10


class _HandlerFailed(Exception):
    """The handler raised (as `__cause__`); nothing was saved."""


class EntityConsumer:
    """Runs `handler(state, message) -> (new state, messages to send)` once per message,
    on the entity `entity_id(message)` names (the message's key by default).

    A new entity starts from `initial_state()`. `publishers` maps target names to
    started publishers (the relay's, `relaybox.publishers`); a message without targets
    goes to "default". The consumer neither starts nor closes them, nor the stores.

    It serves the broker consumers (`relaybox.consumers.*`) as a `Consumer` does: they
    acknowledge after `process` returned. A handler that raises is redelivered by the
    broker; once the broker's delivery count reaches `max_attempts` and `park` is given,
    the message is handed to `park` and recorded as done (parked at least once: a crash
    between the two parks it again). Without `park`, or on a broker that counts no
    deliveries, the broker's own redelivery limit decides.
    """

    def __init__(
        self,
        handler: EntityHandler,
        *,
        entities: EntityStore,
        dedup: DedupStore,
        publishers: Mapping[str, Publisher],
        entity_id: Callable[[Incoming], str] | None = None,
        initial_state: Callable[[], Any] = lambda: None,
        park: Park | None = None,
        max_conflicts: int = DEFAULT_MAX_CONFLICTS,
    ) -> None:
        if not callable(handler) or not callable(initial_state):
            raise ConfigurationError("EntityConsumer needs a callable handler and initial_state")
        if not isinstance(max_conflicts, int) or max_conflicts < 1:
            raise ConfigurationError(f"max_conflicts={max_conflicts!r}: must be at least 1")
        self.handler = handler
        self.entities = entities
        self.dedup = dedup
        self.publishers = dict(publishers)
        self.entity_id = entity_id or _key
        self.initial_state = initial_state
        self.park = park
        self.max_conflicts = max_conflicts
        #: The broker consumers write no activity for an entity consumer.
        self.activity_interval: float | None = None
        self.applied = 0
        self.duplicates = 0
        self.resumed = 0
        self.parked = 0
        self.conflicts = 0

    async def process(
        self,
        message: Incoming,
        *,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        redelivered: bool = False,
    ) -> Processed:
        """Apply `message` once (steps 1-7 above); raise, leaving it unacknowledged, when
        it must come again. APPLIED: the handler's effects were saved by this call;
        DUPLICATE: an earlier delivery saved them (this one may have finished sending
        them); PARKED: handed to `park`. `redelivered` is taken as the broker consumers
        pass it and not used: parking goes by the broker's delivery count alone."""
        if max_attempts < 1:
            raise ConfigurationError(f"max_attempts={max_attempts!r}: must be at least 1")
        message_id = check_id("message id", message.id)
        entity_id = ""
        for _ in range(self.max_conflicts):
            try:
                entity_id = self._entity_of(message)
                outcome = await self._attempt(entity_id, message_id, message)
            except _HandlerFailed as failed:
                error = failed.__cause__ or failed
                attempts = message.delivery_count
                if self.park is None or attempts is None or attempts < max_attempts:
                    raise error from None
                return await self._park(message, f"{type(error).__name__}: {error}")
            if outcome is not None:
                return outcome
            self.conflicts += 1
        raise EntityConflictError(
            f"entity {entity_id!r} changed under {self.max_conflicts} saves in a row "
            f"while applying {message_id}"
        )

    def _entity_of(self, message: Incoming) -> str:
        """The id of the message's entity; a message that names none is as unusable as
        one its handler rejects."""
        try:
            return check_id("entity id", self.entity_id(message))
        except Exception as error:
            raise _HandlerFailed from error

    async def _attempt(
        self, entity_id: str, message_id: str, message: Incoming
    ) -> Processed | None:
        """Steps 1 to 7 once; None when the save of step 4 lost to another writer."""
        entity = await self.entities.load(entity_id) or Entity(entity_id, self.initial_state())
        if await self.dedup.processed(message_id):
            if message_id in entity.outbox:  # a crash between steps 6 and 7
                await self._forget(entity_id, message_id, entity)
            self.duplicates += 1
            logger.info("duplicate %s skipped", message_id,
                        extra={"action": "inbox_duplicate", "message_id": message_id})  # fmt: skip
            return Processed.DUPLICATE
        outgoing = entity.outbox.get(message_id)
        outcome = Processed.DUPLICATE
        saved = entity
        if outgoing is None:
            try:
                state, messages = await _call(self.handler, entity.state, message)
                outgoing = tuple(Outgoing.of(m) for m in messages)
                updated = entity.applied(message_id, state, outgoing)
                updated.encoded_state()  # a state JSON cannot hold is the handler's fault
            except Exception as error:
                raise _HandlerFailed from error
            if not await self.entities.save(updated, entity.version):
                return None
            outcome, saved = Processed.APPLIED, updated
        await self._send(outgoing)
        await self.dedup.add(message_id)
        await self._forget(entity_id, message_id, saved)
        if outcome is Processed.APPLIED:
            self.applied += 1
        else:
            self.resumed += 1
        return outcome

    async def _send(self, outgoing: Sequence[Outgoing]) -> None:
        """Send every message to each of its targets; raise unless all were confirmed."""
        by_target: dict[tuple[str, bool], list[StoredMessage]] = {}
        for message in outgoing:
            for target, external in message.destinations():
                by_target.setdefault((target, external), []).append(
                    message.stored(target, external)
                )
        for (target, _), messages in by_target.items():
            publisher = self.publishers.get(target)
            if publisher is None:
                raise UnknownTargetError(f"no publisher for target {target!r}")
            for batch in _distinct_keys(messages):
                results = await publisher.publish(batch)
                for sent, result in zip(batch, results, strict=True):
                    if not result.acked:
                        raise BrokerError(
                            f"{target} did not confirm {sent.id}: {result.error or result.outcome}"
                        )

    async def _forget(self, entity_id: str, message_id: str, known: Entity) -> None:
        """Step 7: remove outbox[message_id] from `known`, the entity as this consumer
        last loaded or saved it; reload after each conflict."""
        entity: Entity | None = known
        for _ in range(self.max_conflicts):
            if entity is None or message_id not in entity.outbox:
                return
            if await self.entities.save(entity.sent(message_id), entity.version):
                return
            self.conflicts += 1
            entity = await self.entities.load(entity_id)
        raise EntityConflictError(
            f"entity {entity_id!r} changed under {self.max_conflicts} saves in a row "
            f"while removing the sent messages of {message_id}"
        )

    async def _park(self, message: Incoming, error: str) -> Processed:
        assert self.park is not None
        await self.park(message, error)
        await self.dedup.add(message.id)
        self.parked += 1
        logger.error("parked %s: %s", message.id, error,
                     extra={"action": "message_parked", "message_id": message.id})  # fmt: skip
        return Processed.PARKED

    async def maintain(self) -> None:
        """Nothing runs beside the deliveries: the stores expire their own entries
        (`SqlDedupStore.purge` is for a scheduled job)."""

    async def record_activity(self) -> bool:
        """No activity table to write: the counters are attributes."""
        return True


def _key(message: Incoming) -> str:
    if message.key is None:
        raise InboxError(f"message {message.id} has no key to name its entity by")
    return message.key


async def _call(handler: EntityHandler, state: Any, message: Incoming) -> Effects:
    result = handler(state, message)
    if inspect.isawaitable(result):
        result = await result
    state, messages = result
    return state, list(messages)


def _distinct_keys(messages: list[StoredMessage]) -> list[list[StoredMessage]]:
    """`messages` in order, cut into publish calls without two of one key (a publisher
    need not order a call's messages)."""
    batches: list[list[StoredMessage]] = [[]]
    keys: set[str] = set()
    for message in messages:
        if message.key is not None and message.key in keys:
            batches.append([])
            keys.clear()
        if message.key is not None:
            keys.add(message.key)
        batches[-1].append(message)
    return [batch for batch in batches if batch]
