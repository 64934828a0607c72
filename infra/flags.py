"""The commands of the ``rollstream`` CLI as data, tied to their settings classes.

A ``Command`` names its settings class (``module:Class``, imported only when the command is
parsed or run), the extra that installs what it needs, and its ``Flag``s. A flag with a
``setting`` overrides that field, and its help names the field's environment variable and
default, read off the class as docs/configuration.md is (configdoc), never typed twice:

    --bootstrap HOST:PORT  Kafka bootstrap servers [env ROLLSTREAM_KAFKA_BOOTSTRAP, default
                           127.0.0.1:9092]

The standard library only at import time (``rollstream --help`` runs on the base install).
"""

from __future__ import annotations

import argparse
import importlib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rollstream.infra.errors import InfraError

__all__ = [
    "COMMON",
    "Command",
    "Flag",
    "MissingExtra",
    "add_flags",
    "build_settings",
    "flag",
    "is_extra",
    "settings_class",
]


@dataclass(frozen=True, slots=True)
class Flag:
    """One command-line argument. With ``setting`` it overrides that field of the command's
    settings class. ``part`` ("host" or "port") overrides only that part of a ``host:port``
    setting. ``options`` are add_argument's other arguments (type, action, metavar, ...)."""

    names: tuple[str, ...]
    help: str
    setting: str | None = None
    part: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")


def flag(
    *names: str, help: str, setting: str | None = None, part: str | None = None, **options: Any
) -> Flag:
    return Flag(names, help, setting, part, options)


# every command's: the fields of CommonSettings most often set by hand
COMMON = (
    flag(
        "--home", help="state directory (broker data, models, logs)", setting="home", metavar="DIR"
    ),
    flag("--namespace", help="topic namespace prefix", setting="namespace", metavar="NS"),
    flag(
        "--bootstrap",
        help="Kafka bootstrap servers",
        setting="kafka_bootstrap",
        metavar="HOST:PORT",
    ),
)


@dataclass(frozen=True, slots=True)
class Command:
    """A subcommand: its one-line summary, its settings class (``module:Class``), the extra
    that installs what it imports, its own flags (``COMMON`` comes with every command), and
    the function that runs it with the built settings. A ``service`` runs until stopped and
    its stderr is its log (logs.py)."""

    name: str
    summary: str
    settings: str
    extra: str
    flags: tuple[Flag, ...]
    run: Callable[[argparse.Namespace, Any], int]
    service: bool = False

    @property
    def all_flags(self) -> tuple[Flag, ...]:
        return (*COMMON, *self.flags)


class MissingExtra(InfraError):
    """A command needs a module that only one of rollstream's extras installs."""

    def __init__(self, command: Command, module: str) -> None:
        super().__init__(
            f"`rollstream {command.name}` needs the {command.extra} extra (no module "
            f"{module!r}): pip install 'rollstream[{command.extra}]'"
        )


def is_extra(exc: ModuleNotFoundError) -> bool:
    """A third-party module is missing (one of ours missing is a bug, not an install)."""
    return bool(exc.name) and not str(exc.name).startswith("rollstream")


def settings_class(command: Command) -> Any:
    """Import the command's settings class; ``MissingExtra`` when an extra is not installed."""
    module, _, name = command.settings.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if is_extra(exc):
            raise MissingExtra(command, str(exc.name)) from exc
        raise
    unknown = [
        f.setting for f in command.all_flags if f.setting and f.setting not in cls.model_fields
    ]
    if unknown:  # a flag table that fell behind its settings class
        raise LookupError(f"`rollstream {command.name}`: {name} has no field {unknown}")
    return cls


def _split_hostport(value: str) -> tuple[str, str]:
    host, _, port = value.split(",")[0].rpartition(":")
    return host, port


def _help(f: Flag, cls: Any) -> str:
    """The flag's help, with ``[env VAR, default D]`` read off the settings class."""
    if f.setting is None:
        return f.help
    from rollstream.infra.configdoc import default_text, env_var

    env = env_var(cls, f.setting)
    default, _ = default_text(cls.model_fields[f.setting])
    if f.part is not None:
        host, port = _split_hostport(default)
        default = host if f.part == "host" else port
        env = f"{env} ({f.part})"
    return f"{f.help} [env {env}, default {default}]".replace("%", "%%")


def _choices(cls: Any, setting: str) -> tuple[Any, ...] | None:
    """The values of a ``Literal[...]`` field: its flag's choices."""
    annotation = cls.model_fields[setting].annotation
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    return None


def add_flags(parser: argparse.ArgumentParser, command: Command) -> None:
    """Add the command's flags to its parser (this imports its settings class)."""
    cls = settings_class(command)
    for f in command.all_flags:
        options = dict(f.options)
        if f.setting is not None and f.part is None and "choices" not in options:
            choices = _choices(cls, f.setting)
            if choices is not None:
                options["choices"] = choices
        parser.add_argument(*f.names, help=_help(f, cls), **options)
    parser.epilog = (
        f"Every ROLLSTREAM_* variable of {cls.__name__} applies (docs/configuration.md); "
        f"flags override them. Needs: pip install 'rollstream[{command.extra}]'."
    )


def build_settings(command: Command, args: argparse.Namespace) -> Any:
    """The command's settings: the environment, overridden by the flags given."""
    cls = settings_class(command)
    over: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {}
    for f in command.all_flags:
        value = getattr(args, f.dest, None)
        if f.setting is None or value is None or value == []:
            continue
        if f.part is not None:
            parts.setdefault(f.setting, {})[f.part] = value
        else:
            over[f.setting] = value
    for setting, given in parts.items():  # a host:port setting: replace the parts given
        host, port = _split_hostport(over.get(setting) or getattr(cls(**over), setting))
        over[setting] = f"{given.get('host', host or '127.0.0.1')}:{given.get('port', port)}"
    return cls(**over)
