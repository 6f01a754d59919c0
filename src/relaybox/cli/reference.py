"""The options tables of docs/configuration.md, written from the declarations that
define them: the options of `relaybox relay` and `relaybox console` and the fields of
the consumers' `SharedSettings`. Each table sits between two markers in the page;
`updated` rewrites what is between them, so the page cannot drift from the code."""

from __future__ import annotations

import click

from relaybox.cli.config import Configured, settings_options
from relaybox.errors import ConfigurationError

_BEGIN = "<!-- generated reference: {section} -->"
_END = "<!-- end of generated reference: {section} -->"


def _commands() -> dict[str, Configured]:
    from relaybox.cli.console import console
    from relaybox.cli.relay import relay

    return {"relay": relay, "console": console, "consumer": consumer_options()}


def consumer_options() -> Configured:
    """A command with the consumers' `SharedSettings` as options, as a consumer program
    declares them (`settings_options`)."""
    from relaybox.consumers.base import SharedSettings

    @click.command(cls=Configured, section="consumer")
    @settings_options(SharedSettings, scope="consumer")
    def consumer(settings: SharedSettings) -> None:
        """The consumers' shared settings."""

    return consumer


def command_table(command: Configured) -> str:
    """One row per option of the command: its key in the file, its option, its
    environment variable, its default and its meaning."""
    rows = [
        f"| key in `[{command.section}]` | option | environment | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for name, option in command.file_keys().items():
        shown = (
            f'`[{command.section}.{name}]` NAME = "..."'
            if option.name in command.tables
            else f"`{name}`"
        )
        meaning = _text(option.help or "")
        if option.name in command.secrets:
            meaning += " Secret: in the file only without a password."
        rows.append(
            f"| {shown} | `{max(option.opts, key=len)}` | `{_envvar(option)}` | "
            f"{_default(option)} | {meaning.strip()} |"
        )
    return "\n".join(rows)


def tables() -> dict[str, str]:
    """Each section's table."""
    return {name: command_table(command) for name, command in _commands().items()}


def everything() -> str:
    return "\n\n".join(f"[{section}]\n\n{table}" for section, table in tables().items())


def updated(page: str) -> str:
    """The page with each section's table between its markers rewritten."""
    for section, table in tables().items():
        begin, end = _BEGIN.format(section=section), _END.format(section=section)
        start, stop = page.find(begin), page.find(end)
        if start < 0 or stop < start:
            raise ConfigurationError(f"the page has no {begin} ... {end} markers")
        page = f"{page[:start]}{begin}\n\n{table}\n\n{page[stop:]}"
    return page


def _envvar(option: click.Option) -> str:
    return option.envvar if isinstance(option.envvar, str) else " ".join(option.envvar or ())


def _default(option: click.Option) -> str:
    value = option.default
    if option.is_flag:
        return "on" if value is True else "off"
    if isinstance(option.show_default, str):  # a default that depends, said in words
        return option.show_default
    if value is None or option.multiple:
        return ""
    return f"`{value}`" if isinstance(value, str) else str(value)


def _text(help_text: str) -> str:
    return " ".join(help_text.split()).replace("|", "\\|")
