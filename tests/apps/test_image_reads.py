"""The DSA map's image panel on a real recorded tiny-preset image session: the thumbnail at screen size,
per-patch reads of each DSA layer for a clicked token and over the answer, beside chance (no browser)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import workbench
from workbench.analysis import patch_reads

from apps.dashboard.components.dsa_map import DSAMemoryMap
from apps.dashboard.components.image_reads import ALL_LAYERS, ANSWER, TOKEN
from workbench.analysis.views.image_reads_view import SCREEN_SIDE
from apps.dashboard.follower import DashboardState


def _image_segment(trace) -> dict:
    return next(s for s in trace.session["segments"] if s["kind"] == "image")


def test_reducer_reads_the_real_trace(image_trace: Path) -> None:
    trace = workbench.open_trace(image_trace)
    seg = _image_segment(trace)
    state = DashboardState(image_trace)
    frame = state.sync()
    image = frame.dsa.image
    assert image is not None and image.image_id == seg["id"] and image.problem == ""
    assert image.grid == (seg["image"]["grid_rows"], seg["image"]["grid_cols"])
    # the thumbnail at screen size, never the source pixels
    assert image.picture is not None and max(image.picture.shape) <= SCREEN_SIDE
    assert image.answer is not None and image.answer.layers == (2, 5)  # tiny: DSA layers 2 and 5
    gen = [s for s in seg_list(trace) if s["kind"] == "generated"][-1]
    assert image.answer_range[0] == gen["start"]
    # image tokens: one row per merged patch, all selected keys inside the image counted
    tokens = trace.tokens()
    img_tok = tokens[tokens["modality"].astype(str) == "image"]
    assert len(img_tok) == image.grid[0] * image.grid[1]
    topk = trace.table("dsa_topk", positions=image.answer_range).to_pandas()
    in_image = set(img_tok["position"].tolist())
    direct = sum(int(np.isin(np.asarray(sel), list(in_image)).sum()) for sel in topk["selected"])
    assert image.answer.summary()["selections"] == direct
    s = image.answer.summary()
    assert s["patches"] == len(img_tok) and 0 < s["chance_patches"] <= s["patches"]
    # a clicked token: that query's rows only
    position = frame.session.generated[2][0]
    state.position = position
    image = state.sync().dsa.image
    assert image.token_position == position
    one = patch_reads(trace.topk_for(position), tokens, seg["id"], image.grid)
    assert np.array_equal(image.token.counts, one.counts) and image.token.queries.tolist() == [1, 1]
    state.close()


def seg_list(trace) -> list[dict]:
    return trace.session["segments"]


def test_component_layer_and_scope(image_trace: Path) -> None:
    state = DashboardState(image_trace)
    state.sync()
    view = DSAMemoryMap(state=state)
    view.redraw()
    panel = view.image
    assert view.image_card.visible and panel.scope == ANSWER
    assert panel.param.layer.objects == [ALL_LAYERS, "layer 2", "layer 5"]
    assert panel.summary.object.count("patches read:") == 1 and ", chance " in panel.summary.object
    assert "<table class='k3-image-layers'>" in panel.layers_table.object
    picture = panel.picture_source.data["image"][0]
    assert picture.dtype == np.uint32 and max(picture.shape) <= SCREEN_SIDE
    total = np.nansum(panel.heat_source.data["image"][0])
    panel.layer = "layer 5"
    layer5 = np.nansum(panel.heat_source.data["image"][0])
    assert "DSA layer 5" in panel.summary.object and layer5 <= total
    assert layer5 == panel.data.answer.grid_of(5).sum()
    # clicking a generated token switches the panel to that token's reads
    position = state.frame.session.generated[1][0]
    state.position = position
    state.sync()
    assert panel.scope == TOKEN and f"position {position}" in panel.summary.object
    panel.scope = ANSWER
    assert "answer, queries" in panel.summary.object
    state.close()


@pytest.mark.parametrize("thumbnail, problem", [
    ("../outside.png", "relative path inside"),
    ("/etc/passwd", "relative path inside"),
    ("images/missing.png", "file missing"),
    ("images", "not a regular file"),
    ("images/fake.png", "unreadable PNG"),
])
def test_bad_thumbnail_is_a_problem_line_not_a_crash(image_trace: Path, tmp_path: Path, thumbnail: str,
                                                     problem: str) -> None:
    copy = tmp_path / "trace"
    shutil.copytree(image_trace, copy)
    (copy / "images" / "fake.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    meta = json.loads((copy / "session.json").read_text())
    for seg in meta["segments"]:
        if seg["kind"] == "image":
            seg["thumbnail"] = thumbnail
    (copy / "session.json").write_text(json.dumps(meta))
    state = DashboardState(copy)
    image = state.sync().dsa.image
    assert image is not None and image.picture is None and problem in image.problem
    assert image.answer is not None  # the reads are still shown
    view = DSAMemoryMap(state=state)
    view.redraw()
    assert "picture not shown" in view.image.summary.object
    state.close()


def test_experts_view_counts_real_image_tokens(image_trace: Path) -> None:
    from apps.dashboard.components.experts import ExpertsView

    trace = workbench.open_trace(image_trace)
    seg = _image_segment(trace)
    n_image = seg["image"]["token_end"] - seg["image"]["token_start"]
    moe_layers = len(trace.layers("moe_counts"))
    top_k = trace.session["model"]["num_experts_per_tok"] if "num_experts_per_tok" in trace.session.get("model", {}) \
        else None
    state = DashboardState(image_trace)
    frame = state.sync()
    assert frame.experts.text.sum() > 0 and frame.experts.image.sum() > 0
    view = ExpertsView(state=state)
    view.redraw()
    view.modality = "image"
    view.segment = f"{seg['id']}: {seg['name']}"
    data = state.sync().experts
    slots = int(data.image.sum())
    assert slots % (n_image * moe_layers) == 0 and slots > 0  # every image token routed in every MoE layer
    if top_k is not None:
        assert slots == n_image * moe_layers * top_k
    bars = view.bars_source.data
    assert abs(float(np.sum(bars["image"])) - 1.0) < 1e-6 and abs(float(np.sum(bars["text"])) - 1.0) < 1e-6
    state.close()


def test_a_resumed_snapshot_still_shows_the_picture(tmp_path: Path) -> None:
    """`run --image --save`, then `run --load --trace`: the resumed trace has no pixels to draw from,
    the snapshot's thumbnail is what the DSA map shows."""
    from apps.cli import main

    workbench.chart_picture().save(tmp_path / "chart.png")
    snap, trace = tmp_path / "snap", tmp_path / "resumed"
    assert main(["run", "--model", "preset:tiny", "--image", str(tmp_path / "chart.png"), "--prompt",
                 "Which pier unloaded the most crates?", "--chat", "--max-new-tokens", "2", "--temperature", "0",
                 "--save", str(snap)]) == 0
    (tmp_path / "chart.png").unlink()  # resuming needs no pixels
    assert main(["run", "--model", "preset:tiny", "--load", str(snap), "--prompt", "And the least?", "--chat",
                 "--max-new-tokens", "3", "--temperature", "0", "--trace", str(trace)]) == 0
    seg = _image_segment(workbench.open_trace(trace))
    assert seg["thumbnail"] == f"images/{seg['id']}.png"
    state = DashboardState(trace)
    image = state.sync().dsa.image
    assert image is not None and image.image_id == seg["id"] and image.problem == ""
    assert image.picture is not None and max(image.picture.shape) <= SCREEN_SIDE
    state.close()


