"""`python -m workbench ...` (and `torchrun -m workbench ...`): the thin entry script of the command line.

The command line itself lives on the top floor (`apps.cli`), where engine, workbench and apps are
wired together; this file only keeps the `-m workbench` spelling working, so it is the one module
of `workbench` allowed to import `apps` (tests/test_architecture.py exempts exactly this file).
"""

from apps.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
