"""Publishers: one per broker, all behind `relaybox.ports.Publisher`, chosen by URL.

Broker client libraries are imported only when their scheme is used.
"""

from __future__ import annotations

from relaybox.errors import ConfigurationError
from relaybox.ports import Publisher


def open_publisher(url: str) -> Publisher:
    """A publisher for `url`, not yet started: memory://, noop://, file://PATH."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ConfigurationError(f"broker URL {url!r} has no scheme, like nats:// or file://")
    if scheme == "memory":
        from relaybox.publishers.memory import MemoryPublisher

        return MemoryPublisher()
    if scheme == "noop":
        from relaybox.publishers.memory import NoopPublisher

        return NoopPublisher()
    if scheme == "file":
        from relaybox.publishers.file import FilePublisher

        return FilePublisher(rest)
    raise ConfigurationError(f"no publisher for broker URL scheme {scheme!r}")
