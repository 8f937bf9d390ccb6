"""The `workbench` command line: one parser, subcommands registered by topic modules.

The top floor: the commands wire the engine, the workbench and the dashboard together (the
console script `workbench` and `python -m workbench` both call `main`).

User errors (`engine.errors.EngineError` and friends) print one line, `error: ...`, and exit 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from engine.errors import EngineError
from apps.cli import (compare_cmd, dashboard_cmd, demo_cmd, export_cmd, import_cmd, model_cmds, plan_cmd,
                      questions_cmd, run_cmd, serve_cmd, summarize_cmd)

COMMAND_MODULES = [model_cmds, run_cmd, plan_cmd, demo_cmd, dashboard_cmd, summarize_cmd, export_cmd, compare_cmd,
                   questions_cmd, import_cmd, serve_cmd]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description="Kimi K3.1 inference engine and long-context "
                                     "memory inspector")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def one_line(message: str) -> str:
    """`message` with line breaks and other control characters escaped: an error names a path or
    value the user gave, and one holding a newline must not print what looks like a second error."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, which lists the flags it does take
        _subparsers(parser)[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.func(args) or 0)
    except EngineError as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
