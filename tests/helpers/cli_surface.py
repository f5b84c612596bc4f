"""The flags of every ``bert-ds`` command, read from the argparse parser each ``main`` builds (captured at its
``parse_args``, nothing run): what ``tests/assets/cli_surface.json`` freezes. Regenerate that file after adding a
flag on purpose::

    python -m tests.helpers.cli_surface > tests/assets/cli_surface.json
"""

from __future__ import annotations

import argparse
import importlib
import json
from unittest import mock

from bert_ds.cli import COMMANDS

__all__ = ["cli_surface", "flags_of"]


class _Captured(BaseException):
    """Raised instead of parsing: a BaseException, so no ``except Exception`` in a main swallows it."""


def _flags(parser: argparse.ArgumentParser, prefix: str = "") -> list[str]:
    flags = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                flags += _flags(sub, f"{prefix}{name} ")
        elif action.option_strings:
            flags += [f"{prefix}{option}" for option in action.option_strings]
        else:
            flags.append(f"{prefix}<{action.dest}>")
    return sorted(flags)


def flags_of(command: str) -> list[str]:
    """Every option string (and ``<positional>``) of ``bert-ds <command>``, subcommands as ``sub --flag``."""
    captured: list[argparse.ArgumentParser] = []

    def grab(self, *args, **kwargs):
        captured.append(self)
        raise _Captured

    module = importlib.import_module(COMMANDS[command][0])
    with mock.patch.object(argparse.ArgumentParser, "parse_args", grab), \
            mock.patch.object(argparse.ArgumentParser, "parse_known_args", grab):
        try:
            module.main([])
        except _Captured:
            pass
    if not captured:
        raise AssertionError(f"bert-ds {command}: main([]) built no argparse parser")
    return _flags(captured[0])


def cli_surface() -> dict[str, list[str]]:
    return {command: flags_of(command) for command in COMMANDS}


if __name__ == "__main__":
    print(json.dumps(cli_surface(), indent=1))
