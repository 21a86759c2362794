"""The `pdcompile` command line: inspect, plan, simulate, export, run, demo.

Each subcommand lives in its own module here and exposes `register(subparsers)`, which adds its
parser and sets `func(args) -> int`. Exit codes: 0 ok, 1 a user error (one line on stderr),
2 usage (argparse).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pdcompile.errors import PdcompileError

SUBCOMMANDS = ("inspect", "plan", "simulate", "export", "run", "demo")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand that is installed."""
    parser = argparse.ArgumentParser(
        prog="pdcompile",
        description="Compile a PyTorch model into a PipeDream-style pipeline: trace, cost, "
        "partition into (replicated) stages, generate a 1F1B loop, run or simulate it.",
        epilog="Run 'pdcompile COMMAND --help' for the options of one command.",
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
        print(f"pdcompile {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
