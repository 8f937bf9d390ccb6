"""`workbench summarize TRACE`: write the dashboard's summaries into a finished trace.

What `workbench run` does when its recording ends, for a trace recorded another way (the Python API,
a notebook, an older version): the dashboard's views of the trace are reduced once and kept inside
the trace directory (`<trace>/summaries/`, Arrow and JSON keyed by the parts' content), so opening
the trace later, here or wherever it is copied, reads megabytes instead of every part.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from engine.errors import InputError
from workbench.trace import open_trace


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("summarize", help="write the dashboard's summaries into a finished trace (fast first open)")
    p.add_argument("trace", type=Path, help="trace directory (holds session.json)")
    p.set_defaults(func=cmd_summarize)


def cmd_summarize(args: argparse.Namespace) -> int:
    from workbench.trace import summary_cache
    from workbench.analysis.views.summaries import write_summaries  # the reducers load only here

    trace = open_trace(args.trace)  # a missing or malformed trace: a TraceError, one line
    if trace.status != "complete":
        raise InputError(f"{args.trace} is {trace.status}, not complete: only a finished trace is summarized")
    if summary_cache.cache_root() is None:
        raise InputError("summaries are turned off (K3WB_DASHBOARD_CACHE=off)")
    started = time.perf_counter()
    if not write_summaries(args.trace):
        raise InputError(f"{args.trace} could not be summarized (the dashboard shows why when it opens it)")
    folder = Path(args.trace) / summary_cache.TRACE_DIR
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0
    print(f"summaries of {args.trace} written to {folder} ({size / 2**20:.1f} MiB, "
          f"{time.perf_counter() - started:.1f} s)")
    return 0
