"""Relay fleets as if on separate hosts: network namespaces, one throwaway PostgreSQL.

Each namespace is a host of its own to the relays in it: its own network stack, reaching
the database over a veth pair and a bridge in the root namespace (TCP through the
kernel's network path, not loopback), while the CPU stays shared, so the database's limit
and the relays' use of it show, not a faster machine's. The script builds, on a private
/24 (`--subnet`, default 10.213.77.0/24) that exists only between these namespaces and the
root namespace:

    root namespace   bridge <prefix>br, address .1; a throwaway PostgreSQL 15 (initdb
                     as user postgres into a temporary directory, on a free port,
                     listening on .1 only)
    namespace i      <prefix>-i, veth <prefix>n<i> with address .(10 + i), its peer
                     <prefix>h<i> on the bridge

and, for each layout (`--namespaces` 2,4 x `--relays` 1,2,4; relays go round-robin over
the namespaces) and backlog (`--messages` 20000,100000), writes the backlog from the
root namespace, starts the relays (`relaybox relay`, no-op broker, its other defaults)
in their namespaces with `ip netns exec`, and times them from the spawn to the table
holding no live row (rows leave it as their publish is settled; one probe of the
primary key every `--poll` s). Each run has a freshly migrated table of its own: cold,
the backlog is written into it and never analyzed; warm, VACUUM ANALYZE follows.
Meanwhile it samples where the time goes:

    pg_cpu_percent_of_one_core   the server's processes (postmaster and every child of
                                 it) from /proc, over the drain
    relay_cpu_percent_of_one_core  each relay process, from /proc
    wait_events                  the relays' backends in pg_stat_activity, sampled every
                                 `--poll` s: state and wait event, counted
    network                      bytes through the bridge (/sys/class/net), as MB/s

Everything is removed at the end, also on failure or SIGTERM: the relays and the server
stopped by their PIDs (SIGTERM / SIGINT, then SIGKILL), the namespaces deleted (their
veths go with them), the bridge deleted, the temporary directory removed. Needs root,
iproute2 and PostgreSQL 15's binaries (`--pg-bin`). Prints one JSON document.

    .venv/bin/python benchmarks/fleet_hosts.py [--namespaces 2,4] [--relays 1,2,4]
        [--messages 20000,100000] [--starts cold,warm]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import ipaddress
import json
import os
import pwd
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_seconds, machine

PG_BIN = Path("/usr/lib/postgresql/15/bin")
START_TIMEOUT = 60.0
STALL_SECONDS = 60.0
LIVE_HEAD = "SELECT seq FROM {table} ORDER BY seq LIMIT 1"
WAITS = (
    "SELECT state, coalesce(wait_event_type || ':' || wait_event, 'CPU') FROM pg_stat_activity "
    "WHERE datname = current_database() AND application_name <> 'fleet_hosts' "
    "AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
)


def progress(text: str) -> None:
    print(f"[fleet_hosts] {text}", file=sys.stderr, flush=True)


def sh(*command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, check=check, timeout=60)


def free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


# -- the network ----------------------------------------------------------------------


class Network:
    """A bridge in the root namespace and `count` namespaces wired to it by veth pairs."""

    def __init__(self, subnet: str, count: int) -> None:
        net = ipaddress.ip_network(subnet)
        if net.prefixlen != 24 or not net.is_private:
            raise SystemExit(f"--subnet {subnet}: give a private /24")
        self.net = net
        self.prefix = f"rbf{uuid.uuid4().hex[:4]}"
        self.bridge = f"{self.prefix}br"
        self.host = str(net.network_address + 1)
        self.count = count
        self.namespaces: list[str] = []
        self._bridge_made = False

    def _check_free(self) -> None:
        """Refuse a subnet that any interface or route of the machine already uses."""
        routes = sh("ip", "-4", "route", "show", "table", "all").stdout
        addresses = sh("ip", "-4", "-o", "addr").stdout
        for line in (routes + addresses).splitlines():
            for word in line.split():
                with contextlib.suppress(ValueError):
                    other = ipaddress.ip_network(word, strict=False)
                    if other.version == 4 and other.overlaps(self.net) and other.prefixlen:
                        raise SystemExit(f"--subnet {self.net} is in use here: {line.strip()}")

    def up(self) -> None:
        self._check_free()
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._bridge_made = True
        sh("ip", "addr", "add", f"{self.host}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for i in range(self.count):
            name, inside, outside = f"{self.prefix}-{i}", f"{self.prefix}n{i}", f"{self.prefix}h{i}"
            sh("ip", "netns", "add", name)
            self.namespaces.append(name)
            sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            sh("ip", "link", "set", inside, "netns", name)
            sh("ip", "link", "set", outside, "master", self.bridge)
            sh("ip", "link", "set", outside, "up")
            address = self.net.network_address + 10 + i
            sh("ip", "netns", "exec", name, "ip", "addr", "add", f"{address}/24", "dev", inside)
            sh("ip", "netns", "exec", name, "ip", "link", "set", inside, "up")
            sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")

    def down(self) -> None:
        for name in self.namespaces:  # a namespace's veth ends go with it, and their peers
            sh("ip", "netns", "del", name, check=False)
        self.namespaces = []
        if self._bridge_made:
            sh("ip", "link", "del", self.bridge, check=False)
            self._bridge_made = False

    def bytes(self) -> int:
        stats = Path(f"/sys/class/net/{self.bridge}/statistics")
        return sum(int((stats / f).read_text()) for f in ("rx_bytes", "tx_bytes"))


# -- the throwaway server -------------------------------------------------------------


class Server:
    """A private PostgreSQL 15 cluster on a free port, listening on `host` only."""

    def __init__(self, pg_bin: Path, host: str, folder: Path) -> None:
        self.bin, self.host, self.dir = pg_bin, host, folder / "pg"
        self.port = free_port(host)
        self.process: subprocess.Popen[bytes] | None = None
        self.dir.mkdir()
        entry = pwd.getpwnam("postgres")
        os.chown(self.dir, entry.pw_uid, entry.pw_gid)
        subprocess.run(
            [str(self.bin / "initdb"), "-D", str(self.dir / "data"), "-U", "postgres",
             "-A", "trust", "--no-sync", "-E", "UTF8"],
            user="postgres", check=True, capture_output=True,
        )  # fmt: skip
        hba = self.dir / "data" / "pg_hba.conf"
        with hba.open("a") as rules:  # the namespaces' addresses reach it over the bridge
            rules.write(f"host all all {ipaddress.ip_network(f'{host}/24', strict=False)} trust\n")

    @property
    def url(self) -> str:
        return f"postgresql://postgres@{self.host}:{self.port}/postgres"

    def start(self) -> None:
        log = (self.dir / "server.log").open("ab")
        self.process = subprocess.Popen(
            [str(self.bin / "postgres"), "-D", str(self.dir / "data"), "-p", str(self.port),
             "-c", f"listen_addresses={self.host}", "-c", f"unix_socket_directories={self.dir}",
             "-c", "max_connections=100", "-c", "shared_buffers=128MB"],
            user="postgres", stdout=log, stderr=log,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while sh(str(self.bin / "pg_isready"), "-h", self.host, "-p", str(self.port), "-q",
                 check=False).returncode:  # fmt: skip
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"throwaway PostgreSQL did not start: see {self.dir}")
            time.sleep(0.1)

    def cpu_seconds(self) -> float:
        """The postmaster's and every child's CPU so far (backends, WAL writer, ...)."""
        if self.process is None:
            return 0.0
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        try:
            pids = [self.process.pid, *map(int, children.read_text().split())]
        except OSError:
            return 0.0
        return sum(cpu_seconds(pid) for pid in pids)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        os.kill(process.pid, signal.SIGINT)  # fast shutdown
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


# -- relays and a drain ---------------------------------------------------------------


async def spawn(args: argparse.Namespace, namespace: str, db: str, table: str, log: Path) -> Any:
    command = ["ip", "netns", "exec", namespace, sys.executable, "-m", "relaybox", "relay",
               "--table", table, "--broker", "default=noop://",
               "--batch-size", str(args.batch_size), "--log-level", "INFO"]  # fmt: skip
    with log.open("wb") as err:  # `ip netns exec` execs the command: the PID is the relay's
        return await asyncio.create_subprocess_exec(
            *command, stdout=asyncio.subprocess.DEVNULL, stderr=err,
            stdin=asyncio.subprocess.DEVNULL, env={**os.environ, "RELAYBOX_DB": db},
        )  # fmt: skip


async def stop(processes: list[Any], timeout: float = 15.0) -> list[int | None]:
    for process in processes:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
    for process in processes:
        try:
            await asyncio.wait_for(process.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            await process.wait()
    return [process.returncode for process in processes]


async def fill(args: argparse.Namespace, server: Server, table: str, messages: int,
               warm: bool) -> float:  # fmt: skip
    from relaybox.tools import bench

    options = bench.BenchOptions(
        db=server.url, broker="noop://", messages=messages, batch_size=args.batch_size,
        max_in_flight=None, rate=1.0, paced_seconds=0.0, idle_seconds=0.0, keys=args.keys,
        payload_bytes=args.payload_bytes, skip_raw=True, table=table,
    )  # fmt: skip
    started = time.perf_counter()
    await bench.write_backlog(options, bench.Workload(options))
    if warm:
        session = await _connect(server.url)
        try:
            await session.execute(f"VACUUM ANALYZE {table}")
        finally:
            await session.close()
    return time.perf_counter() - started


async def _connect(url: str) -> Any:
    import asyncpg

    return await asyncpg.connect(url, server_settings={"application_name": "fleet_hosts"})


async def drain(args: argparse.Namespace, net: Network, hosts: list[str], server: Server,
                table: str, relays: int, messages: int, logs: Path) -> dict[str, Any]:  # fmt: skip
    from relaybox.tools.bench import CpuMark

    watch = await _connect(server.url)
    head, waits = LIVE_HEAD.format(table=table), Counter[str]()
    processes: list[Any] = []
    try:
        await watch.fetchval(head)
        await watch.fetch(WAITS)
        cpu, pg_cpu, net_bytes = CpuMark.now(), server.cpu_seconds(), net.bytes()
        started = time.perf_counter()
        for i in range(relays):
            namespace = hosts[i % len(hosts)]
            processes.append(await spawn(args, namespace, server.url, table, logs / f"r{i}.log"))
        first_claim, last, changed = None, None, time.monotonic()
        while (seq := await watch.fetchval(head)) is not None:
            for process in processes:
                if process.returncode is not None:
                    raise RuntimeError(f"a relay exited ({process.returncode}); logs in {logs}")
            for state, event in await watch.fetch(WAITS):
                waits[f"{state}/{event}"] += 1
            if seq != last:
                if last is not None and first_claim is None:
                    first_claim = time.perf_counter() - started
                last, changed = seq, time.monotonic()
            elif time.monotonic() - changed > STALL_SECONDS:
                raise RuntimeError(f"drain stuck at seq {seq}")
            await asyncio.sleep(args.poll)
        seconds = time.perf_counter() - started
        usage, pg_used = cpu.usage(), server.cpu_seconds() - pg_cpu
        relay_cpu = [cpu_seconds(p.pid) for p in processes]
        moved = net.bytes() - net_bytes
    finally:
        codes = await stop(processes)
        await watch.execute(f"DELETE FROM {table}_members")
        await watch.execute(f"UPDATE {table}_partitions SET owner = NULL, lease_until = NULL")
        await watch.close()
    samples = sum(waits.values()) or 1
    return {
        "relays": relays, "messages": messages, "seconds": round(seconds, 3),
        "msg_per_s": round(messages / seconds, 1),
        "first_rows_gone_seconds": None if first_claim is None else round(first_claim, 3),
        "pg_cpu_percent_of_one_core": round(100 * pg_used / seconds, 1),
        "relay_cpu_percent_of_one_core": [round(100 * c / seconds, 1) for c in relay_cpu],
        "machine": usage,
        "network_mb_per_s": round(moved / seconds / 1e6, 2),
        "wait_events_share": {k: round(v / samples, 3) for k, v in waits.most_common(8)},
        "relay_exit_codes": codes,
    }  # fmt: skip


async def layouts(args: argparse.Namespace, net: Network, server: Server,
                  folder: Path) -> list[dict[str, Any]]:  # fmt: skip
    from relaybox.migrations import migrate

    runs = []
    for namespaces in args.namespaces:
        for relays in args.relays:
            for messages in args.messages:
                for start in args.starts:
                    table = f"fleet_{uuid.uuid4().hex[:8]}"
                    await migrate(server.url, table=table)
                    try:
                        filled = await fill(args, server, table, messages, start == "warm")
                        progress(f"{namespaces} namespaces, {relays} relays, {messages} "
                                 f"messages, {start}")  # fmt: skip
                        hosts = net.namespaces[:namespaces]
                        result = await drain(args, net, hosts, server, table, relays, messages,
                                             folder)  # fmt: skip
                        progress(f"  {result['msg_per_s']} msg/s, pg "
                                 f"{result['pg_cpu_percent_of_one_core']}% of a core")  # fmt: skip
                    finally:
                        await _drop(server.url, table)
                    runs.append({"namespaces": namespaces, "start": start,
                                 "fill_seconds": round(filled, 3), **result})  # fmt: skip
    return runs


async def _drop(url: str, table: str) -> None:
    from relaybox.storage.urls import DatabaseUrl
    from relaybox.tools.bench import PostgresAdmin

    admin = await PostgresAdmin.connect(DatabaseUrl.parse(url))
    try:
        await admin.drop(table)
    finally:
        await admin.close()


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rates: dict[str, list[float]] = {}
    for run in runs:
        key = f"{run['messages']} {run['start']} ns={run['namespaces']} relays={run['relays']}"
        rates.setdefault(key, []).append(run["msg_per_s"])
    return {key: round(statistics.median(v), 1) for key, v in rates.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if os.geteuid() != 0:
        raise SystemExit("fleet_hosts needs root (network namespaces)")
    net = Network(args.subnet, max(args.namespaces))
    folder = Path(tempfile.mkdtemp(prefix="relaybox-fleet-"))
    os.chmod(folder, 0o755)
    server: Server | None = None
    previous = signal.signal(signal.SIGTERM, _interrupted)
    report: dict[str, Any] = {
        "benchmark": "fleet_hosts",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": {**machine(), "load_average_at_start": [round(v, 2) for v in os.getloadavg()]},
        "network": {"subnet": str(net.net), "bridge_address": net.host},
    }
    try:
        net.up()
        server = Server(Path(args.pg_bin), net.host, folder)
        server.start()
        report["network"]["server"] = f"{net.host}:{server.port}"
        runs = asyncio.run(layouts(args, net, server, folder))
        report["summary_msg_per_s"] = summary(runs)
        report["runs"] = runs
    finally:
        if server is not None:
            server.stop()
        net.down()
        shutil.rmtree(folder, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
    return report


def _interrupted(_signum: int, _frame: object) -> None:
    raise SystemExit("fleet_hosts: terminated, cleaning up")


def _counts(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--namespaces", type=_counts, default=[2, 4])
    parser.add_argument("--relays", type=_counts, default=[1, 2, 4])
    parser.add_argument("--messages", type=_counts, default=[20_000, 100_000])
    parser.add_argument("--starts", type=lambda t: t.split(","), default=["cold", "warm"])
    parser.add_argument("--subnet", default="10.213.77.0/24")
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--payload-bytes", type=int, default=100)
    parser.add_argument("--poll", type=float, default=0.02, help="seconds between probes")
    parser.add_argument("--pg-bin", default=str(PG_BIN))
    args = parser.parse_args()
    print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
