"""relaybox.toml: one file configures every component, each in its own section.

    [relay]        the options of `relaybox relay` (`[relay.brokers]`: target = URL)
    [console]      the options of `relaybox console`
    [consumer]     the settings the broker consumers share (`SharedSettings`)

A value comes from the first of: the command line (or the caller's own arguments), the
environment (`RELAYBOX_<KEY>`), the file, the default. Errors name the key and where its
value came from, never the value of a key that may hold a secret.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import pathlib
import tomllib
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from relaybox.errors import ConfigurationError

PREFIX = "RELAYBOX_"
SECTIONS = ("relay", "console", "consumer")

T = TypeVar("T")


def read_section(path: str, section: str) -> dict[str, Any]:
    """The `[section]` table of the TOML file at `path` ({} when the file has none).

    A file that cannot be read or parsed, a section that is not a table, or a section
    that relaybox does not know is refused, naming the file."""
    try:
        with pathlib.Path(path).open("rb") as file:
            data = tomllib.load(file)
    except OSError as error:
        raise ConfigurationError(f"cannot read the configuration {path}: {error}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ConfigurationError(f"{path} is not valid TOML: {error}") from None
    unknown(data, SECTIONS, f"{path}: section")
    found = data.get(section, {})
    if not isinstance(found, dict):
        raise ConfigurationError(f"{path}: [{section}] must be a table")
    return found


def unknown(given: Iterable[str], known: Iterable[str], where: str) -> None:
    """Refuse the first name of `given` that is not `known`, suggesting the nearest."""
    choices = list(known)
    for name in given:
        if name not in choices:
            near = difflib.get_close_matches(name, choices, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigurationError(f"{where} {name!r} is unknown{hint}")


def env_name(key: str, scope: str = "") -> str:
    """The environment variable of a key: `batch_size` -> RELAYBOX_BATCH_SIZE."""
    return PREFIX + (f"{scope}_" if scope else "").upper() + key.upper()


def load_dataclass(
    cls: type[T],
    section: str,
    *,
    path: str | None = None,
    environ: Mapping[str, str] | None = None,
    given: Mapping[str, Any] | None = None,
) -> T:
    """A settings dataclass built from `given` (the caller's command line; None: not
    given), the environment (`RELAYBOX_<SECTION>_<FIELD>`; empty: not set), `[section]`
    of the file at `path` (or RELAYBOX_CONFIG), then the class's defaults. Fields are
    int, float, bool or str."""
    environ = os.environ if environ is None else environ
    path = path or environ.get(PREFIX + "CONFIG") or None
    fields = {field.name: field for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    given = {name: value for name, value in (given or {}).items() if value is not None}
    unknown(given, fields, f"{cls.__name__}:")
    values: dict[str, Any] = {}
    if path is not None:
        in_file = read_section(path, section)
        unknown(in_file, fields, f"{path}: [{section}]")
        values |= {
            k: _typed(fields[k].type, v, f"{path}: [{section}] {k}") for k, v in in_file.items()
        }
    for name, field in fields.items():
        variable = env_name(name, section)
        if environ.get(variable):
            values[name] = _typed(field.type, environ[variable], variable)
    values |= given
    try:
        return cls(**values)
    except (TypeError, ValueError) as error:
        raise ConfigurationError(f"{cls.__name__}: {error}") from None


_BOOLEANS = {"1": True, "true": True, "yes": True, "on": True,
             "0": False, "false": False, "no": False, "off": False}  # fmt: skip


def _typed(kind: object, value: object, where: str) -> object:
    """`value` (from a file or, as text, the environment) as the field's type."""
    name = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    try:
        if name == "bool":
            if isinstance(value, bool):
                return value
            return _BOOLEANS[str(value).strip().lower()]
        if name in ("int", "float") and not isinstance(value, bool):
            if name == "int" and isinstance(value, float):
                raise ValueError
            return int(str(value)) if name == "int" else float(str(value))
        if name == "str" and isinstance(value, str):
            return value
    except (KeyError, ValueError, TypeError):
        pass
    raise ConfigurationError(f"{where}: {value!r} is not a valid {name}")
