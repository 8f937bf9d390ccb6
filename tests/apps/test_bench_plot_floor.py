"""`benchmarks/bench_plot_floor.py` collects the figures a served page shows once every view is shown: the
views' visible Bokeh figures, those of views below the first screen included, each holding the trace's data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from bokeh.models import Plot

from benchmarks.bench_plot_floor import _dashboard_parts


def test_the_floor_page_holds_every_visible_figure_of_the_views_with_data(small_trace: Path) -> None:
    figures, sidebar = _dashboard_parts(small_trace)
    assert figures and all(isinstance(f, Plot) and f.visible for f in figures)
    assert len({id(f) for f in figures}) == len(figures)
    titles = [f.title.text for f in figures if f.title is not None]
    # the first screen's DSA map and the views below it (KDA state, experts) are all there
    for wanted in ("How often each context range was selected", "KDA state norm", "Expert usage"):
        assert any(t.startswith(wanted) for t in titles), (wanted, titles)
    heat = next(f for f in figures if f.title is not None and f.title.text.startswith("KDA state norm"))
    image = heat.renderers[0].data_source.data["image"][0]
    assert np.isfinite(image).any()  # drawn from the trace, not the empty placeholder
    assert sidebar  # the source line and drive mode's controls
