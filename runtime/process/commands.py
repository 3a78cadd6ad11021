"""What every ``turnstream`` sub-command shares: how a service declares its command (``services/<name>/command.py``
registers a parser whose ``handler`` runs it), flags that override fields of a config section, and refusing
bad flags with exit status 2. ``services/cli.py`` only assembles the commands."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeAlias

import msgspec

from runtime.configuration.config import Config, ConfigError
from schemas.modes import MODES

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""What ``ArgumentParser.add_subparsers`` returns: each service adds its command to it."""

Handler = Callable[[Config, argparse.Namespace], int]
"""A command's body: the loaded configuration and the parsed flags in, the exit status out."""

MODE_HELP = f"{', '.join(MODES)} or a mode registered by plugins.modules (default: dispatcher.mode)"


def command(sub: Subparsers, name: str, help: str, handler: Handler) -> argparse.ArgumentParser:
    """A sub-command's parser, run by ``handler``."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help)
    parser.set_defaults(handler=handler)
    return parser


def refuse(name: str, why: object) -> int:
    """A command that cannot start (a bad flag, a missing file): one line on stderr and exit status 2."""
    print(f"turnstream {name}: {why}", file=sys.stderr)
    return 2


def override(config: Config, section: str, values: Mapping[str, object]) -> Config:
    """``config`` with the command-line flags that were given, validated like the config file's values."""
    given = {k: v for k, v in values.items() if v is not None}
    if not given:
        return config
    current = msgspec.to_builtins(getattr(config, section))
    try:
        updated = msgspec.convert({**current, **given}, type(getattr(config, section)))
    except (msgspec.ValidationError, ValueError) as exc:
        raise ConfigError(f"{section}: {exc}") from None
    return msgspec.structs.replace(config, **{section: updated})


def worker(section: str, flags: tuple[str, ...], main: str, **extra: str) -> Handler:
    """The handler of a consuming service: ``flags`` override the fields of the same name in ``section``, then
    ``main`` (``module:function``, imported only when this command runs: the trainer's brings torch) runs
    ``main(config, **{keyword: args.<flag>})`` until it stops (``extra`` maps keywords to flags)."""

    def run(config: Config, args: argparse.Namespace) -> int:
        try:
            config = override(config, section, {f: getattr(args, f) for f in flags})
        except ConfigError as exc:
            return refuse(args.command, exc)
        module, _, function = main.partition(":")
        loop: Callable[..., Coroutine[Any, Any, Any]] = getattr(importlib.import_module(module), function)
        asyncio.run(loop(config, **{k: getattr(args, f) for k, f in extra.items()}))
        return 0

    return run
