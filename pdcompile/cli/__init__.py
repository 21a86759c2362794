"""The `pdcompile` command line: inspect, plan, simulate, export, run, verify, demo.

Each subcommand lives in its own module here and exposes `register(subparsers)`, which adds its
parser and sets `func(args) -> int`. Exit codes: 0 ok, 1 a user error (one line on stderr: a
PdcompileError, a file that cannot be read or written, or a usage error from argparse, with a
'did you mean' for a mistyped command, choice or option), 130 interrupted.
Colour (a red "error:") only when stderr is a terminal and NO_COLOR is not set.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from typing import NoReturn

from pdcompile.errors import PdcompileError
from pdcompile.util.suggest import did_you_mean

SUBCOMMANDS = ("inspect", "plan", "simulate", "export", "run", "verify", "demo")


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors in one line: the error, a 'did you mean' for a mistyped
    choice, and where the options are listed (instead of the usage block)."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            options = re.findall(r"'([^']*)'", choice.group(2))
            message = message.replace(f" (choose from {choice.group(2)})",
                                      f"{did_you_mean(choice.group(1), options)}; choose from "
                                      f"{', '.join(options)}")
        _error("", f"{message} (see '{self.prog} --help')", prog=self.prog)
        sys.exit(1)

    def unknown(self, extras: list[str]) -> NoReturn:
        """Refuse arguments this (sub)command does not take, suggesting the closest option."""
        options = [o for action in self._actions for o in action.option_strings]
        hints = [f"{e}{did_you_mean(e.split('=')[0], options)}" for e in extras]
        self.error(f"unrecognized arguments: {' '.join(hints)}")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand that is installed."""
    parser = _Parser(
        prog="pdcompile",
        description="Compile a PyTorch model into a PipeDream-style pipeline: trace, cost, "
        "partition into (replicated) stages, generate a 1F1B loop, run or simulate it.",
        epilog="Run 'pdcompile COMMAND --help' for the options of one command. Start with "
        "'pdcompile demo' (a few minutes on 2 cores). Exit status: 0 ok, 1 user error.",
    )
    from pdcompile import __version__

    parser.add_argument("--version", action="version", version=f"pdcompile {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"pdcompile.cli.{name}_cmd")
        except ModuleNotFoundError as err:
            if err.name != f"pdcompile.cli.{name}_cmd":
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        command = getattr(args, "command", None)
        sub = _subparser(parser, command) if command else None
        (sub or parser).unknown(extras)  # type: ignore[attr-defined]
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    try:
        return int(args.func(args) or 0)
    except PdcompileError as err:
        _error(args.command, str(err))
        return 1
    except OSError as err:  # a file named on the command line that cannot be read or written
        if isinstance(err, BrokenPipeError):  # `pdcompile plan ... | head`: not an error
            sys.stderr.close()
            return 0
        where = f" {err.filename!r}" if err.filename else ""
        _error(args.command, f"{err.strerror or err}{where}")
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def colour_enabled(stream: object = None) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set (https://no-color.org)."""
    target = sys.stderr if stream is None else stream
    isatty = getattr(target, "isatty", None)
    return bool(isatty and isatty()) and not os.environ.get("NO_COLOR")


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found = action.choices.get(command)
            return found if isinstance(found, argparse.ArgumentParser) else None
    return None


def _error(command: str, message: str, *, prog: str | None = None) -> None:
    """One line on stderr: `pdcompile CMD: error: message` (the word in red on a terminal)."""
    word = "\033[31merror\033[0m" if colour_enabled() else "error"
    who = prog or (f"pdcompile {command}" if command else "pdcompile")
    print(f"{who}: {word}: {message}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
