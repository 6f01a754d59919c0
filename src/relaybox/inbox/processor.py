"""What a broker consumer (`relaybox.consumers.*`) hands each delivery to: a relational
`Consumer`, or an `EntityConsumer` for state kept outside a relational transaction."""

from __future__ import annotations

from typing import Protocol

from relaybox.core.incoming import Incoming
from relaybox.inbox.consumer import Processed


class Processor(Protocol):
    """Processes one decoded delivery; the broker acknowledges it once `process`
    returned, and hands it back (redelivers) when it raised."""

    activity_interval: float | None

    async def process(
        self, message: Incoming, *, max_attempts: int = ..., redelivered: bool = False
    ) -> Processed:
        """Apply `message` once, or park it; raise to have it delivered again."""

    async def maintain(self) -> None:
        """Work beside the deliveries (replays, activity) until cancelled, or none."""

    async def record_activity(self) -> bool:
        """Write the counts not written yet; False if that failed."""