def test_answer_reads_come_back_from_the_summary_cache_equal(image_trace: Path, tmp_path: Path,
                                                              monkeypatch) -> None:
    from workbench.analysis.views import shared_reducers
    from workbench.analysis.views.image_reads_view import patch_reads_from_json, patch_reads_json

    def answer():  # a fresh server's first reduce of the trace: nothing shared, only the disk cache
        shared_reducers.forget_all()
        state = DashboardState(image_trace)
        try:
            return state.sync().dsa.image.answer
        finally:
            state.close()
            shared_reducers.forget_all()

    monkeypatch.setenv("K3WB_DASHBOARD_CACHE", str(tmp_path / "cache"))
    cold = answer()
    files = list((tmp_path / "cache").rglob("*.image_answer_reads.json"))
    assert len(files) == 1
    calls = []
    monkeypatch.setattr("workbench.analysis.views.image_reads_view.patch_reads",
                        lambda *a, **k: calls.append(1) or patch_reads(*a, **k))
    warm = answer()
    assert calls == []  # answered from the cache, no top-k rows read
    for name in ("counts", "queries", "picks", "expected", "log_miss"):
        np.testing.assert_array_equal(getattr(warm, name), getattr(cold, name))
    assert warm.layers == cold.layers and warm.summary() == cold.summary()
    # a damaged or foreign cache entry is recomputed, never trusted
    good = json.loads(files[0].read_text())
    for bad in ({**good, "counts": good["counts"][:-1]}, {**good, "grid": [1, 1]}, {**good, "layers": ["x"]},
                {**good, "log_miss": "nan"}, [], None):
        assert patch_reads_from_json(bad, cold.image_id, cold.grid) is None
    assert patch_reads_from_json(patch_reads_json(cold), cold.image_id, cold.grid) is not None
    files[0].write_text("{not json")
    again = answer()
    assert calls and again.summary() == cold.summary()
