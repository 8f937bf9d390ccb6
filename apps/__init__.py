"""The top floor: applications wired from the engine and the workbench's public API.

- `apps.cli`: the `workbench` command line (console script and `python -m workbench`).
- `apps.dashboard`: the Panel dashboard.
"""
