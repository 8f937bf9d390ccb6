"""One reducer per view: `(trace, view options, session map data) -> that view's data`, pure (no Panel).

    session_map.RecordingMapReducer -> RecordingMapData   segments, progress, generated tokens (every view's context)
    dsa_map.DSAMapReducer         -> DSAMapData       selection heat map, read-out of the selected token
    kda_state.KDAStateReducer     -> KDAStateData     state norms per layer and per head of one layer
    experts.ExpertsReducer        -> ExpertsData      expert usage, text vs image, routes, EP rank load
    kda_health_view.KDAHealthReducer -> KDAHealthData    heads ranked by how fast they saturate / forget, and where
    dsa_diff.DSADiffReducer       -> DSADiffData      where two traces' DSA reads differ (side-by-side mode only)

Every reducer reads through the public trace API (`workbench.open_trace`), does its maths with
`workbench.analysis`, and returns screen-sized, immutable data: the dashboard, `workbench.show` and
a script get the same numbers. The views after the session map depend only on the trace and the
session map's data, so the dashboard's follower builds them in parallel threads (one after another
on a two-core machine). `shared_reducers` holds one trace's reducers for every page following it;
`summaries.write_summaries` writes a finished trace's summaries into it (`workbench.trace.summary_cache`).
A view is registered once, with its component, in `apps/dashboard/views.py`.
"""

from workbench.analysis.views.base import HeatMap, Reducer, ViewOptions
from workbench.analysis.views.dsa_diff import DSADiffData, DSADiffReducer
from workbench.analysis.views.dsa_map import DSAMapData, DSAMapReducer
from workbench.analysis.views.image_reads_view import ImageReadsData
from workbench.analysis.views.experts import ExpertsData, ExpertsReducer
from workbench.analysis.views.kda_health_view import KDAHealthData, KDAHealthReducer
from workbench.analysis.views.kda_state import KDAStateData, KDAStateReducer
from workbench.analysis.views.session_map import RecordingMapData, RecordingMapReducer

# the views built from the session map's data (the frame field each one fills -> its reducer), in the order
# they run one after another: cheapest first, so the slowest never delays the others (docs/benchmarks.md);
# each is built with the trace's shared `PartFeeds` (`cls(feeds)`: KDA state and health read kda_norms once)
VIEW_REDUCERS: dict[str, type[Reducer]] = {"experts": ExpertsReducer, "dsa": DSAMapReducer, "kda": KDAStateReducer,
                                           "health": KDAHealthReducer}

__all__ = ["DSADiffData", "DSADiffReducer", "DSAMapData", "DSAMapReducer", "ExpertsData", "ExpertsReducer", "HeatMap",
           "ImageReadsData", "KDAHealthData", "KDAHealthReducer", "KDAStateData", "KDAStateReducer", "Reducer", "RecordingMapData", "RecordingMapReducer", "VIEW_REDUCERS", "ViewOptions"]
