"""The `pdcompile` command line: inspect, plan, simulate, export, run, demo.

Each subcommand lives in its own module here and exposes `register(subparsers)`, which adds its
parser and sets `func(args) -> int`. Exit codes: 0 ok, 1 a user error (one line on stderr: a
PdcompileError, or a file that cannot be read or written), 2 usage (argparse), 130 interrupted.
Colour (a red "error:") only when stderr is a terminal and NO_COLOR is not set.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from pdcompile.errors import PdcompileError

SUBCOMMANDS = ("inspect", "plan", "simulate", "export", "run", "demo")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand that is installed."""
    parser = argparse.ArgumentParser(
        prog="pdcompile",
        description="Compile a PyTorch model into a PipeDream-style pipeline: trace, cost, "
        "partition into (replicated) stages, generate a 1F1B loop, run or simulate it.",
        epilog="Run 'pdcompile COMMAND --help' for the options of one command. Start with "
        "'pdcompile demo' (a few minutes on 2 cores). Exit status: 0 ok, 1 user error, 2 usage.",
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
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
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


def _error(command: str, message: str) -> None:
    """One line on stderr: `pdcompile CMD: error: message` (the word in red on a terminal)."""
    word = "\033[31merror\033[0m" if colour_enabled() else "error"
    print(f"pdcompile {command}: {word}: {message}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
