"""The relay engine: claim, publish, settle, retry, order, lease, clean up."""

from relaybox.relay.engine import Relay
from relaybox.relay.runner import RelayThread
from relaybox.relay.settings import RelaySettings

__all__ = ["Relay", "RelaySettings", "RelayThread"]
