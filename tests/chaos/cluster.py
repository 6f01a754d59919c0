"""Throwaway servers and a TCP proxy for the chaos suite; never the shared services.

`ThrowawayPostgres` runs its own PostgreSQL 15 cluster (initdb into a temporary
directory, as the postgres user, on a free port) and `ThrowawayMariaDB` its own MariaDB
server (mariadb-install-db into a temporary directory, its socket there too); a test
can crash either and start it again on the same port and data. `ThrowawayRedis` is a
redis-server whose append-only file is fsync'd on every write, so a restart keeps what
it confirmed. `Proxy` forwards one TCP port to another and can cut every connection
through it, refuse new ones for a while, slow them down, or stall them. NATS comes from
`relaybox.tools.embedded_nats`, RabbitMQ from the broker tests' private node.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pymysql
import redis

from tests.brokers.harness import end_process, free_port

PG_BIN = Path("/usr/lib/postgresql/15/bin")


class ThrowawayPostgres:
    """A private PostgreSQL server; `crash()` stops it as a power cut would (immediate
    shutdown: no checkpoint, crash recovery on the next start), `start()` brings it back
    on the same port and data."""

    def __init__(self, settings: dict[str, str] | None = None) -> None:
        self.port = free_port()
        #: Server settings on top of the defaults (wal_level=logical for log mode...).
        self.settings = dict(settings or {})
        self.dir = Path(tempfile.mkdtemp(prefix="relaybox-chaos-pg-"))
        self.data = self.dir / "data"
        self._process: subprocess.Popen[bytes] | None = None
        self._user = "postgres" if os.geteuid() == 0 else None
        if self._user is not None:
            entry = pwd.getpwnam(self._user)
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)
        subprocess.run(
            [str(PG_BIN / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust",
             "--no-sync", "-E", "UTF8"],
            user=self._user, check=True, capture_output=True,
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def url_via(self, port: int) -> str:
        return f"postgresql://postgres@127.0.0.1:{port}/postgres"

    def start(self) -> None:
        if self._process is not None:
            return
        log = (self.dir / "server.log").open("ab")
        self._process = subprocess.Popen(
            [str(PG_BIN / "postgres"), "-D", str(self.data), "-p", str(self.port),
             "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.dir}",
             "-c", "max_connections=200", "-c", "shared_buffers=128MB",
             *[a for name, value in self.settings.items() for a in ("-c", f"{name}={value}")]],
            user=self._user, stdout=log, stderr=log,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + 60
        while not self._ready():
            if self._process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"throwaway PostgreSQL did not start: see {self.dir}")
            time.sleep(0.1)

    def _ready(self) -> bool:
        result = subprocess.run(
            [str(PG_BIN / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-q"],
            check=False,
        )
        return result.returncode == 0

    def crash(self) -> None:
        """Immediate shutdown (SIGQUIT to the postmaster): like a crash, minus the disk."""
        self._signal(signal.SIGQUIT)

    def stop(self) -> None:
        self._signal(signal.SIGINT)  # fast shutdown

    def _signal(self, sig: signal.Signals) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.send_signal(sig)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class ThrowawayMariaDB:
    """A private MariaDB server; `crash()` SIGKILLs it (InnoDB recovers at the next
    start), `start()` brings it back on the same port and data. The database `chaos`
    is created on the first start."""

    database = "chaos"

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="relaybox-chaos-mariadb-"))
        self.data = self.dir / "data"
        self._user = pwd.getpwuid(os.geteuid()).pw_name  # mariadbd runs as root only if told
        self._process: subprocess.Popen[bytes] | None = None
        subprocess.run(
            ["mariadb-install-db", "--no-defaults", f"--datadir={self.data}",
             f"--user={self._user}", "--auth-root-authentication-method=normal",
             "--skip-test-db"],
            check=True, capture_output=True,
        )  # fmt: skip

    @property
    def url(self) -> str:
        return self.url_via(self.port)

    def url_via(self, port: int) -> str:
        return f"mysql://root@127.0.0.1:{port}/{self.database}"

    def connect(self, database: str | None = database) -> pymysql.Connection[Any]:
        return pymysql.connect(
            host="127.0.0.1", port=self.port, user="root", database=database,
            autocommit=True, connect_timeout=2,
        )  # fmt: skip

    def start(self) -> None:
        if self._process is not None:
            return
        first = not (self.data / self.database).exists()
        log = (self.dir / "server.log").open("ab")
        command = [
            "mariadbd", "--no-defaults", f"--datadir={self.data}", f"--user={self._user}",
            f"--port={self.port}", "--bind-address=127.0.0.1", f"--socket={self.dir}/sock",
            f"--pid-file={self.dir}/pid", "--skip-name-resolve", "--max-connections=300",
            "--innodb-buffer-pool-size=128M",
        ]  # fmt: skip
        self._process = subprocess.Popen(command, stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + 60
        while True:
            try:
                self.connect(None).close()
                break
            except pymysql.Error:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"throwaway MariaDB did not start ({shlex.join(command)}): see {self.dir}"
                    ) from None
                time.sleep(0.1)
        if first:
            with contextlib.closing(self.connect(None)) as conn, conn.cursor() as cursor:
                cursor.execute(f"CREATE DATABASE {self.database}")

    def crash(self) -> None:
        """SIGKILL: no clean shutdown, InnoDB's crash recovery on the next start."""
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait(30)

    def destroy(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            end_process(process, 30.0)
        shutil.rmtree(self.dir, ignore_errors=True)


class ThrowawayRedis:
    """A private redis-server with an append-only file fsync'd on every write (and no
    snapshots): what it confirmed is on disk, so `halt()` then `start()` keeps it. A
    memory-only Redis would lose its streams on a restart: a loss of the broker's, which
    no relay could prevent."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="relaybox-chaos-redis-"))
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        if self._process is not None:
            return
        with (self.dir / "server.log").open("ab") as log:
            self._process = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                 "--dir", str(self.dir), "--appendonly", "yes", "--appendfsync", "always",
                 "--save", ""],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        with redis.Redis.from_url(self.url, socket_timeout=2) as client:
            while True:
                try:
                    client.ping()  # refused with LOADING while it reads its file back
                    return
                except redis.RedisError:
                    if self._process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"throwaway Redis did not start: see {self.dir}"
                        ) from None
                    time.sleep(0.05)

    def halt(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            end_process(process)

    def destroy(self) -> None:
        self.halt()
        shutil.rmtree(self.dir, ignore_errors=True)


class Proxy:
    """Forwards 127.0.0.1:`port` to 127.0.0.1:`target`, in a thread of its own.

    `cut()` resets every open connection and refuses new ones until `restore()`;
    `stall()` keeps every connection open, and accepts new ones, but forwards nothing
    until `restore()`: a server that takes connections and never answers; `strand()`
    then leaves those connections silent for good and lets new ones through;
    `delay` (seconds) holds back each chunk in either direction, for a slow link."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self.delay = 0.0
        self.cuts = 0
        self._refusing = False
        self._flowing: asyncio.Event | None = None  # made in the proxy's own loop
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"proxy-{target}", daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._flowing = asyncio.Event()
        self._flowing.set()
        server = self._loop.run_until_complete(
            asyncio.start_server(self._accept, "127.0.0.1", self.port)
        )
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            # Connections left stranded wait on their own event: end them too.
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()
            return
        pair = {writer, up_writer}
        self._writers |= pair
        try:
            flowing = self._flowing  # this connection's, even after `strand()`
            assert flowing is not None
            await asyncio.gather(
                self._pipe(reader, up_writer, flowing), self._pipe(up_reader, writer, flowing)
            )
        finally:
            for each in pair:
                each.transport.abort()
            self._writers -= pair

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, flowing: asyncio.Event
    ) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                await flowing.wait()
                if self.delay:
                    await asyncio.sleep(self.delay)
                writer.write(data)
                await writer.drain()
        writer.transport.abort()  # one side ended: end the other (no half-open links)

    def _in_loop(self, action: Callable[[], None]) -> None:
        """Run `action` in the proxy's own loop and wait until it ran."""
        done = threading.Event()

        def run() -> None:
            action()
            done.set()

        self._loop.call_soon_threadsafe(run)
        done.wait(10)

    def _cut_now(self) -> None:
        self._refusing = True
        for writer in list(self._writers):
            writer.transport.abort()

    def _stall_now(self) -> None:
        assert self._flowing is not None
        self._flowing.clear()

    def _strand_now(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()

    def _restore_now(self) -> None:
        assert self._flowing is not None
        self._refusing = False
        self._flowing.set()

    def cut(self) -> None:
        self.cuts += 1
        self._in_loop(self._cut_now)

    def stall(self) -> None:
        self._in_loop(self._stall_now)

    def strand(self) -> None:
        """After `stall()`: the stalled connections stay silent for good, new ones flow
        (a failover that leaves the old connections hanging)."""
        self._in_loop(self._strand_now)

    def restore(self) -> None:
        self._in_loop(self._restore_now)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
