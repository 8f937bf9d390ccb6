"""A finished trace's view summaries, written into the trace by the command that recorded it.

    write_summaries(path) -> bool

The views' reducers keep what is expensive to fold (running sums, KDA layer and head series, the
health ranking, an image's answer reads) in `workbench.trace.summary_cache`; reducing a trace once
inside `summary_cache.into_trace(path)` puts those summaries in `<trace>/summaries/`, so the first
dashboard page or notebook view of that trace, wherever it is copied to, reads them instead of
every part. No Panel or Bokeh is loaded: `workbench run` and `workbench summarize` call it on
nodes that may have no dashboard stack.
"""

from __future__ import annotations

from pathlib import Path

from workbench.analysis.views import VIEW_REDUCERS, RecordingMapReducer, ViewOptions
from workbench.analysis.views.part_feed import PartFeeds
from workbench.trace import TraceError, open_trace, summary_cache


def write_summaries(path: str | Path) -> bool:
    """Reduce a finished trace once with every view's default options and write its summaries into the
    trace directory. Returns False when summaries are off (`K3WB_DASHBOARD_CACHE=off`), the trace is
    not complete, or it could not be read (the dashboard reports why when it is opened)."""
    if summary_cache.cache_root() is None:
        return False
    options = ViewOptions()
    try:
        with summary_cache.into_trace(path):
            trace = open_trace(path)
            session = RecordingMapReducer().reduce(trace, options, None)
            feeds = PartFeeds()  # kda_norms is read once for the two KDA views, as on a dashboard page
            for reducer in VIEW_REDUCERS.values():
                reducer(feeds).reduce(trace, options, session)
    except (TraceError, OSError, ValueError):
        return False
    return session.status == "complete"
