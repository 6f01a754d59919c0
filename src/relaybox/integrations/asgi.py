"""A relay inside an ASGI application (FastAPI, Starlette), run by its lifespan.

    outbox = Outbox(table="outbox")
    app = FastAPI(lifespan=relay_lifespan(
        lambda: Relay(DB_URL, {"default": "nats://..."}, table="outbox"), outbox
    ))

    @app.post("/orders")
    async def place(...):
        ... write the order and `outbox.add_async(...)` in one transaction, commit ...
        outbox.committed(written)      # the relay of this process publishes at once

The lifespan builds the relay, starts it, and attaches the outboxes, so that each
`committed` wakes it rather than leaving the messages to its next poll; it stops the
relay when the server shuts the application down, which finishes or hands back what is
in flight and gives the relay's partitions back. Requests see the relay as
`request.state.relay`.

The relay is built by `factory` inside the lifespan, that is in the process that serves
and on its event loop: never at import. Servers that fork their workers from a master
that imported the application (gunicorn, `--preload` included) run the lifespan in
each worker after the fork, so each worker runs one relay, and the relays of a table
share its partitions between them. `uvicorn --workers N` starts each worker as a fresh
process that runs the lifespan likewise.

An application that has a lifespan of its own uses `embedded_relay` inside it:

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with embedded_relay(make_relay, outbox) as relay:
            ... the application's own startup ...
            yield {"relay": relay}
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from relaybox.relay.engine import Relay
from relaybox.writer import LogOutbox, Outbox

#: What an ASGI lifespan is to FastAPI and Starlette: called with the application.
Lifespan = Callable[[Any], contextlib.AbstractAsyncContextManager[Mapping[str, Any]]]


@contextlib.asynccontextmanager
async def embedded_relay(
    factory: Callable[[], Relay], *outboxes: Outbox | LogOutbox
) -> AsyncIterator[Relay]:
    """Build a relay with `factory`, start it, attach `outboxes`; stop it on leaving."""
    relay = factory()
    async with relay:
        for outbox in outboxes:
            relay.attach(outbox)
        yield relay


def relay_lifespan(factory: Callable[[], Relay], *outboxes: Outbox | LogOutbox) -> Lifespan:
    """A lifespan that runs the relay `factory` builds while the application serves,
    woken by the commits of `outboxes`; its state holds the relay as `relay`."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[Mapping[str, Any]]:
        async with embedded_relay(factory, *outboxes) as relay:
            yield {"relay": relay}

    return lifespan
