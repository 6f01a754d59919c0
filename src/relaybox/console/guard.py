"""Who may change messages through the console, and the proof a browser carries.

A client that is not a browser sends the token itself (`Authorization: Bearer ...`).
A browser signs in once with the token and gets a session cookie (HttpOnly,
SameSite=Strict) that holds a random nonce, the time it was issued, and a MAC of both
keyed by the token: the server keeps no sessions, and a new token ends every session.
Each change the browser asks for also carries the session's CSRF token (a second MAC
of the nonce, read by the page's script from the session endpoint, which a page of
another origin cannot read) and must come from the console's own origin (its Origin
header, or else its Referer). Every comparison of a secret runs in constant time.

Mounted inside an application that authenticates its users, the console can take that
application's word instead (`authorize`: a function of the request that names the user
allowed to change messages, or gives None). The user's name is then the actor of every
audit record, the page needs no sign-in, and the browser's changes still carry a CSRF
token (a MAC of the user's name under a key drawn when the console starts) and must
come from the console's own origin: the application's own session cookie is what a
forged request from another site would ride on.

Without a token and without `authorize` the console is read-only: nobody can prove they
may change anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

#: A browser session lasts this long after signing in.
SESSION_SECONDS = 12 * 3600
COOKIE = "relaybox_console"


#: Names the user of a request whom the host application allows to change messages,
#: or gives None.
Authorize = Callable[[Any], "str | None"]


@dataclasses.dataclass(frozen=True, slots=True)
class Guard:
    token: str | None
    read_only: bool
    authorize: Authorize | None = None
    #: The key of the CSRF tokens of users the host application authorized.
    secret: bytes = dataclasses.field(default_factory=lambda: secrets.token_bytes(32))

    @property
    def changes(self) -> bool:
        """Whether anyone may change messages here at all."""
        return (self.token is not None or self.authorize is not None) and not self.read_only

    def read_only_reason(self) -> str:
        if self.read_only:
            return "the console runs read-only"
        return "no token is configured, so the console is read-only"

    def host_user(self, request: Any) -> str | None:
        """The user the host application allows to change messages; None when it does
        not say so (or the console does not ask it)."""
        if self.authorize is None:
            return None
        user = self.authorize(request)
        if user is None:
            return None
        if not isinstance(user, str) or not user.strip():
            raise TypeError("authorize must give a user's name or None")
        return user.strip()

    def host_csrf(self, user: str) -> str:
        message = f"csrf\x00{user}".encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def host_csrf_ok(self, user: str, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(
            given.encode("utf-8"), self.host_csrf(user).encode()
        )

    def bearer_ok(self, header: str) -> bool:
        scheme, _, given = header.partition(" ")
        return scheme.lower() == "bearer" and self.token_ok(given.strip())

    def token_ok(self, given: str) -> bool:
        if self.token is None:
            return False
        return hmac.compare_digest(given.encode("utf-8"), self.token.encode("utf-8"))

    def new_session(self) -> str:
        nonce = secrets.token_urlsafe(24)
        issued = str(int(time.time()))
        return f"{nonce}.{issued}.{self._mac('session', nonce, issued)}"

    def session_nonce(self, cookie: str | None) -> str | None:
        """The nonce of a valid, unexpired session cookie; None otherwise."""
        if not cookie or self.token is None:
            return None
        nonce, _, rest = cookie.partition(".")
        issued, _, mac = rest.partition(".")
        if not (nonce and issued.isdigit() and len(issued) < 16 and mac):
            return None
        if not hmac.compare_digest(mac.encode(), self._mac("session", nonce, issued).encode()):
            return None
        if not 0 <= time.time() - int(issued) < SESSION_SECONDS:
            return None
        return nonce

    def csrf(self, nonce: str) -> str:
        return self._mac("csrf", nonce)

    def csrf_ok(self, nonce: str, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(
            given.encode("utf-8"), self.csrf(nonce).encode()
        )

    def _mac(self, *parts: str) -> str:
        assert self.token is not None
        message = "\x00".join(parts).encode("utf-8")
        return hmac.new(self.token.encode("utf-8"), message, hashlib.sha256).hexdigest()


def same_origin(host: str | None, origin: str | None, referer: str | None) -> bool:
    """Whether a request comes from a page of this host: its Origin names the host, or,
    without an Origin, its Referer does. Neither: refused (a browser sends at least one
    with every POST a page makes; a client that is not a browser uses the bearer token).
    Only the host and port are compared, so a TLS-ending proxy in front changes nothing."""
    if not host:
        return False
    source = origin if origin is not None else referer
    if not source or source == "null":
        return False
    parts = urlsplit(source)
    return parts.scheme in ("http", "https") and hmac.compare_digest(
        parts.netloc.lower().encode(), host.lower().encode()
    )
