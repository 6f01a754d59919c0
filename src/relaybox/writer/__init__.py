"""The transactional writer: messages join the caller's transaction."""

from relaybox.writer.outbox import Outbox

__all__ = ["Outbox"]
