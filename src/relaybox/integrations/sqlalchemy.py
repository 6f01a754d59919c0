"""Domain events on SQLAlchemy entities, written to the outbox in the same flush.

    class Order(Base, HasDomainEvents):
        ...
        def place(self) -> None:
            self.status = "placed"
            self.record_event(lambda: Message(topic="orders", key=str(self.id), ...))

    track_domain_events(Session, outbox)   # a Session class, sessionmaker or instance

At every flush, events recorded by new, changed or deleted entities are inserted through
the session's own connection, after SQLAlchemy has written the entities (so generated
ids are known) and inside the same transaction. A recorded callable is called then, which
is how an event can carry an id the database assigns. After the session commits, the
outbox's commit listeners hear about the messages (the in-process hand-off to a relay);
after a rollback they are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

from relaybox.core.message import Message
from relaybox.writer.outbox import Outbox

EventSource = Message | Callable[[], Message]
_PENDING_KEY = "relaybox.committed_messages"


class HasDomainEvents:
    """Mixin for entities that raise domain events. Keeps them out of the mapped state."""

    def record_event(self, message: EventSource) -> None:
        """Queue a message (or a callable making one at flush time) for the next flush."""
        events: list[EventSource] = self.__dict__.setdefault("_relaybox_events", [])
        events.append(message)

    def pending_events(self) -> list[EventSource]:
        return list(self.__dict__.get("_relaybox_events", ()))

    def _take_events(self) -> list[EventSource]:
        events: list[EventSource] = self.__dict__.pop("_relaybox_events", [])
        return events


def _pending(entities: Iterable[Any]) -> list[HasDomainEvents]:
    return [e for e in entities if isinstance(e, HasDomainEvents) and e.pending_events()]


def track_domain_events(target: Any, outbox: Outbox) -> None:
    """Write entities' domain events to `outbox` at each flush of sessions of `target`."""

    def write(session: Session, entities: list[HasDomainEvents]) -> None:
        if not entities:
            return
        messages = [
            e if isinstance(e, Message) else e()
            for entity in entities
            for e in entity.pending_events()
        ]
        outbox.add(session.connection(), messages)
        for entity in entities:  # taken only once written: a failed flush keeps them
            entity._take_events()
        session.info.setdefault(_PENDING_KEY, []).extend(messages)

    @event.listens_for(target, "after_flush")
    def write_flushed_events(session: Session, _flush_context: Any) -> None:
        # Entities flushed earlier that only recorded an event since are clean, so they
        # are in the identity map but not in new/dirty/deleted.
        changed = (*session.new, *session.dirty, *session.deleted)
        unique = {
            id(e): e for e in (*changed, *session.identity_map.values())
        }  # no __hash__ needed
        write(session, _pending(unique.values()))

    @event.listens_for(target, "before_commit")
    def write_events_of_clean_entities(session: Session) -> None:
        if not (session.new or session.dirty or session.deleted):  # no flush will follow
            write(session, _pending(session.identity_map.values()))

    @event.listens_for(target, "after_commit")
    def announce(session: Session) -> None:
        messages = session.info.pop(_PENDING_KEY, None)
        if messages:
            outbox.committed(messages)

    @event.listens_for(target, "after_soft_rollback")
    def forget(session: Session, _previous_transaction: Any) -> None:
        session.info.pop(_PENDING_KEY, None)
