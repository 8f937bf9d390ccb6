"""Test scaffolding that does not ship: synthetic traces for the tests and benchmarks.

Importable from the repository root (tests run there; benchmarks put the root on `sys.path`); not part
of the installed packages, so an inference node never carries it.
"""
