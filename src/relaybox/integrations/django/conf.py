"""The `RELAYBOX` setting of a Django project, read into one checked settings object.

    RELAYBOX = {
        "DATABASE": "default",              # the alias whose database holds the tables
        "DATABASE_URL": None,               # how the commands reach it, if not from DATABASES
        "OUTBOX_TABLE": "outbox",
        "INBOX_TABLE": "inbox",
        "TARGETS": ["orders", "audit"],     # None: the one target "default"
        "DEFAULT_TARGETS": ["orders"],
        "NOTIFY": False,                    # Outbox(notify=...): PostgreSQL NOTIFY on commit
        "BROKERS": {"orders": "nats://127.0.0.1:4222"},   # the relay's URL per target
        "RELAY": {"hold_keys": True},       # RelaySettings fields
        "CONSUMERS": {                      # `manage.py relaybox_consume NAME`
            "billing": {
                "URL": "nats://127.0.0.1:4222",
                "HANDLERS": {"OrderPlaced": "billing.handlers.order_placed"},
                "OPTIONS": {"stream": "ORDERS", "subject": "orders.>", "durable": "billing"},
            },
        },
    }

Every key is optional; an unknown one (a typo) is an error that names the known ones,
raised when Django starts the app rather than when a message goes missing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from django.conf import settings as django_settings
from django.core.signals import setting_changed

from relaybox.core.identifiers import DEFAULT_INBOX, DEFAULT_TABLE, validate_table_name
from relaybox.errors import ConfigurationError

_KEYS = frozenset({
    "DATABASE", "DATABASE_URL", "OUTBOX_TABLE", "INBOX_TABLE", "TARGETS", "DEFAULT_TARGETS",
    "NOTIFY", "BROKERS", "RELAY", "CONSUMERS",
})  # fmt: skip
_CONSUMER_KEYS = frozenset({"URL", "HANDLERS", "OPTIONS", "INBOX"})
#: The `HANDLERS` key of the handler that takes every type without a handler of its own.
EVERY_TYPE = "*"


@dataclasses.dataclass(frozen=True, slots=True)
class ConsumerSettings:
    """One consumer: where it receives, which function handles which message type
    (dotted paths), the broker consumer's keyword options, and the `Inbox`'s."""

    name: str
    url: str
    handlers: Mapping[str, str]
    options: Mapping[str, Any]
    inbox: Mapping[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class RelayboxSettings:
    database: str = "default"
    #: The URL by which relaybox's own drivers (the relay's, the console's) reach
    #: `database`; None: built from DATABASES.
    database_url: str | None = None
    outbox_table: str = DEFAULT_TABLE
    inbox_table: str = DEFAULT_INBOX
    targets: tuple[str, ...] | None = None
    default_targets: tuple[str, ...] | None = None
    notify: bool | float = False
    brokers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: Keyword arguments of `RelaySettings`; the relay command checks them.
    relay: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    consumers: Mapping[str, ConsumerSettings] = dataclasses.field(default_factory=dict)


@functools.cache
def settings() -> RelayboxSettings:
    """The project's `RELAYBOX` setting, checked once and kept; read anew after Django
    says it changed (`override_settings` in tests), so a writer pays no parse per add."""
    raw = getattr(django_settings, "RELAYBOX", {})
    if not isinstance(raw, Mapping):
        raise ConfigurationError("settings.RELAYBOX must be a dict")
    _known(raw, _KEYS, "settings.RELAYBOX")
    return RelayboxSettings(
        database=_text(raw, "DATABASE", "default"),
        database_url=None if raw.get("DATABASE_URL") is None else _text(raw, "DATABASE_URL", ""),
        outbox_table=validate_table_name(_text(raw, "OUTBOX_TABLE", DEFAULT_TABLE)),
        inbox_table=validate_table_name(_text(raw, "INBOX_TABLE", DEFAULT_INBOX)),
        targets=_names(raw, "TARGETS"),
        default_targets=_names(raw, "DEFAULT_TARGETS"),
        notify=_notify(raw.get("NOTIFY", False)),
        brokers=_mapping(raw, "BROKERS", "settings.RELAYBOX", str),
        relay=_mapping(raw, "RELAY", "settings.RELAYBOX", object),
        consumers={
            name: _consumer(name, value)
            for name, value in _mapping(raw, "CONSUMERS", "settings.RELAYBOX", Mapping).items()
        },
    )


def _known(raw: Mapping[str, Any], keys: frozenset[str], where: str) -> None:
    unknown = sorted(str(key) for key in raw if key not in keys)
    if unknown:
        raise ConfigurationError(
            f"{where} has unknown keys {', '.join(unknown)}; known: {', '.join(sorted(keys))}"
        )


def _text(raw: Mapping[str, Any], key: str, default: str) -> str:
    value = raw.get(key, default)
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"settings.RELAYBOX[{key!r}] must be a non-empty string")
    return value


def _names(raw: Mapping[str, Any], key: str) -> tuple[str, ...] | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, str) or not all(isinstance(name, str) for name in value):
        raise ConfigurationError(f"settings.RELAYBOX[{key!r}] must be a list of target names")
    return tuple(value)


def _notify(value: Any) -> bool | float:
    if isinstance(value, bool | int | float):
        return value
    raise ConfigurationError("settings.RELAYBOX['NOTIFY'] must be a bool or seconds")


def _mapping(raw: Mapping[str, Any], key: str, where: str, kind: type) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, Mapping) or not all(
        isinstance(name, str) and isinstance(item, kind) for name, item in value.items()
    ):
        raise ConfigurationError(f"{where}[{key!r}] must be a dict of names to {kind.__name__}")
    return dict(value)


def _consumer(name: str, raw: Mapping[str, Any]) -> ConsumerSettings:
    where = f"settings.RELAYBOX['CONSUMERS'][{name!r}]"
    _known(raw, _CONSUMER_KEYS, where)
    url = raw.get("URL")
    if not isinstance(url, str) or not url:
        raise ConfigurationError(f"{where} needs a 'URL': the broker it receives from")
    handlers = _mapping(raw, "HANDLERS", where, str)
    if not handlers:
        raise ConfigurationError(
            f"{where} needs 'HANDLERS': message type (or {EVERY_TYPE!r}) -> dotted path"
        )
    return ConsumerSettings(
        name=name,
        url=url,
        handlers=handlers,
        options=_mapping(raw, "OPTIONS", where, object),
        inbox=_mapping(raw, "INBOX", where, object),
    )


def _forget(*, setting: str, **_: Any) -> None:
    if setting == "RELAYBOX":
        settings.cache_clear()


setting_changed.connect(_forget, dispatch_uid="relaybox.integrations.django.conf")
