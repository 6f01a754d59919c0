"""Decoding a JSON payload into the class a handler declared, and validating it.

A handler registered with `payload=` gets the payload as an instance of that class: a
dataclass, or a pydantic model (any class with `model_validate_json`: pydantic itself is
never imported here). A payload that is not JSON, or does not fit the class, raises
`EnvelopeError`: it will never fit, so the consumer parks the message at once.

A dataclass is checked field by field against its annotations: required fields present,
no unknown ones, and each value of its declared type (str, int, float, bool, None,
lists, tuples, dicts, unions, `Literal`, nested dataclasses; anything else is taken as
it is). An int is accepted for a float, as JSON does not tell them apart.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Any

from relaybox.core.incoming import Incoming
from relaybox.errors import ConfigurationError, EnvelopeError

Decoder = Callable[[Incoming], Any]


def decoder(payload: type[Any]) -> Decoder:
    """How to turn a message's payload into an instance of `payload`; refuses a class
    that is neither a dataclass nor a pydantic model."""
    validate_json = getattr(payload, "model_validate_json", None)
    if callable(validate_json):
        return functools.partial(_model, validate_json, payload.__name__)
    if isinstance(payload, type) and dataclasses.is_dataclass(payload):
        typing.get_type_hints(payload)  # unresolvable annotations fail here, not per message
        return functools.partial(_dataclass, payload)
    raise ConfigurationError(
        f"payload={payload!r}: give a dataclass or a pydantic model for the payload"
    )


def _model(validate_json: Callable[[bytes], Any], name: str, message: Incoming) -> Any:
    try:
        return validate_json(message.payload)
    except ValueError as error:  # pydantic's ValidationError is a ValueError
        raise EnvelopeError(f"message {message.id}: payload is no valid {name}: {error}") from None


def _dataclass(payload: type[Any], message: Incoming) -> Any:
    data = message.json()
    try:
        return _build(payload, data, "payload")
    except _Invalid as error:
        raise EnvelopeError(
            f"message {message.id}: payload is no valid {payload.__name__}: {error}"
        ) from None


class _Invalid(Exception):
    """Where and why a value does not fit its annotation."""


def _build(kind: type[Any], data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise _Invalid(f"{where} must be a JSON object")
    hints = typing.get_type_hints(kind)
    fields = {field.name: field for field in dataclasses.fields(kind) if field.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise _Invalid(f"{where} has unknown fields {', '.join(unknown)}")
    values = {}
    for name, field in fields.items():
        if name in data:
            values[name] = _value(hints[name], data[name], f"{where}.{name}")
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise _Invalid(f"{where}.{name} is missing")
    return kind(**values)


def _value(hint: Any, value: Any, where: str) -> Any:
    """`value` as `hint` declares it (nested dataclasses built), or `_Invalid`."""
    origin = typing.get_origin(hint)
    if hint is Any or isinstance(hint, typing.TypeVar):
        return value
    if origin in (typing.Union, types.UnionType):
        return _union(typing.get_args(hint), value, where)
    if origin is typing.Literal:
        if value in typing.get_args(hint):
            return value
        raise _Invalid(f"{where} must be one of {', '.join(map(repr, typing.get_args(hint)))}")
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if origin in (list, tuple, dict):
        return _container(origin, typing.get_args(hint), value, where)
    return _scalar(hint, value, where)


def _union(options: tuple[Any, ...], value: Any, where: str) -> Any:
    for option in options:
        try:
            return _value(option, value, where)
        except _Invalid:
            continue
    raise _Invalid(f"{where} fits none of {' | '.join(map(_name, options))}")


def _scalar(hint: Any, value: Any, where: str) -> Any:
    if hint is None or hint is type(None):
        if value is None:
            return None
        raise _Invalid(f"{where} must be null")
    if hint is float and type(value) is int:
        return float(value)
    if hint not in (str, int, float, bool, list, dict):
        return value  # a type JSON has no values of: taken as it is
    if type(value) is bool and hint is not bool:  # JSON's true is no number
        raise _Invalid(f"{where} must be {hint.__name__}, not a boolean")
    if not isinstance(value, hint):
        raise _Invalid(f"{where} must be {hint.__name__}, not {type(value).__name__}")
    return value


def _name(hint: Any) -> str:
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _container(origin: Any, args: tuple[Any, ...], value: Any, where: str) -> Any:
    if origin is dict:
        if not isinstance(value, dict):
            raise _Invalid(f"{where} must be an object")
        item = args[1] if len(args) == 2 else Any
        return {key: _value(item, entry, f"{where}.{key}") for key, entry in value.items()}
    if not isinstance(value, list):
        raise _Invalid(f"{where} must be an array")
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(args) != len(value):
            raise _Invalid(f"{where} must have {len(args)} items")
        pairs = enumerate(zip(args, value, strict=True))
        return tuple(_value(kind, entry, f"{where}[{n}]") for n, (kind, entry) in pairs)
    item = args[0] if args else Any
    items = [_value(item, entry, f"{where}[{n}]") for n, entry in enumerate(value)]
    return tuple(items) if origin is tuple else items
