"""Test scaffolding that does not ship: synthetic traces for the tests and benchmarks (`synthetic`,
`synthetic_signals`), a finished trace replayed as if recorded (`replay.TraceReplay`) and the
headless-browser harness of the dashboard's browser tests (`browser`).

Importable from the repository root (tests run there; benchmarks put the root on `sys.path`); not part
of the installed packages, so an inference node never carries it.
"""
