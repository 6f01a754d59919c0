"""Database URLs: which dialect and driver, and a form safe to log."""

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
        return cls(
            url=url,
            dialect=dialect,
            driver=driver,
            host=parts.hostname,
            port=port,
            user=urllib.parse.unquote(parts.username) if parts.username else None,
            password=urllib.parse.unquote(parts.password) if parts.password else None,
            database=database,
            query=dict(urllib.parse.parse_qsl(parts.query)),
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
        """A postgresql:// URL without the +driver suffix, for asyncpg and psycopg."""
        scheme_end = self.url.index("://")
        return "postgresql" + self.url[scheme_end:]
