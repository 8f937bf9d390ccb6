"""Issue 42 item 16: what the views showed a first-time user that was wrong or unreadable.

- "Generated text" shows the chat's structure (`<|close|>response<|sep|><|end_of_msg|>`) as small
  marks, not raw tags;
- the status line of a multi-turn conversation counts the whole conversation, not the last turn;
- a near-uniform heat map gets a colour scale of at least a decade (not 8.7280-8.7288), a view's own
  fixed scale stays;
- the text-vs-image legend sits above the bars, not over them;
- the what-if difference plot is not drawn, empty and black, before a rerun, and its title fits;
- `trace.dsa_heatmap(bins=...)` is labelled (layers, edges), never finer than the recording's bins,
  and carries the DSA map's chance row and observed / chance ratio.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import workbench
from apps.dashboard.components.figures import HeatFigure, colour_range
from apps.dashboard.components.session_map import progress_text
from apps.dashboard.components.token_strip import strip_tokens
from k3testing.synthetic import Dims, Policy, write_synthetic_trace
from workbench.analysis.views import HeatMap, RecordingMapData
from workbench.analysis.views.dsa_map import dsa_heat, heat_chance


def test_chat_structure_in_generated_text_is_marked_not_shown_raw() -> None:
    pieces = ["The", " code", " is", " 42", "<|close|>", "response", "<|sep|>", "<|end_of_msg|>", "[EOS]"]
    rows = strip_tokens(list(enumerate(pieces)))
    assert [r[2] for r in rows] == [False] * 4 + [True] * 5
    assert [r[:2] for r in rows] == [[i, p] for i, p in enumerate(pieces)]  # every token still there, clickable
    # text that only looks like a tag is text
    assert strip_tokens([(0, "a <|b"), (1, "<script>")]) == [[0, "a <|b", False], [1, "<script>", False]]
    # an opening tag's name is structure; the answer after its <|sep|> is text
    rows = strip_tokens([(0, "<|open|>"), (1, "response"), (2, "<|sep|>"), (3, "yes")])
    assert [r[2] for r in rows] == [True, True, True, False]


def test_status_line_counts_the_whole_conversation() -> None:
    """The issue's case: a 9,090-token three-turn chat whose last turn prefilled 142 tokens and generated 96."""
    segments = ({"kind": "turn", "name": "user", "start": 0, "end": 4000},
                {"kind": "generated", "name": "answer", "start": 4000, "end": 4200},
                {"kind": "turn", "name": "user", "start": 4200, "end": 8700},
                {"kind": "generated", "name": "answer", "start": 8700, "end": 8852},
                {"kind": "turn", "name": "user", "start": 8852, "end": 8994},
                {"kind": "generated", "name": "answer", "start": 8994, "end": 9090})
    snap = RecordingMapData(status="complete", tokens=9090, segments=segments,
                            progress={"phase": "decode", "done": 142, "total": 142, "generated": 96,
                                      "tokens_per_s": 4.0})
    line = progress_text(snap)
    assert "3 turns, 9,090 tokens in context" in line and "turn 3: 96 tokens generated" in line, line
    # a transcript replayed (earlier answers are assistant messages, the last one generated)
    replayed = ({"kind": "turn", "name": "message 0 (user)", "start": 0, "end": 50},
                {"kind": "turn", "name": "message 1 (assistant)", "start": 50, "end": 90},
                {"kind": "turn", "name": "message 2 (user)", "start": 90, "end": 140},
                {"kind": "generated", "name": "answer", "start": 140, "end": 150})
    snap = RecordingMapData(status="recording", tokens=150, segments=replayed,
                            progress={"phase": "decode", "done": 140, "total": 140, "generated": 10})
    assert "2 turns, 150 tokens in context" in progress_text(snap)
    # one turn: as before, nothing added
    single = ({"kind": "turn", "name": "prompt", "start": 0, "end": 119},
              {"kind": "generated", "name": "answer", "start": 119, "end": 126})
    one = RecordingMapData(status="recording", tokens=126, segments=single,
                           progress={"phase": "decode", "done": 119, "total": 119, "generated": 7})
    assert "conversation" not in progress_text(one)
    # a later turn's prefill: this turn's tokens and the whole context
    snap = RecordingMapData(status="recording", tokens=9000, segments=segments[:5],
                            progress={"phase": "prefill", "done": 100, "total": 142})
    assert "prefill: 100 / 142 tokens" in progress_text(snap) and "9,000 tokens in context" in progress_text(snap)


