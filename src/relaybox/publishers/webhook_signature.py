"""Webhook signatures: an HMAC-SHA256 over the timestamp, the headers a receiver acts on
and the body, made with a secret the publisher and the receiver share.

A signed request carries

    Relaybox-Signature: t=<unix seconds>,h=<names>,v2=<hex digest>

`h` lists the signed headers by their lower-case names, separated by `;` (empty when
none is signed); `v2` is the lower-case hex HMAC-SHA256, keyed with the secret's UTF-8
bytes, of these bytes (the canonical form):

    b"relaybox-webhook-v2\\n" + t + b"\\n"
    + for each name of h, in h's order: name + b":" + value + b"\\n"
    + b"\\n"
    + the body as received

A header's value is its bytes as received (relaybox sends the message's own headers as
UTF-8, attributes percent-encoded), less leading and trailing spaces and tabs; a header
received on several lines counts as one, its values joined with `, ` in their order.
relaybox's publisher signs every header it sets but the signature itself:
`Content-Type`, `Relaybox-Topic`, every `ce-` attribute and, one message per request,
the message's own headers. The HTTP client's own (`Host`, `Content-Length`,
`User-Agent`, `Accept`, `Accept-Encoding`, `Connection`, `Authorization`) are not
signed, nor anything a proxy on the way adds.

A receiver, in any language:
1. parses the header strictly: exactly one `t` (1 to 12 ASCII digits), exactly one
   `h` (distinct lower-case header names), one to eight `v2` (64 lower-case hex digits
   each); keys it does not know are skipped, so later versions can travel beside `v2`;
2. refuses a `t` more than a tolerance (300 s by default) away from its own clock;
3. builds the canonical form from the request it received, refusing the request if a
   listed header is missing, and compares each `v2` with its own HMAC in constant time;
4. acts only on what is signed: it refuses a request carrying a `ce-` header, a
   `Content-Type` or a `Relaybox-Topic` that `h` does not list, and hands its handlers
   none of the unsigned headers.
`verify_signature` does steps 1 to 3 and returns the signed names; the webhook
receiver (`relaybox.consumers.http.WebhookReceiver`) does step 4.

Within the tolerance a captured request can be sent again as it is: the inbox knows
its id and applies it once. Changing the body, an attribute, the topic, the content
type or a header of the message's own breaks the signature. The URL path is not
signed (proxies rewrite it): give each receiving endpoint a secret of its own.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Iterable, Mapping

from relaybox.errors import ConfigurationError, SignatureError

SIGNATURE_HEADER = "Relaybox-Signature"
#: The default of how far a signature's timestamp may be from the receiver's clock.
DEFAULT_TOLERANCE = 300.0

Headers = Mapping[str, str] | Mapping[bytes, bytes] | Iterable[tuple[str | bytes, str | bytes]]

_CANONICAL_PREFIX = b"relaybox-webhook-v2\n"
#: Longer than any real one (a message with a few hundred headers); read no further.
_MAX_HEADER_LENGTH = 16 * 1024
_MAX_DIGESTS = 8
_TIMESTAMP = re.compile(r"[0-9]{1,12}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
#: A field name of the signature header (`t`, `h`, `v2`, and later ones).
_KEY = re.compile(r"[0-9a-z]{1,16}")
#: An HTTP header name (RFC 9110 token), lower case.
_NAME = re.compile(r"[0-9a-z!#$%&'*+.^_`|~-]+")
_OWS = " \t"


def check_secret(secret: str | None) -> None:
    """Refuse an empty secret: it would make signatures anyone can forge."""
    if secret is not None and not secret:
        raise ConfigurationError(
            "the webhook secret is empty: give a long random one, or none to leave "
            "requests unsigned"
        )


def normalise_headers(headers: Headers) -> dict[str, str]:
    """Headers as a receiver sees them: lower-case names; values without leading and
    trailing spaces and tabs; a header given several times joined with `, `. Bytes
    (ASGI's raw headers) are read as UTF-8, as the publisher sends them."""
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    found: dict[str, str] = {}
    for raw_name, raw_value in pairs:
        name = _text(raw_name).strip(_OWS).lower()
        value = _text(raw_value).strip(_OWS)
        found[name] = f"{found[name]}, {value}" if name in found else value
    return found


def sign(secret: str, headers: Headers, body: bytes, *, timestamp: int | None = None) -> str:
    """The `Relaybox-Signature` value for a request of these headers (all of them
    signed; not the signature itself) and this body."""
    t = str(int(time.time()) if timestamp is None else timestamp)
    signed = normalise_headers(headers)
    signed.pop(SIGNATURE_HEADER.lower(), None)
    digest = _digest(secret, t, signed, list(signed), body)
    return f"t={t},h={';'.join(signed)},v2={digest}"


def verify_signature(
    secret: str,
    headers: Headers,
    body: bytes,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    now: float | None = None,
) -> frozenset[str]:
    """The (lower-case) names of the headers that the request's `Relaybox-Signature`
    signs; raises `SignatureError` when the request carries no valid signature made
    with `secret` within `tolerance` seconds of `now`.

    `headers` are the request's, all of them (a mapping or (name, value) pairs, names
    in any case, str or bytes); `body` its raw bytes.
    """
    check_secret(secret)
    received = normalise_headers(headers)
    header = received.get(SIGNATURE_HEADER.lower())
    if header is None:
        raise SignatureError(f"the request has no {SIGNATURE_HEADER} header")
    t, names, digests = _parse(header)
    if abs((time.time() if now is None else now) - int(t)) > tolerance:
        raise SignatureError(
            f"the signature's timestamp is more than {tolerance:g} s from this clock"
        )
    missing = [name for name in names if name not in received]
    if missing:
        raise SignatureError(f"signed header(s) missing from the request: {', '.join(missing)}")
    expected = _digest(secret, t, received, names, body)
    if not any(hmac.compare_digest(expected, digest) for digest in digests):
        raise SignatureError("the signature does not match the request")
    return frozenset(names)


def _parse(header: str) -> tuple[str, list[str], list[str]]:
    """(t, signed names, v2 digests) of a `Relaybox-Signature` value, checked."""
    if len(header) > _MAX_HEADER_LENGTH:
        raise SignatureError(f"the {SIGNATURE_HEADER} header is too long")
    fields: dict[str, list[str]] = {}
    for part in header.split(",", _MAX_DIGESTS + 8):
        key, equals, value = part.partition("=")
        if not equals or not _KEY.fullmatch(key):
            raise SignatureError(f"malformed {SIGNATURE_HEADER} header")
        fields.setdefault(key, []).append(value)
    timestamps, lists, digests = fields.get("t", []), fields.get("h", []), fields.get("v2", [])
    if len(timestamps) != 1 or not _TIMESTAMP.fullmatch(timestamps[0]):
        raise SignatureError(f"{SIGNATURE_HEADER} needs one t=<unix seconds>")
    if len(lists) != 1:
        raise SignatureError(f"{SIGNATURE_HEADER} needs one h=<signed header names>")
    if not 1 <= len(digests) <= _MAX_DIGESTS or not all(map(_DIGEST.fullmatch, digests)):
        raise SignatureError(f"{SIGNATURE_HEADER} needs v2=<64 hex digits>")
    names = lists[0].split(";") if lists[0] else []
    if not all(map(_NAME.fullmatch, names)) or len(set(names)) != len(names):
        raise SignatureError(f"{SIGNATURE_HEADER} lists malformed or repeated header names")
    if SIGNATURE_HEADER.lower() in names:
        raise SignatureError(f"{SIGNATURE_HEADER} cannot sign itself")
    return timestamps[0], names, digests


def _digest(
    secret: str, t: str, headers: Mapping[str, str], names: Iterable[str], body: bytes
) -> str:
    lines = []
    for name in names:
        value = headers[name]
        if "\n" in value or "\r" in value:  # no value on the wire holds one
            raise SignatureError(f"header {name} has a line break")
        lines.append(f"{name}:{value}\n")
    try:
        signed = "".join(lines).encode()
    except UnicodeEncodeError:  # a lone surrogate, which no bytes on the wire decode to
        raise SignatureError("a signed header is not text") from None
    canonical = b"".join((_CANONICAL_PREFIX, t.encode(), b"\n", signed, b"\n", body))
    return hmac.new(secret.encode(), canonical, hashlib.sha256).hexdigest()


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
