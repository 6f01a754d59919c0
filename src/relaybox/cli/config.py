"""Where the options of `relaybox relay` and `relaybox console` come from.

Each option is declared once, as a click option whose default is the component's
settings object's; from that declaration come its environment variable
(`RELAYBOX_<KEY>`, `--batch-size`: RELAYBOX_BATCH_SIZE), its key in the command's
section of relaybox.toml (`batch_size` under `[relay]`) and its row in the reference of
docs/configuration.md. Click reads them in this order: the command line, the
environment, the file (loaded into the context's `default_map` by the eager `--config`
option, or RELAYBOX_CONFIG), the default.

Database and broker URLs and the console's token are secrets: the file may not hold a
URL with a password or a secret query option (give it in the environment or in a file
named by a `*_file` key), and no error shows the value of such a key.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import click

from relaybox.cli import output
from relaybox.core.config import env_name, read_section, unknown
from relaybox.core.urls import url_secrets
from relaybox.errors import ConfigurationError

T = TypeVar("T")

CONFIG_ENV = "RELAYBOX_CONFIG"
_NEAREST = {
    click.core.ParameterSource.COMMANDLINE: 0,
    click.core.ParameterSource.ENVIRONMENT: 1,
    click.core.ParameterSource.DEFAULT_MAP: 2,
}


def key(option: click.Parameter) -> str:
    """The option's key in the file: its long name with underscores (`batch_size`)."""
    return max(option.opts, key=len).lstrip("-").replace("-", "_")


class Configured(click.Command):
    """A command whose options also come from the environment and a TOML section.

    `tables` are the multiple `NAME=VALUE` options that the file gives as a table under
    the parameter's name (`[relay.brokers]`); `secrets` are the options whose values
    may hold passwords, which the file may not give with one."""

    def __init__(
        self,
        *args: Any,
        section: str,
        tables: Iterable[str] = (),
        secrets: Iterable[str] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.section = section
        self.tables = frozenset(tables)
        self.secrets = frozenset(secrets)
        for param in self.params:
            if isinstance(param, click.Option):
                param.envvar = param.envvar or env_name(key(param))
                param.show_envvar = True
        self.params.insert(0, _config_option())

    def file_key(self, param: click.Parameter) -> str:
        """The option's key in the file: a table of `NAME=VALUE` options goes by the
        parameter's name (`brokers`), any other by `key`."""
        return str(param.name) if param.name in self.tables else key(param)

    def file_keys(self) -> dict[str, click.Option]:
        """Each key the file may hold, and its option."""
        return {
            self.file_key(param): param
            for param in self.params
            if isinstance(param, click.Option) and param.name and param.name != "config"
        }

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except ConfigurationError as error:
            raise output.Failure(str(error)) from None
        except click.BadParameter as error:
            raise self._sourced(ctx, error) from None

    def _sourced(self, ctx: click.Context, error: click.BadParameter) -> click.BadParameter:
        """The error, naming where the bad value came from when not the command line."""
        param = error.param
        if not isinstance(param, click.Option) or param.name is None:
            return error
        source = ctx.get_parameter_source(param.name)
        if source is click.core.ParameterSource.ENVIRONMENT:
            where = f"{_envvars(param)} ({param.opts[0]})"
        elif source is click.core.ParameterSource.DEFAULT_MAP:
            where = f"{ctx.meta.get('relaybox.config')}: [{self.section}] {self.file_key(param)}"
        else:
            return error
        return click.BadParameter(error.message, ctx=ctx, param_hint=where)

    def defaults_from(self, path: str) -> dict[str, Any]:
        """The `default_map` that `[section]` of the file at `path` gives."""
        keys = self.file_keys()
        found = read_section(path, self.section)
        unknown(found, keys, f"{path}: [{self.section}] key")
        return {
            str(keys[name].name): self._value(keys[name], name, value, f"{path}: [{self.section}]")
            for name, value in found.items()
        }

    def _value(self, option: click.Option, name: str, value: object, where: str) -> object:
        """A file's value for `option` as click takes it, refused when it is of the
        wrong shape or holds a secret that belongs elsewhere."""
        if option.name in self.tables:
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise ConfigurationError(f'{where} {name} must be a table of NAME = "..."')
            if option.name in self.secrets:
                for target, url in value.items():
                    self._no_secret(url, f"{where} {name}.{target}", option)
            return [f"{target}={url}" for target, url in value.items()]
        if option.multiple:
            items = [value] if isinstance(value, str) else value
            if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
                raise ConfigurationError(f"{where} {name} must be a string or a list of strings")
            if option.name in self.secrets:
                for url in items:
                    self._no_secret(url, f"{where} {name}", option)
            return items
        if not isinstance(value, str | int | float | bool):
            raise ConfigurationError(
                f"{where} {name} must be a single value, not {type(value).__name__}"
            )
        return value

    def _no_secret(self, url: str, where: str, option: click.Option) -> None:
        if url_secrets(url):
            raise ConfigurationError(
                f"{where} holds a password or secret; give it in {_envvars(option)} or "
                "in a file named by the matching *_file key"
            )


def _envvars(option: click.Option) -> str:
    names = [option.envvar] if isinstance(option.envvar, str) else list(option.envvar or ())
    return " or ".join(names)


def _load(ctx: click.Context, _param: click.Parameter, path: str | None) -> None:
    if path is None:
        return
    command = ctx.command
    assert isinstance(command, Configured)
    ctx.meta["relaybox.config"] = path
    ctx.default_map = {**(ctx.default_map or {}), **command.defaults_from(path)}


def _config_option() -> click.Option:
    return click.Option(
        ["--config"],
        type=click.Path(dir_okay=False),
        metavar="PATH",
        envvar=CONFIG_ENV,
        show_envvar=True,
        is_eager=True,
        expose_value=False,
        callback=_load,
        help="Read options from this TOML file (the command's section); the command line "
        "and the environment take precedence.",
    )


def nearest(
    ctx: click.Context, values: Mapping[str, tuple[str, ...]]
) -> dict[str, tuple[str, ...]]:
    """Of options that give the same thing in different ways (`--db` and `--db-file`),
    keep those given from the nearest source (the command line, then the environment,
    then the file): an environment variable or the file is read only when the command
    line gives none of them."""
    ranks = {
        name: _NEAREST.get(ctx.get_parameter_source(name) or click.core.ParameterSource.DEFAULT, 3)
        for name, given in values.items()
        if given
    }
    best = min(ranks.values(), default=3)
    return {name: given if ranks.get(name) == best else () for name, given in values.items()}


def given_by(ctx: click.Context) -> str:
    """Where the values that were not defaults came from, for an error about a
    combination of them: ` (given by RELAYBOX_LEASE, relaybox.toml [relay] batch_size)`."""
    command = ctx.command
    found = []
    for param in command.params:
        source = ctx.get_parameter_source(param.name or "")
        if isinstance(param, click.Option) and source is click.core.ParameterSource.ENVIRONMENT:
            found.append(_envvars(param))
        elif source is click.core.ParameterSource.DEFAULT_MAP and isinstance(command, Configured):
            found.append(
                f"{ctx.meta.get('relaybox.config')} [{command.section}] {command.file_key(param)}"
            )
    return f" (given by {', '.join(found)})" if found else ""


_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}


