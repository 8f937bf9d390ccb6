"""Which product files one recorded `workbench run` enters: a measure of how many places a change to
running a question has to touch (the run core's goal: fewer).

    python benchmarks/run_trip.py [--tokens 2000] [--list]

Runs `workbench run --model builtin:demo --task find-fact ... --trace TMP` in this process under a
profiler hook that notes every Python function called (module bodies run by imports are not counted),
and prints how many distinct files of
`engine/`, `workbench/` and `apps/` were entered (`--list`: which). Run it on two trees side by side
to compare them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "workbench", "apps")


def import_everything() -> None:
    """Import every product module first (those whose optional dependencies are missing are skipped)."""
    import importlib
    import warnings

    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if parts[-1] == "__main__":
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001 - an optional extra (triton, a notebook's deps) not installed
                    pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2000, help="about how many tokens of document to ask about")
    p.add_argument("--list", action="store_true", help="print the files entered")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from apps.cli import main as workbench

    import_everything()  # so that what is counted is the run itself, never which imports happen during it
    entered: set[str] = set()
    roots = tuple(str(ROOT / pkg) + "/" for pkg in PACKAGES)

    def note(frame, event, _arg):
        # a function called, not a module's body run by its import (imports differ with what is loaded before)
        if event == "call" and frame.f_code.co_name != "<module>":
            name = frame.f_code.co_filename
            if name.startswith(roots):
                entered.add(name)

    with tempfile.TemporaryDirectory() as tmp:
        doc = Path(tmp) / "notes.txt"
        doc.write_text("The greenhouse keeps its seedlings warm through the winter. " * (args.tokens // 11))
        sys.setprofile(note)
        try:
            code = workbench(["run", "--model", "builtin:demo", "--task", "find-fact", "--key", "garage door",
                              "--value", "7142", "--prompt-file", str(doc), "--trace", str(Path(tmp) / "trace"),
                              "--compile", "off"])
        finally:
            sys.setprofile(None)
    if code != 0:
        print(f"workbench run failed (exit {code})", file=sys.stderr)
        return 1
    files = sorted(str(Path(f).relative_to(ROOT)) for f in entered)
    if args.list:
        print("\n".join(files))
    by_package = {pkg: sum(f.startswith(pkg + "/") for f in files) for pkg in PACKAGES}
    print(f"one recorded workbench run entered {len(files)} product files "
          f"({', '.join(f'{pkg}/ {n}' for pkg, n in by_package.items())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