def test_a_near_uniform_heat_map_gets_a_readable_colour_scale() -> None:
    values = np.full((2, 300), 8.7284, np.float32)
    values[0, 3] = 8.7288
    values[1, 7] = 8.7280
    scale = colour_range(values, log_scale=True)
    assert scale["high"] >= 10 * scale["low"] and scale["low"] > 0, scale  # at least a decade
    heat = HeatFigure("t", "x", "y", "v", log_scale=True)
    heat.update(HeatMap((2, 5), values, 0.0, 212.0))
    assert heat.mapper.high / heat.mapper.low >= 10
    # a linear map of one value: from zero to it, not a zero-width range
    assert colour_range(np.full((1, 4), 3.0), log_scale=False) == {"low": 0.0, "high": 3.0}
    # a view's own fixed scale (the share maps: 0..1) is left as it set it
    fixed = HeatFigure("t", "x", "y", "share")
    fixed.mapper.update(low=0.0, high=1.0)
    fixed.update(HeatMap((1,), np.full((1, 8), 0.25, np.float32), 0.0, 8.0))
    assert (fixed.mapper.low, fixed.mapper.high) == (0.0, 1.0)
    # nothing to show yet is transparent (NaN), not zeros painted in the palette's darkest colour
    assert np.isnan(HeatFigure("t", "x", "y", "v").source.data["image"][0]).all()


def test_the_legend_of_the_expert_bars_is_above_them() -> None:
    from bokeh.models import Legend

    from apps.dashboard.components.experts import ExpertsView
    from apps.dashboard.follower import DashboardState

    view = ExpertsView(state=DashboardState(None))
    for fig in (view.bars, view.load):
        assert not [c for c in fig.center if isinstance(c, Legend)]
        assert [a for a in fig.above if isinstance(a, Legend)]


def test_the_what_if_difference_plot_waits_for_a_rerun() -> None:
    from apps.dashboard.what_if import WhatIfPanel

    panel = WhatIfPanel(lambda: (None, None), threading.Lock())
    assert panel.diff_heat.figure.visible is False
    assert len(panel.diff_heat.figure.title.text) <= 40  # the column is about 340 px wide: a long title was cut


@pytest.fixture(scope="module")
def short_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    policy = Policy(prefill_chunk=512, dsa_prefill_stride=64, dense_mass_stride=512, moe_window_every=1024,
                    decode_tokens=64, decode_flush_every=16)
    return write_synthetic_trace(tmp_path_factory.mktemp("heat") / "t", 1024, Dims.demo(), policy)


def test_dsa_heatmap_is_labelled_never_finer_than_recorded_and_beside_chance(short_trace: Path) -> None:
    trace = workbench.open_trace(short_trace)
    width = int(trace.policy["dsa_bin_tokens"])
    stored = -(-int(trace.session["tokens"]) // width)
    heat = trace.dsa_heatmap(bins=512)
    # never finer than the recording: one column per stored bin, whole counts
    assert heat.shape == (len(trace.layers("dsa_key_counts")), stored) and stored < 512
    assert np.array_equal(np.asarray(heat), np.round(heat))
    assert heat.layers == tuple(trace.layers("dsa_key_counts")) and heat.bin_tokens == width
    assert heat.edges[0] == 0 and len(heat.edges) == stored + 1
    # the same numbers as the DSA map at the same columns: counts and the chance row beside them
    extent = int(heat.edges[-1])
    view = dsa_heat(trace, extent, stored)
    np.testing.assert_allclose(np.nan_to_num(view.values), heat, rtol=1e-5)
    np.testing.assert_allclose(heat.chance, heat_chance(trace, extent, stored), rtol=1e-9)
    assert (heat.chance > 0).all()
    np.testing.assert_allclose(heat.ratio, np.asarray(heat) / heat.chance)
    frame = heat.to_frame()
    assert list(frame.columns) == ["layer", "start", "end", "count", "chance", "ratio"]
    assert len(frame) == heat.size and frame["count"].sum() == pytest.approx(float(np.asarray(heat).sum()))
    # code written for the plain array still works; derived arrays carry no labels that might not fit
    assert heat.sum(axis=0).shape == (stored,) and heat[0].layers is None
    coarse = trace.dsa_heatmap(bins=2)
    assert coarse.shape[1] == 2 and coarse.sum() == pytest.approx(float(np.asarray(heat).sum()))


@pytest.mark.parametrize("kwargs, named", [
    ({"bins": 0}, "bins"), ({"bins": -1}, "bins"), ({"bins": 2.5}, "bins"), ({"bins": True}, "bins"),
    ({"bins": 10 ** 12}, "bins"), ({"start": -5}, "start"), ({"start": 10, "end": 5}, "end"),
    ({"end": 10 ** 15}, "end"), ({"start": 2 ** 40}, "start")])
def test_dsa_heatmap_refuses_a_bad_request_in_one_line(short_trace: Path, kwargs: dict, named: str) -> None:
    from workbench.trace.errors import TraceError

    with pytest.raises(TraceError, match=f"dsa_heatmap: {named} must be") as caught:
        workbench.open_trace(short_trace).dsa_heatmap(**kwargs)
    assert "\n" not in str(caught.value)


def test_a_heatmap_over_the_largest_range_costs_no_more_than_the_recording(short_trace: Path) -> None:
    """The chance row counts queries up to the last recorded one: an end of 2^31 allocates nothing that large."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    heat = workbench.open_trace(short_trace).dsa_heatmap(bins=64, end=2 ** 31 - 1)
    assert heat.shape[1] == 64 and heat.chance is not None and heat.chance[1:].sum() == 0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024  # KiB
