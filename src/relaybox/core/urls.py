"""Secrets in URLs: masked in whatever relaybox shows, scrubbed from what drivers say.

`mask_url` stands between a URL, or any text holding URLs (an error message, a command
line), and every place text leaves the process: logs, errors, JSON, command output. It
replaces with `***`

- the password of `scheme://user:password@host`, with or without percent-escapes, in
  IPv6 (`[::1]`) and multi-host (`h1:5432,h2:5432`) authorities alike;
- a user name that stands alone where a scheme takes it for a token
  (`nats://TOKEN@host`); only database, AMQP, MQTT and Redis URLs keep a lone user;
- the value of each query option whose name says it holds a secret (`password`,
  `secret`, `token`, `sasl_password`, `api_key`, `access_key`, ...: see `secret_option`).

A URL that cannot be taken apart (an `@` after a `/`, an unclosed bracket) loses more
rather than less: everything between `//` and its last `@`. A single word without `//`
is read as an authority, `[user[:password]@]host`, so that a URL missing its scheme is
masked too.

`url_secrets` names the secrets of one URL, raw and percent-decoded, and `scrub`
replaces them in any text: for a driver's error that echoes a password in its own words.
`without_secrets` does it to an error about to be raised, and to what it was raised from.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable, Iterator
from typing import TypeVar

from relaybox.errors import RelayboxError

_E = TypeVar("_E", bound=RelayboxError)

MASK = "***"

#: Schemes (before any `+driver`) whose lone `user@` is a user name, not a token.
_USER_SCHEMES = frozenset(
    {"postgresql", "postgres", "mysql", "mariadb", "amqp", "amqps", "mqtt", "mqtts",
     "redis", "rediss"}
)  # fmt: skip
#: Schemes whose `///` starts a file's path, which may hold an `@`.
_PATH_SCHEMES = frozenset({"sqlite", "file"})
#: A query option holds a secret when its name, lower-cased and without `_`, `-` and
#: `.`, contains one of these (or is `sig`, a signed URL's signature).
_SECRET_WORDS = (
    "pass", "pwd", "secret", "token", "credential", "apikey", "accesskey", "privatekey",
    "signature",
)  # fmt: skip

#: Where an authority starts: `scheme://` or a bare `//`; the URL runs to whitespace.
_AUTHORITY = re.compile(r"(?:([A-Za-z][A-Za-z0-9+.\-]*):)?(?<!/)//(?=(\S*))")
#: `name=` at the start of the text, a query, a fragment or after whitespace.
_OPTION = re.compile(r"(?:^|(?<=[?&;#\s]))([\w.%+\-]+)=")
#: A value ends before whitespace, or before `&` or `;` that starts the next `name=`.
_VALUE_END = re.compile(r"\s|[&;](?=[\w.%+\-]+=)")


def mask_url(text: str) -> str:
    """`text` (a URL, or anything that holds URLs) with every secret in it replaced."""
    spans = _merged(_secret_spans(text))
    if not spans:
        return text
    pieces, last = [], 0
    for start, end in spans:
        pieces += [text[last:start], MASK]
        last = end
    pieces.append(text[last:])
    return "".join(pieces)


def url_secrets(url: str) -> frozenset[str]:
    """Every secret `mask_url` hides in `url`, as written and percent-decoded."""
    found: set[str] = set()
    for start, end in _secret_spans(url):
        raw = url[start:end]
        found |= {raw, urllib.parse.unquote(raw), urllib.parse.unquote_plus(raw)}
    found.discard("")
    return frozenset(found)


def scrub(text: str, secrets: Iterable[str]) -> str:
    """`text` with each of `secrets` replaced (longest first, so that a secret inside
    another one goes with it), and any URL in it masked."""
    for secret in sorted(set(secrets), key=len, reverse=True):
        if secret:
            text = text.replace(secret, MASK)
    return mask_url(text)


def without_secrets(error: _E, cause: BaseException, secrets: Iterable[str]) -> _E:
    """`error`, about to be raised from `cause` (a driver's exception), fit to leave the
    process: itself, chained to `cause`, when neither says a secret; otherwise a copy
    with the secrets masked, chained to nothing (tracebacks print a cause whole)."""
    secrets = frozenset(secrets)
    said = [error, cause, error.__cause__]
    if all(scrub(str(e), secrets) == str(e) for e in said if e is not None):
        if cause is not error:
            error.__cause__ = cause
        return error
    clean = type(error)(scrub(str(error), secrets))
    clean.__cause__, clean.__suppress_context__ = None, True
    return clean


def secret_option(name: str) -> bool:
    """Whether a query option of this name holds a secret."""
    plain = re.sub(r"[_\-.]", "", urllib.parse.unquote_plus(name).lower())
    return plain == "sig" or any(word in plain for word in _SECRET_WORDS)


def _secret_spans(text: str) -> Iterator[tuple[int, int]]:
    yield from _userinfo_spans(text)
    for match in _OPTION.finditer(text):
        if secret_option(match.group(1)):
            start = match.end()
            after = _VALUE_END.search(text, start)
            end = len(text) if after is None else after.start()
            if end > start:
                yield start, end


def _userinfo_spans(text: str) -> Iterator[tuple[int, int]]:
    """The secret part of each URL's userinfo: its password, or all of it where it is
    a token or cannot be taken apart."""
    found = [(m.group(1) or "", m.group(2), m.start(2)) for m in _AUTHORITY.finditer(text)]
    if not found and text and not any(c.isspace() for c in text):
        found = [("", text, 0)]  # one word, no `//`: `[user[:password]@]host...` alone
    for scheme, rest, offset in found:
        base = scheme.lower().split("+")[0]
        if "@" not in rest or (rest.startswith("/") and base in _PATH_SCHEMES):
            continue
        # Up to the last `@`: a password may hold a raw `@` (drivers split there too).
        userinfo = rest[: rest.rindex("@")]
        user, colon, _ = userinfo.partition(":")
        if colon:
            yield offset + len(user) + 1, offset + len(userinfo)
        ambiguous = any(c in userinfo for c in "/?#")  # a path or query before an `@`
        token = userinfo and not colon and base not in _USER_SCHEMES
        if ambiguous or token:
            yield offset, offset + len(userinfo)


def _merged(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged
