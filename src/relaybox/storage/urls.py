"""Database URLs: which dialect and driver, relaybox's own options, and a form safe to log.

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

from relaybox.core.urls import mask_password
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

#: relaybox's own query options and their defaults, in seconds.
TIMEOUT_OPTIONS = {"connect_timeout": 5.0, "command_timeout": 30.0}


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
    #: Seconds to connect and start a session.
    connect_timeout: float = TIMEOUT_OPTIONS["connect_timeout"]
    #: Seconds one statement may take.
    command_timeout: float = TIMEOUT_OPTIONS["command_timeout"]

    @classmethod
    def parse(cls, url: str) -> DatabaseUrl:
        parts = urllib.parse.urlsplit(url)
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
        try:
            port = parts.port
        except ValueError as exc:
            raise ConfigurationError(f"bad port in database URL: {exc}") from exc
        query = dict(urllib.parse.parse_qsl(parts.query))
        return cls(
            url=url,
            dialect=dialect,
            driver=driver,
            host=parts.hostname,
            port=port,
            user=urllib.parse.unquote(parts.username) if parts.username else None,
            password=urllib.parse.unquote(parts.password) if parts.password else None,
            database=database,
            query=query,
            **{name: _seconds(query, name, mask_password(url)) for name in TIMEOUT_OPTIONS},
        )

    @property
    def clients(self) -> tuple[str, ...]:
        """The client libraries relaybox reaches this database through, preferred first:
        the one the URL names, or every one relaybox speaks for the dialect (none for
        memory://)."""
        if self.driver in _CLIENTS:
            return (self.driver,)
        return _DIALECT_CLIENTS.get(self.dialect, ())

    @property
    def masked(self) -> str:
        """The URL with its password replaced, for logs and errors."""
        return mask_password(self.url)

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
