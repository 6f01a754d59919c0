"""When a claim is worth making beside batches still in flight.

The relay publishes up to `max_in_flight` batches at once, so it may claim again while
earlier batches are out. A claim beside them finds nothing new, though, when those
batches hold the head of every key this relay may take: every later row of such a key
waits behind its head. Claiming anyway costs the database a read for nothing, again and
again until a batch settles. Three facts steer it:

- *deep*: the last claim took two rows or more of one key. The backlog is deep per key,
  so the batch likely holds the head of every key: wait for a batch to settle.
- *full*: the last claim took a whole batch, so there is likely more: claim beside it.
  A claim that was not full means the backlog is gone, and resets what follows.
- *futile*: claims beside full batches came back empty, this many times in a row; the
  next claim beside one waits for 1, 2, 4 ... 32 batches to settle (`hold`).

A relay whose reads take the rows behind those in flight (`follows`) finds the keys'
next rows beside the batch that holds their heads: *deep* does not hold it back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from relaybox.core.records import StoredMessage

#: Empty claims in a row after which the wait stops growing (2 ** (6 - 1) = 32 batches).
MOST_FUTILE = 6


@dataclasses.dataclass
class ClaimPacing:
    batch_size: int
    full: bool = False
    futile: int = 0
    #: Reads take the rows queued behind those in flight in their key.
    follows: bool = False
    #: Batches that must settle before the next claim beside one in flight.
    hold: int = 0
    #: The last claim's rows, until `deep` is asked of them: a relay whose reads follow
    #: the rows in flight seldom asks, and makes no pass over its batches for it.
    _last: Sequence[StoredMessage] = dataclasses.field(default=(), init=False, repr=False)
    _deep: bool | None = dataclasses.field(default=False, init=False, repr=False)

    @property
    def deep(self) -> bool:
        """Whether the last claim took two rows or more of one key."""
        if self._deep is None:
            self._deep = _deep(self._last)
            self._last = ()
        return self._deep

    def wait_for_a_settle(self, in_flight: bool) -> bool:
        """Whether the next claim should wait until a batch in flight has settled."""
        return in_flight and ((not self.follows and self.deep) or self.hold > 0)

    def beside(self, in_flight: bool) -> bool:
        """Whether a claim now runs beside a full batch in flight."""
        return in_flight and self.full

    def took(self, messages: Sequence[StoredMessage], count: int, *, beside: bool) -> None:
        """A claim (beside a full batch or not) took `count` rows, `messages`."""
        self._last, self._deep = messages, None  # looked at when `deep` is asked
        self.full = count >= self.batch_size
        if beside or not self.full:  # a claim beside one paid off, or the backlog is gone
            self.futile = self.hold = 0

    def found_nothing(self, *, beside: bool) -> None:
        """A claim came back empty."""
        if beside:
            self.futile = min(self.futile + 1, MOST_FUTILE)
            self.hold = 2 ** (self.futile - 1)

    def settled(self) -> None:
        """A batch in flight has settled."""
        self.hold = max(0, self.hold - 1)


def _deep(messages: Iterable[StoredMessage]) -> bool:
    """Whether two of `messages` share a (target, key)."""
    chains = [(m.target, m.key) for m in messages if m.key is not None]
    return len(set(chains)) < len(chains)
