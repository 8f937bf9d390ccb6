"""The trace store: a versioned, crash-safe directory of Parquet parts plus session.json.

Public API:
- `TraceWriter.create(path, session)` -> `.append(table, **columns)`, `.flush()`, `.update_session(**fields)`,
  `.close(status)`: what recorders write with; `check_trace_target(path)` checks the path before work.
- `open_trace(path)` -> `Trace`: read a finished or live trace (`refresh()` follows it).
- `TABLES`, `SCHEMA_VERSION`: the schema as data (`workbench.trace.schema`).
- `TraceError` (and `TraceVersionError`, `TraceCorruptError`): bad input, printed as one line by the CLI.
"""

from workbench.trace.errors import TraceCorruptError, TraceError, TraceVersionError
from workbench.trace.reader import Trace, open_trace
from workbench.trace.schema import SCHEMA_VERSION, TABLES, Column, TableSpec
from workbench.trace.writer import TraceWriter, check_trace_target

# the signal families' tables join TABLES when they register: whoever reads or writes a trace has them
import workbench.signals  # noqa: E402,F401

__all__ = ["SCHEMA_VERSION", "TABLES", "Column", "TableSpec", "Trace", "TraceCorruptError", "TraceError",
           "TraceVersionError", "TraceWriter", "check_trace_target", "open_trace"]
