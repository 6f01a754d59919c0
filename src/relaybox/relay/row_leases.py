"""A relay that leases each row (`relaybox relay --no-partition-leases`).

Every relay claims from every partition, and each row it claims moves to `processing`
under a lease of its own: `locked_by` names the relay, `locked_until` ends the lease,
and the claim's token fences every later mark, so a relay whose lease ran out (and was
taken over) changes nothing. A publish that runs long renews the lease of its rows; one
still running when the lease (as last renewed) runs out is cancelled, since another
relay may take the rows then and publish the key's next messages. A row whose lease ran
out is simply claimed again.

Each row is written twice (claimed, then settled), where a relay that holds partitions
writes it once; in exchange every row's state is in the table, and a relay needs no
membership to start claiming.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from relaybox.core.records import Claim, StoredMessage
from relaybox.errors import RelayboxError
from relaybox.ports import RowLeaseStorage
from relaybox.relay.delivery import Settlement
from relaybox.relay.processor import Processor

logger = logging.getLogger(__name__)


class RowLeaseProcessor(Processor[RowLeaseStorage]):
    async def _claim(self, targets: list[str]) -> Claim:
        settings = self._settings
        return await self._db.claims.claim(
            self.worker,
            limit=settings.batch_size,
            lease_seconds=settings.lease_seconds,
            targets=targets,
            partition_count=settings.partitions,
            max_bytes=settings.max_claim_bytes,
        )

    async def _deliver(self, claim: Claim) -> None:
        """Publish and settle one claim, never past its lease. Cancelled (stop()), it
        settles what the brokers confirmed and releases the rest, unless cancelled
        again meanwhile."""
        lease = self._settings.lease_seconds
        margin = min(1.0, lease / 10)
        deadline = [time.monotonic() + lease]
        settlement = Settlement()
        try:
            async with asyncio.timeout_at(deadline[0] - margin) as guard:
                renewer = asyncio.create_task(self._renew(claim, deadline, guard, margin))
                try:
                    await self._delivery.run(
                        claim.messages, settlement, lambda: time.monotonic() < deadline[0]
                    )
                finally:
                    renewer.cancel()
        except TimeoutError:
            self.metrics.leases_lost += 1
            logger.warning(
                "lease ran out while publishing; the rest is left to the next claim",
                extra={"action": "lease_lost"},
            )
            await self._settle(claim, _rest_released(claim, settlement))
            return
        except asyncio.CancelledError:
            await self._settle(claim, _rest_released(claim, settlement))
            raise
        await self._settle(claim, settlement)

    async def _renew(
        self, claim: Claim, deadline: list[float], guard: asyncio.Timeout, margin: float
    ) -> None:
        seqs = [m.seq for m in claim.messages]
        while True:
            await asyncio.sleep(self._settings.renew_interval)
            asked = time.monotonic()
            try:
                renewed = await self._db.settles.renew(
                    claim.token, seqs, self._settings.lease_seconds
                )
            except RelayboxError as error:
                logger.warning("lease renewal failed: %s", error, extra={"action": "renew"})
                continue
            if renewed < len(seqs):  # some rows went to another worker: stop publishing
                deadline[0] = 0.0
                guard.reschedule(asyncio.get_running_loop().time())
                return
            deadline[0] = asked + self._settings.lease_seconds
            guard.reschedule(deadline[0] - margin)

    async def _settle(self, claim: Claim, settlement: Settlement) -> None:
        """Record the outcomes, failures first. If a failure cannot be recorded, the
        later messages of its key are not recorded as published either: the failed
        one comes back when the lease runs out, and they come back after it, in order
        (published twice, but never first after their predecessor)."""
        storage, token = self._db.settles, claim.token
        held_back: dict[tuple[str, str], int] = {}  # (target, key) -> first unrecorded
        by_seq = {m.seq: m for m in claim.messages}
        if settlement.abandoned:
            abandoned, hold = settlement.abandoned, self._settings.hold_keys
            if not await self._record(
                "abandoned", lambda: storage.abandon(token, abandoned, hold_keys=hold)
            ):
                _hold_back(held_back, by_seq, (f.seq for f in abandoned))
        if settlement.failed:
            failed = settlement.failed
            if not await self._record("failed", lambda: storage.mark_failed(token, failed)):
                _hold_back(held_back, by_seq, (f.seq for f in failed))
        published = [s for s in settlement.published if not _behind(held_back, by_seq[s])]
        if published:
            delete = self._settings.published_retention == 0
            await self._record(
                "published", lambda: storage.mark_published(token, published, delete=delete)
            )
        if settlement.released:
            released = settlement.released
            await self._record("released", lambda: storage.release(token, released))

    async def _record(self, kind: str, step: Callable[[], Awaitable[int]]) -> bool:
        """Settle with a few retries and count it; False if it could not be recorded.
        Giving up loses nothing: the lease expires and the rows are delivered again."""
        count = await self._with_retries(kind, step)
        if count is None:
            return False
        setattr(self.metrics, kind, getattr(self.metrics, kind) + count)
        return True


def _rest_released(claim: Claim, settlement: Settlement) -> Settlement:
    """`settlement` with every row it says nothing about released."""
    settled = settlement.seqs()
    settlement.released.extend(m.seq for m in claim.messages if m.seq not in settled)
    return settlement


def _hold_back(
    held_back: dict[tuple[str, str], int], by_seq: dict[int, StoredMessage], seqs: Iterable[int]
) -> None:
    for seq in seqs:
        message = by_seq[seq]
        if message.key is not None:
            chain = (message.target, message.key)
            held_back[chain] = min(held_back.get(chain, seq), seq)


def _behind(held_back: dict[tuple[str, str], int], message: StoredMessage) -> bool:
    if message.key is None or not held_back:
        return False
    first = held_back.get((message.target, message.key))
    return first is not None and message.seq > first
