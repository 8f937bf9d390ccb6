"""K3 Workbench: probes, recorders, trace store, analysis and the `workbench` command line.

The engine (`engine`) runs the model; this package observes it and never the other way round.

Public API:
- `record(session, trace=DIR, dsa=True, kda=True, moe=True, policy="default")`: a context manager
  that records a running `engine.session.Session` into a trace directory.
- `open_trace(DIR)`: read a finished or live trace (`Trace.refresh()` follows a live one).
- `RecordPolicy`, `load_policy`: what is kept raw and what is only counted.
- `workbench.analysis`: pure functions over trace arrays (shared by notebooks, CLI and app).
"""

from workbench.record import RecordPolicy, load_policy, record
from workbench.trace import Trace, TraceError, TraceWriter, open_trace

__all__ = ["RecordPolicy", "Trace", "TraceError", "TraceWriter", "load_policy", "open_trace", "record"]
