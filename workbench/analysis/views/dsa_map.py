"""Reducer of view 2, the DSA memory map: the selection heat map and the read-out of the selected token.

- heat: selections per DSA layer and screen bin (the view colours them on a log scale), from the
  trace's running sums of `dsa_key_counts` (costs only the parts added since the last poll; a finished
  trace's sums come from the summary cache); bins past the furthest one ever read are NaN ("not reached
  yet", not "never read");
- chance: per screen bin, the selections uniformly random top-k picks of the same queries would make
  (`expected_key_selections` over the queries `dsa_sink` counts, with the recorded top-k), shown beside
  each bin's count;
- read-out of the selected position: `workbench.analysis.token_reads` on `trace.topk_for(position)`,
  as HTML;
- image: the picture of an image segment and what each layer read per merged patch, for the selected
  token and over the answer (`image_reads.ImageReadsReducer`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench.analysis import expected_key_selections, queries_per_position, token_reads
from workbench.signals import dsa as dsa_signals
from workbench.trace import Trace

from workbench.analysis.views.readout import reads_html
from workbench.analysis.views.base import CachedSums, HeatMap, Reducer, ViewOptions
from workbench.analysis.views.image_reads_view import ImageReadsData, ImageReadsReducer
from workbench.analysis.views.part_feed import PartFeeds
from workbench.analysis.views.session_map import RecordingMapData


@dataclass(frozen=True, eq=False)
class DSAMapData:
    heat: HeatMap | None = None
    heat_chance: np.ndarray | None = None  # float64 [bins]: selections random picks would make (None: unknown)
    reads: dict | None = None  # `token_reads` of the selected position (None: nothing selected)
    reads_html: str = ""
    image: ImageReadsData | None = None  # picture + patch reads of an image segment (None: no image)


def dsa_heat(trace: Trace, extent: int, bins: int) -> HeatMap:
    """Selections per DSA layer over [0, extent) in `bins` screen bins; unreached bins NaN. The stored
    bins' counts are spread over finer screen bins (`Trace.dsa_heatmap` never splits them)."""
    layers = trace.layers("dsa_key_counts")
    heat = dsa_signals.heatmap(trace, layers, bins=bins, end=extent, spread=True) if layers else np.zeros((0, bins))
    values = heat.astype(np.float32)
    read = np.flatnonzero(heat.sum(axis=0) > 0)
    values[:, (read[-1] + 1 if len(read) else 0):] = np.nan
    return HeatMap(tuple(layers), values, 0.0, float(extent))


def heat_chance(trace: Trace, extent: int, bins: int) -> np.ndarray | None:
    """Selections per bin of [0, extent) that uniformly random picks of the recorded top-k would make for the
    queries the trace counted; None without a recorded top-k."""
    topk = trace.settings.get("topk")
    if not topk or extent <= 0:
        return None
    queries = queries_per_position(trace.table("dsa_sink", columns=["layer", "rank", "position", "queries"]), extent)
    return expected_key_selections(queries, topk, np.linspace(0, extent, bins + 1))


def read_out(trace: Trace, position: int, session: RecordingMapData, bins: int) -> tuple[dict, str]:
    """(token_reads, its HTML) of the query at `position`."""
    rows = trace.topk_for(position)
    reads = token_reads(position, rows, session.token_text, list(session.segments), bins, session.extent,
                        marks=session.marks)
    return reads, reads_html(reads, session.token_text)


class DSAMapReducer(Reducer[DSAMapData]):
    data_type = DSAMapData

    def __init__(self, feeds: PartFeeds | None = None) -> None:
        super().__init__(feeds)
        self.images = ImageReadsReducer()
        self.sums = CachedSums("dsa_key_counts")

    def reduce(self, trace: Trace, options: ViewOptions, session: RecordingMapData) -> DSAMapData:
        self.sums.before(trace)
        heat = self.memo("heat", (len(trace.parts("dsa_key_counts")), session.extent, options.bins),
                         lambda: dsa_heat(trace, session.extent, options.bins))
        self.sums.after(trace)
        chance = self.memo("chance", (len(trace.parts("dsa_sink")), session.extent, options.bins),
                           lambda: heat_chance(trace, session.extent, options.bins))
        image = self.images.reduce(trace, options, session)
        if options.position is None:
            return self.result(heat=heat, heat_chance=chance, reads=None, reads_html="", image=image)
        deps = (options.position, len(trace.parts("dsa_topk")), session.extent, options.bins, len(session.token_text))
        reads, html = self.memo("reads", deps, lambda: read_out(trace, options.position, session,
                                                                          options.bins))
        return self.result(heat=heat, heat_chance=chance, reads=reads, reads_html=html, image=image)
