"""The transactional writer: messages join the caller's transaction."""

from relaybox.writer.log_outbox import LogOutbox
from relaybox.writer.outbox import Outbox

__all__ = ["LogOutbox", "Outbox"]
