"""A relay inside a Flask application: the `Relaybox` extension.

    outbox = Outbox(table="outbox")
    relaybox = Relaybox(relay=lambda: Relay(DB_URL, {"default": "nats://..."}), outbox=outbox)
    relaybox.init_app(app)             # or Relaybox(app, relay=..., outbox=...)

    @app.post("/orders")
    def place():
        with engine.begin() as connection:            # or a psycopg transaction
            connection.execute(insert(orders), ...)
            relaybox.add(connection, Message(topic="orders", ...))
        ...

`add` writes the messages through the request's connection or session, in its
transaction (`Outbox.add`). When the request ends without an error, the relay of this
process hears of them and publishes at once; after an error it hears nothing, and
whatever the transaction committed anyway goes at the relay's next poll. The database
is the truth either way: a wake-up only saves the wait.

The relay runs in a background thread with its own event loop (`RelayThread`). It is
started lazily, by the first request a process serves, never at import: a server that
forks its workers from a master that imported the application (gunicorn with
`--preload`) thus gets one relay per worker, started after the fork, and the master and
Flask's reloader, which serve nothing, run none. A process forked from one whose relay
runs starts its own. The relays of one table share its partitions between them. The
relay stops, giving its partitions back, when the process exits (atexit) and, where
SIGTERM had its default action when the extension was set up (`flask run`), on SIGTERM;
gunicorn's workers handle SIGTERM themselves and exit, which runs atexit.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from flask import Flask, g

from relaybox.core.message import Message
from relaybox.relay.engine import Relay
from relaybox.relay.runner import RelayThread
from relaybox.writer.outbox import Outbox

#: Where a request keeps the messages it wrote, for the hand-off when it ends.
_WRITTEN = "relaybox_written"


class Relaybox:
    """Runs the relay `relay` builds in each process that serves the application, and
    hands it what `add` wrote once the request ends."""

    def __init__(
        self, app: Flask | None = None, *, relay: Callable[[], Relay], outbox: Outbox
    ) -> None:
        self.outbox = outbox
        self._factory = relay
        self._lock = threading.Lock()
        self._runner: RelayThread | None = None
        self._relay: Relay | None = None
        self._pid: int | None = None
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Start the relay before the first request of each process; hand it what each
        request wrote when the request ends without an error."""
        app.extensions["relaybox"] = self
        app.before_request(self._before_request)
        app.teardown_request(self._hand_off)
        self._stop_on_sigterm()

    @property
    def relay(self) -> Relay | None:
        """The relay of this process, once a request started it."""
        return self._relay if self._pid == os.getpid() else None

    def start(self) -> Relay:
        """Start this process's relay if it has none yet (a worker forked from a process
        whose relay ran has none: its thread stayed behind); return it."""
        with self._lock:
            if self._relay is None or self._pid != os.getpid():
                runner = RelayThread(self._factory)
                self._relay = runner.start()
                runner.attach(self.outbox)
                self._runner, self._pid = runner, os.getpid()
            return self._relay

    def stop(self, timeout: float | None = None) -> None:
        """Stop this process's relay, if it started one."""
        with self._lock:
            runner, self._runner, self._relay = self._runner, None, None
        if runner is not None and self._pid == os.getpid():
            runner.stop(timeout)

    def add(self, connection: Any, messages: Message | Iterable[Message]) -> list[Message]:
        """Write `messages` through `connection` (a SQLAlchemy connection or session, a
        psycopg or other DB-API connection) in its transaction, as `Outbox.add` does."""
        written = self.outbox.add(connection, messages)
        g.setdefault(_WRITTEN, []).extend(written)
        return written

    def _before_request(self) -> None:
        self.start()

    def _hand_off(self, error: BaseException | None) -> None:
        written: list[Message] = g.pop(_WRITTEN, [])
        if written and error is None:
            self.outbox.committed(written)

    def _stop_on_sigterm(self) -> None:
        """Where SIGTERM has its default action (which ends the process at once,
        skipping atexit), stop the relay first, then let the signal end the process."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, _frame: FrameType | None) -> None:
        relay = self.relay
        self.stop(None if relay is None else _grace(relay))
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _grace(relay: Relay) -> float:
    """How long an ending process waits for its relay: its shutdown timeout, and a
    little more for closing its connections."""
    return relay.settings.shutdown_timeout + 5.0
