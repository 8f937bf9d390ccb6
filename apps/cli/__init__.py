"""The `workbench` command line: one parser, subcommands registered by topic modules.

The top floor: the commands wire the engine, the workbench and the dashboard together (the
console script `workbench` and `python -m workbench` both call `main`).

User errors (`engine.errors.EngineError` and friends) print one line, `error: ...`, and exit 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType
from typing import Sequence

from engine.errors import EngineError

# each command's module (in the order `workbench --help` lists them): a command imports and registers only
# its own module, so running one never loads the others (or what they import)
COMMANDS: dict[str, str] = {
    "checkpoint": "model_cmds", "inspect": "model_cmds", "logits": "model_cmds", "run": "run_cmd",
    "plan": "plan_cmd", "demo": "demo_cmd", "dashboard": "dashboard_cmd", "summarize": "summarize_cmd",
    "export": "export_cmd", "compare": "compare_cmd", "questions": "questions_cmd", "import": "import_cmd",
    "serve": "serve_cmd", "conformance": "conformance_cmd", "attribute": "attribute_cmd",
}


def command_modules(command: str | None = None) -> list[ModuleType]:
    """The modules that register `command` (every command's when None or unknown: the full listing)."""
    names = [COMMANDS[command]] if command in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    return [importlib.import_module(f"apps.cli.{name}") for name in names]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `workbench` parser: every command's (default), or only what `command` needs."""
    parser = argparse.ArgumentParser(prog="workbench", description="Kimi K3.1 inference engine and long-context "
                                     "memory inspector")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in command_modules(command):
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
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(words[0] if words else None)  # the top level takes no options before the command
    args, unknown = parser.parse_known_args(words)
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