def settings_options(
    cls: type[T], *, scope: str = ""
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """An option for each field of the settings dataclass `cls` (`prefetch`:
    `--prefetch`, RELAYBOX_<SCOPE>_PREFETCH, the field's default and its `#:` comment as
    help); the command gets the built object as `settings`. With `Configured`, the
    fields also come from the command's section of the file."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    comments = field_comments(cls)

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> Any:
            values = {field.name: kwargs.pop(field.name) for field in fields}
            try:
                settings = cls(**values)
            except (ConfigurationError, ValueError, TypeError) as error:
                raise output.Failure(f"{error}{given_by(click.get_current_context())}") from None
            return command(*args, settings=settings, **kwargs)

        for field in reversed(fields):
            flag = "--" + field.name.replace("_", "-")
            kind = _TYPES[str(field.type)]
            run = click.option(
                f"{flag}/--no-{flag[2:]}" if kind is bool else flag,
                field.name,
                type=kind,
                default=field.default,
                show_default=True,
                envvar=env_name(field.name, scope),
                help=comments.get(field.name),
            )(run)
        return run

    return decorate


def field_comments(cls: type) -> dict[str, str]:
    """The `#:` comments above each field of a dataclass, by field name."""
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        if (match := re.match(r"(\w+):", stripped)) and pending:
            comments[match.group(1)] = " ".join(pending)
        pending = []
    return comments


@click.group()
def config() -> None:
    """relaybox.toml and the environment: the options of every command."""


@config.command()
@click.option(
    "--docs",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    metavar="PATH",
    help="Rewrite the reference in this Markdown file (docs/configuration.md).",
)
@click.option("--check", is_flag=True, help="With --docs: exit 1 if it is out of date instead.")
def reference(docs: str | None, check: bool) -> None:
    """Print the reference of every option: its key, variable, default and meaning."""
    from relaybox.cli import reference as tables

    if docs is None:
        output.lines(tables.everything())
        return
    with open(docs, encoding="utf-8") as file:
        text = file.read()
    updated = tables.updated(text)
    if updated == text:
        return
    if check:
        output.line(
            f"{docs} is out of date: run `relaybox config reference --docs {docs}`", err=True
        )
        sys.exit(1)
    with open(docs, "w", encoding="utf-8") as file:
        file.write(updated)
    output.line(f"{docs} updated")
