"""Optional client libraries: which relaybox extra installs each, and the error for one
that is missing.

relaybox imports a driver or broker client only when a URL asks for it, so a service
installs only the extras it uses. Without this, a missing one surfaces as a bare
`ModuleNotFoundError` from deep inside a connect; with it, the error names the extra.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

from relaybox.errors import MissingDependencyError

#: Top-level module of a client library -> the extra that installs it.
EXTRAS: dict[str, str] = {
    "asyncpg": "postgres",
    "psycopg": "psycopg",
    "aiomysql": "mysql",
    "pymysql": "mysql",
    "asyncmy": "asyncmy",
    "aiosqlite": "sqlite",
    "sqlalchemy": "sqlalchemy",
    "django": "django",
    "alembic": "alembic",
    "flask": "flask",
    "nats": "nats",
    "aio_pika": "amqp",
    "aiormq": "amqp",
    "pamqp": "amqp",
    "aiokafka": "kafka",
    "redis": "redis",
    "aiomqtt": "mqtt",
    "paho": "mqtt",
    "httpx": "http",
    "opentelemetry": "tracing",
    "prometheus_client": "metrics",
    "starlette": "console",
    "uvicorn": "console",
}


def missing(module: str, purpose: str) -> MissingDependencyError:
    top = module.partition(".")[0]
    extra = EXTRAS.get(top, top)
    return MissingDependencyError(
        f"{purpose} needs the {top} package, which is not installed: "
        f"pip install 'relaybox[{extra}]'"
    )


@contextlib.contextmanager
def needs_extras(purpose: str) -> Iterator[None]:
    """Turn the import of a missing client library, inside the block, into a
    `MissingDependencyError` that names the extra to install. Other import errors (a
    library that is installed but broken) pass unchanged."""
    try:
        yield
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] not in EXTRAS:
            raise
        raise missing(error.name or "", purpose) from error


def installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it."""
    return importlib.util.find_spec(module) is not None
