"""Where the commands read database and broker URLs: the command line, the environment,
or files, so that a password need not be on the command line, which every user of the
machine can read (`ps`).

    --db URL                 or RELAYBOX_DB (several separated by spaces, for a relay)
    --db-file PATH           the URL is the file's content
    --broker NAME=URL        or RELAYBOX_BROKER (several NAME=URL separated by spaces)
    --broker-file NAME=PATH  target NAME's URL is the file's content

A file holds one URL (surrounding whitespace and a final newline are ignored), as a
mounted secret does. Errors name the file, never its content. The environment variable
is read only when neither option is given.

`MaskingFormatter` formats the log lines of a command that configures logging: client
libraries log URLs whole (httpx logs each request's), so every line is masked, and the
secrets of the command's own URLs scrubbed, on its way out.
"""

from __future__ import annotations

import functools
import logging
import pathlib
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import click

from relaybox.core.urls import mask_url, scrub, url_secrets
from relaybox.errors import ConfigurationError

T = TypeVar("T")

DB_ENV = "RELAYBOX_DB"
BROKER_ENV = "RELAYBOX_BROKER"
_FILE = click.Path(dir_okay=False)


def read_url(path: str) -> str:
    """The URL a file holds."""
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigurationError(f"cannot read a URL from {path}: {error}") from None
    if not text or any(c.isspace() for c in text):
        raise ConfigurationError(f"{path} must hold one URL (and nothing else)")
    return text


def database_option(help_text: str = "Database URL.") -> Callable[[Callable[..., T]], Any]:
    """--db URL (or RELAYBOX_DB) or --db-file PATH; the command gets `db_url`."""

    def decorate(command: Callable[..., T]) -> Any:
        @functools.wraps(command)
        def run(*args: Any, db_url: str | None, db_file: str | None, **kwargs: Any) -> T:
            given = [db_url] if db_url and not (db_file and from_environment("db_url")) else []
            try:
                (url,) = given + ([read_url(db_file)] if db_file else [])
            except ValueError:
                raise click.UsageError(
                    f"give one database: --db URL, --db-file PATH or {DB_ENV}"
                ) from None
            except ConfigurationError as error:
                raise click.BadParameter(str(error), param_hint="--db-file") from None
            return command(*args, db_url=url, **kwargs)

        run = click.option(
            "--db-file", type=_FILE, default=None, metavar="PATH",
            help="Read the database URL from this file (keeps the password out of `ps`).",
        )(run)  # fmt: skip
        return click.option(
            "--db", "db_url", default=None, envvar=DB_ENV, metavar="URL",
            help=f"{help_text} Also {DB_ENV}.",
        )(run)  # fmt: skip

    return decorate


def from_environment(parameter: str) -> bool:
    """Whether the running command's `parameter` was read from the environment."""
    source = click.get_current_context().get_parameter_source(parameter)
    return source is click.core.ParameterSource.ENVIRONMENT


def databases(urls: Iterable[str], files: Iterable[str]) -> list[str]:
    """Every database URL given on the command line (or RELAYBOX_DB) and in files."""
    found = [*urls, *(read_url(path) for path in files)]
    if not found:
        raise ConfigurationError(f"give a database: --db URL, --db-file PATH or {DB_ENV}")
    return found


def brokers(values: Iterable[str], files: Iterable[str]) -> dict[str, str]:
    """Target name -> URL, from `NAME=URL` values (or RELAYBOX_BROKER) and `NAME=PATH`
    files."""
    found: dict[str, str] = {}
    given = [("--broker", _split(value, "--broker", "URL")) for value in values]
    read = [("--broker-file", _split(value, "--broker-file", "PATH")) for value in files]
    for option, (name, source) in given + read:
        if name in found:
            raise ConfigurationError(f"{option} names target {name!r} twice")
        found[name] = source if option == "--broker" else read_url(source)
    if not found:
        raise ConfigurationError(
            f"give a broker: --broker NAME=URL, --broker-file NAME=PATH or {BROKER_ENV}"
        )
    return found


def _split(value: str, option: str, what: str) -> tuple[str, str]:
    name, sep, rest = value.partition("=")
    if not sep or not name or not rest:
        raise ConfigurationError(f"{option} takes NAME={what}, got {mask_url(value)!r}")
    return name, rest


class MaskingFormatter(logging.Formatter):
    """Log lines with every URL masked and every secret of `urls` replaced."""

    def __init__(self, fmt: str) -> None:
        super().__init__(fmt)
        self._secrets: frozenset[str] = frozenset()

    def hide(self, urls: Iterable[str]) -> None:
        """Scrub the secrets of `urls` too, in whatever words a library says them."""
        self._secrets = self._secrets.union(*map(url_secrets, urls))

    def format(self, record: logging.LogRecord) -> str:
        return scrub(super().format(record), self._secrets)


def masked_logging(level: str) -> MaskingFormatter:
    """Log to stderr at `level` through a `MaskingFormatter` (its `hide` takes the
    command's URLs), unless the process configured logging already (a Django project's
    LOGGING, say): then nothing changes, and the formatter returned is unused."""
    handler = logging.StreamHandler()
    handler.setFormatter(logs := MaskingFormatter("%(asctime)s %(levelname)s %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    return logs
