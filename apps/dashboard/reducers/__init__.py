"""One reducer per dashboard view: `(trace, view options, session map data) -> that view's data`.

    session_map.SessionMapReducer -> SessionMapData   segments, progress, generated tokens (every view's context)
    dsa_map.DSAMapReducer         -> DSAMapData       selection heat map, read-out of the selected token
    kda_state.KDAStateReducer     -> KDAStateData     state norms per layer and per head of one layer
    experts.ExpertsReducer        -> ExpertsData      expert usage, text vs image, routes, EP rank load
    kda_health.KDAHealthReducer   -> KDAHealthData    heads ranked by how fast they saturate / forget, and where
    dsa_diff.DSADiffReducer       -> DSADiffData      where two traces' DSA reads differ (side-by-side mode only)

Every reducer reads through the public trace API (`workbench.open_trace`), does its maths with
`workbench.analysis`, and returns screen-sized, immutable data; nothing here knows Panel or Bokeh.
The three views after the session map depend only on the trace and the session map's data, so the
follower builds them in parallel threads (one after another on a two-core machine). Adding a view = a reducer here + a component in
`components/` (subclass `ViewComponent`), registered in `VIEW_REDUCERS`.
"""

from apps.dashboard.reducers.base import HeatMap, Reducer, ViewOptions
from apps.dashboard.reducers.dsa_diff import DSADiffData, DSADiffReducer
from apps.dashboard.reducers.dsa_map import DSAMapData, DSAMapReducer
from apps.dashboard.reducers.image_reads import ImageReadsData
from apps.dashboard.reducers.experts import ExpertsData, ExpertsReducer
from apps.dashboard.reducers.kda_health import KDAHealthData, KDAHealthReducer
from apps.dashboard.reducers.kda_state import KDAStateData, KDAStateReducer
from apps.dashboard.reducers.session_map import SessionMapData, SessionMapReducer

# the views built from the session map's data (the frame field each one fills -> its reducer)
# (in this order when they run one after another: cheapest first, so the slowest never delays the others;
# first open of the 1M K3.1 Pro trace on 2 cores, no summaries, reducers alone, best of 5 on a shared machine:
# experts 1.1 s, DSA 1.3 s, KDA 1.6 s (its read of kda_norms serves the health view too: `part_feed`), health 0.35 s)
# each is built with the trace's shared `PartFeeds` (`cls(feeds)`)
VIEW_REDUCERS: dict[str, type[Reducer]] = {"experts": ExpertsReducer, "dsa": DSAMapReducer, "kda": KDAStateReducer,
                                           "health": KDAHealthReducer}

__all__ = ["DSADiffData", "DSADiffReducer", "DSAMapData", "DSAMapReducer", "ExpertsData", "ExpertsReducer", "HeatMap",
           "ImageReadsData", "KDAHealthData", "KDAHealthReducer", "KDAStateData", "KDAStateReducer", "Reducer", "SessionMapData", "SessionMapReducer", "VIEW_REDUCERS", "ViewOptions"]
