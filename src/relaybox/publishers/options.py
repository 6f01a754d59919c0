"""Broker URLs: relaybox's own options ride in the query string and are checked here.

    nats://127.0.0.1:4222?source=orders&timeout=5

Every publisher reads its options through `BrokerUrl`, takes what it knows, and calls
`done()`, so a misspelt option is a `ConfigurationError` instead of a silent default.
"""

from __future__ import annotations

import math
import urllib.parse
from typing import TypeVar

from relaybox.core.envelope import DEFAULT_SOURCE
from relaybox.core.urls import mask_url
from relaybox.errors import ConfigurationError

_T = TypeVar("_T", int, float)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class BrokerUrl:
    """A parsed broker URL whose query options are consumed one by one."""

    def __init__(self, url: str) -> None:
        self.raw = url
        try:
            parts = urllib.parse.urlsplit(url)
        except ValueError as exc:  # an unclosed [IPv6] bracket
            raise ConfigurationError(f"bad broker URL {mask_url(url)}: {exc}") from None
        self.scheme = parts.scheme
        self.parts = parts
        self._options = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
        #: The URL without relaybox's query options, for the client library.
        self.base = urllib.parse.urlunsplit(parts._replace(query="", fragment=""))
        self.source = self.text("source", DEFAULT_SOURCE)

    @property
    def host(self) -> str:
        return self.parts.hostname or "127.0.0.1"

    def port(self, default: int) -> int:
        try:
            return self.parts.port or default
        except ValueError as error:
            raise ConfigurationError(f"broker URL {self.masked()!r}: {error}") from error

    @property
    def username(self) -> str | None:
        """The user, percent-decoded (`%40` is `@`), for clients that take it apart."""
        user = self.parts.username
        return None if user is None else urllib.parse.unquote(user)

    @property
    def password(self) -> str | None:
        secret = self.parts.password
        return None if secret is None else urllib.parse.unquote(secret)

    @property
    def path(self) -> str:
        return self.parts.path

    def text(self, name: str, default: str) -> str:
        return self._options.pop(name, default)

    def optional_text(self, name: str) -> str | None:
        return self._options.pop(name, None)

    def number(self, name: str, default: _T, *, minimum: _T | None = None) -> _T:
        raw = self._options.pop(name, None)
        if raw is None:
            return default
        try:
            value = type(default)(raw)
        except ValueError:
            raise ConfigurationError(f"broker URL option {name}={raw!r} must be a number") from None
        floor = 0 if minimum is None else minimum  # no option takes a negative number
        if not (math.isfinite(value) and value >= floor):
            raise ConfigurationError(
                f"broker URL option {name}={raw!r}: give a number of at least {floor}"
            )
        return value

    def flag(self, name: str, default: bool) -> bool:
        raw = self._options.pop(name, None)
        if raw is None:
            return default
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ConfigurationError(f"broker URL option {name}={raw!r} must be true or false")

    def done(self) -> None:
        """Raise if the URL carries an option nobody read."""
        if self._options:
            raise ConfigurationError(
                f"unknown {self.scheme}:// options: {', '.join(sorted(self._options))}"
            )

    def masked(self) -> str:
        return mask_url(self.raw)
