"""Publishers: one per broker, all behind `relaybox.ports.Publisher`, chosen by URL.

Each scheme's module exposes `from_url(BrokerUrl) -> Publisher`; it is imported, with
its client library, only when a URL of that scheme is opened.
"""

from __future__ import annotations

import importlib

from relaybox.core.extras import needs_extras
from relaybox.core.publishing import Declared
from relaybox.core.urls import mask_url
from relaybox.errors import ConfigurationError
from relaybox.ports import Publisher, TopologyOwner
from relaybox.publishers.options import BrokerUrl

#: URL scheme -> the module that publishes to it.
SCHEMES: dict[str, str] = {
    "memory": "memory",
    "noop": "memory",
    "file": "file",
    "stdout": "file",
    "nats": "nats",
    "tls": "nats",
    "amqp": "amqp",
    "amqps": "amqp",
    "kafka": "kafka",
    "redis": "redis",
    "rediss": "redis",
    "mqtt": "mqtt",
    "mqtts": "mqtt",
    "http": "http",
    "https": "http",
    "celery+amqp": "celery",
    "celery+amqps": "celery",
    "celery+redis": "celery",
    "celery+rediss": "celery",
}


def open_publisher(url: str) -> Publisher:
    """A publisher for `url`, not yet started; see each module for its options."""
    scheme, sep, _ = url.partition("://")
    if not sep:
        raise ConfigurationError(
            f"broker URL {mask_url(url)!r} has no scheme, like nats:// or file://"
        )
    module_name = SCHEMES.get(scheme)
    if module_name is None:
        known = ", ".join(f"{s}://" for s in sorted(SCHEMES))
        raise ConfigurationError(
            f"no publisher for broker URL scheme {mask_url(scheme)!r}; known: {known}"
        )
    with needs_extras(f"the broker URL {scheme}://"):
        module = importlib.import_module(f"relaybox.publishers.{module_name}")
    parsed = BrokerUrl(url)
    publisher: Publisher = module.from_url(parsed)
    parsed.done()
    return publisher


async def setup_topology(url: str) -> list[Declared]:
    """Create what the target at `url` needs on its broker, as its URL's options say
    (each publisher's module lists them), leaving what exists; [] for a target that
    needs nothing. Safe to run again, and while relays run."""
    publisher = open_publisher(url)
    if not isinstance(publisher, TopologyOwner):
        return []
    return list(await publisher.setup_topology())
