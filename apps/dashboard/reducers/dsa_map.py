"""Reducer of view 2, the DSA memory map: the selection heat map and the read-out of the selected token.

- heat: log(1 + selections) per DSA layer and screen bin, from the trace's running sums of
  `dsa_key_counts` (costs only the parts added since the last poll; a finished trace's sums come
  from the summary cache); bins past the furthest one ever read are NaN ("not reached yet", not
  "never read");
- read-out of the selected position: `workbench.analysis.token_reads` on `trace.topk_for(position)`,
  as HTML;
- image: the picture of an image segment and what each layer read per merged patch, for the selected
  token and over the answer (`image_reads.ImageReadsReducer`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench.analysis import token_reads
from workbench.trace import Trace

from apps.dashboard.readout import reads_html
from apps.dashboard.reducers.base import CachedSums, HeatMap, Reducer, ViewOptions
from apps.dashboard.reducers.image_reads import ImageReadsData, ImageReadsReducer
from apps.dashboard.reducers.part_feed import PartFeeds
from apps.dashboard.reducers.session_map import SessionMapData


@dataclass(frozen=True, eq=False)
class DSAMapData:
    heat: HeatMap | None = None
    reads: dict | None = None  # `token_reads` of the selected position (None: nothing selected)
    reads_html: str = ""
    image: ImageReadsData | None = None  # picture + patch reads of an image segment (None: no image)


def dsa_heat(trace: Trace, extent: int, bins: int) -> HeatMap:
    """log(1 + selections) per DSA layer over [0, extent) in `bins` bins; unreached bins NaN."""
    layers = trace.layers("dsa_key_counts")
    heat = trace.dsa_heatmap(layers, bins=bins, end=extent) if layers else np.zeros((0, bins))
    values = np.log1p(heat).astype(np.float32)
    read = np.flatnonzero(heat.sum(axis=0) > 0)
    values[:, (read[-1] + 1 if len(read) else 0):] = np.nan
    return HeatMap(tuple(layers), values, 0.0, float(extent))


def read_out(trace: Trace, position: int, session: SessionMapData, bins: int) -> tuple[dict, str]:
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

    def reduce(self, trace: Trace, options: ViewOptions, session: SessionMapData) -> DSAMapData:
        self.sums.before(trace)
        heat = self.memo("heat", (len(trace.parts("dsa_key_counts")), session.extent, options.bins),
                         lambda: dsa_heat(trace, session.extent, options.bins))
        self.sums.after(trace)
        image = self.images.reduce(trace, options, session)
        if options.position is None:
            return self.result(heat=heat, reads=None, reads_html="", image=image)
        deps = (options.position, len(trace.parts("dsa_topk")), session.extent, options.bins, len(session.token_text))
        reads, html = self.memo("reads", deps, lambda: read_out(trace, options.position, session,
                                                                          options.bins))
        return self.result(heat=heat, reads=reads, reads_html=html, image=image)
