"""Database URLs: which dialect and driver, relaybox's own options, and a form safe to log.

A PostgreSQL URL may list several hosts, `postgresql://h1:5432,h2:5432/db`: both
drivers try them in order (with libpq's `target_session_attrs` where given), and
relaybox hands them the URL whole.

relaybox reads two options from the query string and keeps them from the driver:

    connect_timeout  seconds to connect and start a session (default 5)
    command_timeout  seconds one statement may take (default 30); the database stops it
                     at that (PostgreSQL, MariaDB, MySQL's SELECTs), and a statement
                     still unanswered a second later drops its connection

    postgresql://relay@db.example/shop?connect_timeout=3&command_timeout=10
"""

from __future__ import annotations

import dataclasses
import urllib.parse

from relaybox.core.urls import mask_url, url_secrets
from relaybox.errors import ConfigurationError

_SCHEMES: dict[str, tuple[str, str | None]] = {
    "postgresql": ("postgresql", None),
    "postgres": ("postgresql", None),
    "postgresql+asyncpg": ("postgresql", "asyncpg"),
    "postgresql+psycopg": ("postgresql", "psycopg"),
    "mysql": ("mysql", None),
    "mariadb": ("mysql", None),
    "mysql+aiomysql": ("mysql", "aiomysql"),
    "mysql+asyncmy": ("mysql", "asyncmy"),
    "mysql+pymysql": ("mysql", "pymysql"),
    "sqlite": ("sqlite", None),
    "memory": ("memory", None),
}


#: The async client libraries relaybox speaks, per dialect, preferred first.
_DIALECT_CLIENTS: dict[str, tuple[str, ...]] = {
    "postgresql": ("asyncpg", "psycopg"),
    "mysql": ("aiomysql", "asyncmy"),
    "sqlite": ("aiosqlite",),
}
_CLIENTS = frozenset(c for clients in _DIALECT_CLIENTS.values() for c in clients)
#: Dialects whose drivers take several hosts in one URL.
_MULTI_HOST = frozenset({"postgresql"})

#: relaybox's own query options and their defaults, in seconds.
TIMEOUT_OPTIONS = {"connect_timeout": 5.0, "command_timeout": 30.0}
#: Seconds between the two bounds of one call. A statement's is the server's first (it
#: keeps the connection), relaybox's after; a connect's relaybox's first (it says what
#: stalled), the driver's own after.
GRACE = 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class DatabaseUrl:
    url: str
    dialect: str
    driver: str | None
    host: str | None
    port: int | None
    user: str | None
    password: str | None
    database: str
    query: dict[str, str]
    #: Every (host, port) the URL names, in order; `host` and `port` are the first's.
    hosts: tuple[tuple[str | None, int | None], ...] = ((None, None),)
    #: Seconds to connect and start a session.
    connect_timeout: float = TIMEOUT_OPTIONS["connect_timeout"]
    #: Seconds one statement may take.
    command_timeout: float = TIMEOUT_OPTIONS["command_timeout"]

    @classmethod
    def parse(cls, url: str) -> DatabaseUrl:
        try:
            parts = urllib.parse.urlsplit(url)
        except ValueError as exc:  # an unclosed [IPv6] bracket
            raise ConfigurationError(f"bad database URL {mask_url(url)}: {exc}") from None
        scheme = parts.scheme.lower()
        if scheme not in _SCHEMES:
            raise ConfigurationError(
                f"unsupported database URL scheme {scheme!r}; use one of "
                + ", ".join(sorted(_SCHEMES))
            )
        dialect, driver = _SCHEMES[scheme]
        if dialect == "sqlite":
            # sqlite:///relative.db, sqlite:////absolute.db, sqlite:///:memory:
            database = url.split("://", 1)[1]
            database = database[1:] if database.startswith("/") else database
            database = database.split("?", 1)[0] or ":memory:"
        else:
            database = urllib.parse.unquote(parts.path.lstrip("/"))
        hosts = _hosts(parts.netloc, mask_url(url))
        if len(hosts) > 1 and dialect not in _MULTI_HOST:
            raise ConfigurationError(
                f"database URL {mask_url(url)} names {len(hosts)} hosts; a {dialect} "
                "URL takes one (only PostgreSQL URLs may list several)"
            )
        query = dict(urllib.parse.parse_qsl(parts.query))
        return cls(
            url=url,
            dialect=dialect,
            driver=driver,
            host=hosts[0][0],
            port=hosts[0][1],
            user=urllib.parse.unquote(parts.username) if parts.username else None,
            password=urllib.parse.unquote(parts.password) if parts.password else None,
            database=database,
            query=query,
            hosts=hosts,
            **{name: _seconds(query, name, mask_url(url)) for name in TIMEOUT_OPTIONS},
        )

    def __repr__(self) -> str:  # the fields hold the password
        return f"DatabaseUrl({self.masked!r})"

    @property
    def clients(self) -> tuple[str, ...]:
        """The client libraries relaybox reaches this database through, preferred first:
        the one the URL names, or every one relaybox speaks for the dialect (none for
        memory://)."""
        if self.driver in _CLIENTS:
            return (self.driver,)
        return _DIALECT_CLIENTS.get(self.dialect, ())

    @property
    def sqlite_uri(self) -> str:
        """The SQLite file as a URI that opens it read-write and never creates it (an
        in-memory database as it is): a mistyped path fails instead of leaving an empty
        database behind. Only `relaybox migrate` creates one."""
        if self.database == ":memory:":
            return self.database
        return f"file:{urllib.parse.quote(self.database)}?mode=rw"

    @property
    def masked(self) -> str:
        """The URL with its secrets replaced, for logs and errors."""
        return mask_url(self.url)

    @property
    def secrets(self) -> frozenset[str]:
        """The URL's password (userinfo or `?password=`) and other secret options, as
        written and percent-decoded: what must not appear in a driver's error."""
        return url_secrets(self.url)

    @property
    def command_timeout_ms(self) -> int:
        """`command_timeout` in whole milliseconds, at least 1, as servers take it."""
        return max(1, round(self.command_timeout * 1000))

    def libpq_dsn(self) -> str:
        """A postgresql:// URL without the +driver suffix and without relaybox's own
        options, for asyncpg and psycopg (asyncpg would send an option it does not know
        to the server as a setting)."""
        dsn = "postgresql" + self.url[self.url.index("://") :]
        if not any(name in self.query for name in TIMEOUT_OPTIONS):
            return dsn
        base, _, query = dsn.partition("?")
        kept = [(k, v) for k, v in urllib.parse.parse_qsl(query) if k not in TIMEOUT_OPTIONS]
        return f"{base}?{urllib.parse.urlencode(kept)}" if kept else base


def _hosts(netloc: str, masked: str) -> tuple[tuple[str | None, int | None], ...]:
    """(host, port) of each comma-separated `host[:port]` in the URL's authority."""
    found = []
    for each in netloc.rpartition("@")[2].split(","):
        parts = urllib.parse.urlsplit("//" + each)
        try:
            port = parts.port
        except ValueError as exc:
            raise ConfigurationError(f"bad port in database URL {masked}: {exc}") from None
        found.append((parts.hostname, port))
    return tuple(found)


def _seconds(query: dict[str, str], name: str, masked: str) -> float:
    raw = query.get(name)
    if raw is None:
        return TIMEOUT_OPTIONS[name]
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ConfigurationError(f"{name}={raw!r} in {masked}: give a number of seconds above 0")
    return value
