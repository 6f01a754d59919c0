"""`mask_url` hides every secret a URL can carry, and `scrub` every secret a driver
repeats in its own words.

The property tests build URLs whose secret holds at least one of the letters Q, X and Z,
which no other part of the URL holds: a secret that survived masking, even in part,
would show up as one of them in the text.
"""

from __future__ import annotations

import urllib.parse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relaybox.core.urls import mask_url, scrub, secret_option, url_secrets

PLAIN = st.text("abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=8)
#: Printable ASCII but whitespace; what a password written raw into a URL may hold.
_ANY = "".join(chr(c) for c in range(0x21, 0x7F))
#: Letters only a secret holds.
_MARKS = "QXZ"


def _secret(alphabet: str) -> st.SearchStrategy[str]:
    return st.builds(
        lambda head, mark, tail: head + mark + tail,
        st.text(alphabet, max_size=12),
        st.sampled_from(_MARKS),
        st.text(alphabet, max_size=12),
    )


SECRET = _secret(_ANY)
#: A secret written raw into a query value: no separator of the query.
QUERY_SECRET = _secret(_ANY.replace("&", "").replace(";", ""))


def _leaks(text: str) -> bool:
    return any(c in _MARKS for c in text)


@st.composite
def authorities(draw: st.DrawFn) -> str:
    """One host, several, an IPv6 address, or an unclosed IPv6 bracket."""
    port = draw(st.integers(1, 65535))
    return draw(
        st.sampled_from([
            f"{draw(PLAIN)}:{port}",
            f"{draw(PLAIN)}:{port},{draw(PLAIN)},{draw(PLAIN)}:{port}",
            f"[::1]:{port}",
            "[fe80::1",
            draw(PLAIN),
        ])
    )  # fmt: skip


def _written(secret: str, encoded: bool) -> str:
    return urllib.parse.quote(secret, safe="") if encoded else secret


@st.composite
def userinfo_urls(draw: st.DrawFn) -> tuple[str, str]:
    """(url, password) with the password in the userinfo, raw or percent-encoded."""
    secret, encoded = draw(SECRET), draw(st.booleans())
    scheme = draw(st.sampled_from(["postgresql", "mysql+aiomysql", "amqp", "redis", "nats",
                                   "kafka", "https", "mqtts"]))  # fmt: skip
    user = draw(st.sampled_from(["", draw(PLAIN)]))
    tail = draw(st.sampled_from(["", "/", f"/{draw(PLAIN)}", f"/{draw(PLAIN)}?timeout=5"]))
    url = f"{scheme}://{user}:{_written(secret, encoded)}@{draw(authorities())}{tail}"
    return url, secret


@st.composite
def token_urls(draw: st.DrawFn) -> tuple[str, str]:
    """(url, token) with a token alone in the userinfo, for schemes that read it so
    (raw, a `:` would make it a user name and a password)."""
    secret, encoded = draw(SECRET), draw(st.booleans())
    if ":" in secret:
        encoded = True
    scheme = draw(st.sampled_from(["nats", "tls", "https", "ws"]))
    return f"{scheme}://{_written(secret, encoded)}@{draw(authorities())}", secret


@st.composite
def query_urls(draw: st.DrawFn) -> tuple[str, str]:
    """(url, secret) with the secret in a query option whose name says so."""
    secret = draw(QUERY_SECRET)
    written = _written(secret, draw(st.booleans()))
    name = draw(
        st.sampled_from(
            [
                "password",
                "secret",
                "token",
                "sasl_password",
                "api_key",
                "access_key",
                "sslpassword",
                "auth_token",
                "client_secret",
            ]
        )
    )
    name = draw(st.sampled_from([name, name.upper(), name.title(), name.replace("_", "-")]))
    others = draw(st.lists(st.tuples(PLAIN, PLAIN), max_size=3))
    options = [f"{k}={v}" for k, v in others]
    options.insert(draw(st.integers(0, len(options))), f"{name}={written}")
    host = draw(authorities())
    return f"{draw(PLAIN)}://{host}/{draw(PLAIN)}?{'&'.join(options)}", secret


ANY_URL = st.one_of(userinfo_urls(), token_urls(), query_urls())


@given(ANY_URL)
def test_a_masked_url_holds_no_part_of_its_secret(case: tuple[str, str]) -> None:
    url, _ = case
    assert not _leaks(mask_url(url)), mask_url(url)


@given(ANY_URL, ANY_URL, st.sampled_from(["{} and {}", "'{}': {}", "--db {} --broker a={}"]))
def test_urls_inside_text_are_masked_each(
    first: tuple[str, str], second: tuple[str, str], template: str
) -> None:
    text = template.format(first[0], second[0])
    assert not _leaks(mask_url(text)), mask_url(text)


@given(ANY_URL, st.sampled_from(['password "{}" is wrong', "bad token {}: rejected", "{}"]))
def test_a_driver_repeating_the_secret_is_scrubbed(case: tuple[str, str], said: str) -> None:
    url, secret = case
    assert secret in url_secrets(url)
    assert not _leaks(scrub(said.format(secret), url_secrets(url)))


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("postgresql://u:p%40ss@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u:p@ss@h1:5432,h2/db", "postgresql://u:***@h1:5432,h2/db"),
        ("postgresql://h/db?password=x&sslmode=require", "postgresql://h/db?password=***&sslmode=require"),
        ("redis://:pw@[::1]:6379/0", "redis://:***@[::1]:6379/0"),
        ("nats://tok@h:4222", "nats://***@h:4222"),
        ("postgresql://relay@db/shop", "postgresql://relay@db/shop"),
        ("https://h/hook?secret=s&timeout=3", "https://h/hook?secret=***&timeout=3"),
        ("kafka://h?SASL_PASSWORD=a&x=1", "kafka://h?SASL_PASSWORD=***&x=1"),
        ("https://u:p@[::1", "https://u:***@[::1"),
        ("amqp://u:p/q@h/vhost", "amqp://***@h/vhost"),
        ("sqlite:////tmp/at@sign.db", "sqlite:////tmp/at@sign.db"),
        ("nats://127.0.0.1:4222?source=orders", "nats://127.0.0.1:4222?source=orders"),
    ],
)  # fmt: skip
def test_masked_forms(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_secret_option_names() -> None:
    assert all(map(secret_option, ["password", "Passwd", "sasl-password", "API_KEY",
                                   "accessKey", "sig", "pass%77ord", "private_key"]))  # fmt: skip
    assert not any(map(secret_option, ["timeout", "source", "sslmode", "client_id", "key"]))
