"""Numbers a new user meets, on a trace the real engine recorded (builtin:demo, a picture, an answer):

- statistics read the recorded top-k, sink size and DSA layers from the trace; a value that disagrees is
  an InputError (it used to move every chance value silently);
- every Parquet file of the trace describes itself (field descriptions, units, what a row means, that a
  delta table is summed, the bin width), readable by pyarrow and DuckDB.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import workbench
from engine.errors import InputError
from workbench.analysis import (chance_of_hit, cross_layer_jaccard, faithfulness, locality, patch_reads,
                                sink_over_time)
from workbench.trace.schema import TABLES
from workbench.signals import dsa as dsa_signals

POLICY = {"dsa_prefill_stride": 128, "dense_mass_stride": 512, "dense_overlap": True}


@pytest.fixture(scope="module")
def demo_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """builtin:demo on ~1.2K tokens: a document, a picture (the vision tower runs), a question, 8 answer tokens."""
    import torch

    from workbench.sessions import recorded_session

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("numbers") / "demo"
    try:
        with recorded_session("builtin:demo", path, prefill_chunk=256, progress=False, policy=POLICY) as run:
            session = run.session
            session.append(workbench.haystack(900, session.tokenizer, seed=1), name="report")
            session.append(image=workbench.chart_picture(), name="chart.png")
            session.append("Which pier unloaded the most crates?", role="user")
            list(session.generate(8, temperature=0.0))
    finally:
        torch.set_num_threads(before)
    return path


def test_statistics_read_the_recorded_topk(demo_trace: Path) -> None:
    trace = workbench.open_trace(demo_trace)
    topk = trace.settings["topk"]
    assert topk == 64 and trace.settings["dsa_layers"] == [2, 5] and trace.settings["sink_tokens"] == 4
    rows = trace.table("dsa_topk")
    recorded = locality(rows)
    assert recorded.equals(locality(trace.df("dsa_topk"), topk))  # the same value passed explicitly: the same
    visible = rows["position"].to_numpy().astype(np.float64) + 1
    long = visible > topk
    want = float((np.minimum(2 * topk, visible[long]) / visible[long]).mean())
    assert recorded["chance_w2k"].iloc[0] == pytest.approx(want)
    # the README's old example passed 256 on a model that selects 64: refused, naming both
    with pytest.raises(InputError, match=r"topk_k=256 disagrees with the trace.*top-k = 64"):
        locality(rows, topk_k=256)
    timeline, _ = sink_over_time(trace.df("dsa_sink"))
    last = timeline.iloc[-1]
    assert last["chance"] == pytest.approx(chance_of_hit(last["position"] + 1, 4, topk))
    with pytest.raises(InputError, match="topk_k=256"):
        sink_over_time(trace.df("dsa_sink"), 256)
    with pytest.raises(InputError, match="sink_tokens=8"):
        sink_over_time(trace.df("dsa_sink"), sink_tokens=8)
    faith = faithfulness(trace.df("dsa_dense_mass"))
    assert (faith["chance_recall"] <= 1).all() and len(faith) == 2
    with pytest.raises(InputError, match="topk_k=256"):
        faithfulness(trace.df("dsa_dense_mass"), 256)
    assert list(cross_layer_jaccard(rows)[["layer_a", "layer_b"]].iloc[0]) == [2, 5]
    with pytest.raises(InputError, match=r"layers \[1\] are not DSA layers"):
        cross_layer_jaccard(rows, layers=[1, 5])
    image = int(trace.segments().query("kind == 'image'")["id"].iloc[0])
    with pytest.raises(InputError, match=r"patch_reads: layers \[0\] are not DSA layers"):
        patch_reads(rows, trace.tokens(), image, layers=[0])  # a row index or KDA layer counts nothing, silently
    # a frame built by hand carries nothing: the value is required, and named
    with pytest.raises(InputError, match="top-k is unknown: pass topk_k"):
        locality(rows.to_pandas())


def test_every_parquet_file_describes_itself(demo_trace: Path) -> None:
    import duckdb

    files = {"tokens": demo_trace / "tokens.parquet"}
    files.update({name: sorted((demo_trace / name).glob("part-*.parquet"))[0] for name in TABLES
                  if name != "tokens" and (demo_trace / name).is_dir()})
    assert set(files) >= {"tokens", "dsa_topk", "dsa_key_counts", "dsa_sink", "kda_norms", "moe_counts"}
    for name, path in files.items():
        schema = pq.read_schema(path)
        for field in schema:
            assert field.metadata and field.metadata[b"description"], (name, field.name)
            assert b"unit" in field.metadata, (name, field.name)
        meta = {k.decode(): v.decode() for k, v in schema.metadata.items()}
        assert meta["k3wb.table"] == name and meta["k3wb.row"] == TABLES[name].doc
        if TABLES[name].kind == "delta":
            assert "SUM of" in meta["k3wb.read_as"], name
            assert schema.field(TABLES[name].sums[0]).metadata[b"aggregate"].startswith(b"sum")
    counts = pq.read_schema(files["dsa_key_counts"]).metadata
    assert counts[b"k3wb.dsa_bin_tokens"] == b"256" and b"dsa_bin_tokens" in counts[b"k3wb.bin_width"]
    assert pq.read_schema(files["dsa_sink"]).metadata[b"k3wb.sink_tokens"] == b"4"
    assert pq.read_schema(files["moe_counts"]).field("count").metadata[b"unit"].startswith(b"token slots")
    # DuckDB reads the same notes as the file's key-value metadata
    rows = duckdb.sql(f"SELECT key, value FROM parquet_kv_metadata('{files['dsa_key_counts']}')").fetchall()
    kv = {bytes(k).decode(): bytes(v).decode() for k, v in rows}
    assert kv["k3wb.dsa_bin_tokens"] == "256" and "SUM of count" in kv["k3wb.read_as"]
    assert kv["k3wb.column.count"].startswith("selections of keys in the bin") and "[unit: selections" in \
        kv["k3wb.column.count"]
    # and the values still read as before: sum of the deltas per layer
    total = duckdb.sql(f"SELECT layer, sum(count) FROM read_parquet('{demo_trace}/dsa_key_counts/part-*.parquet') "
                       "GROUP BY layer ORDER BY layer").fetchall()
    assert [int(l) for l, _ in total] == [2, 5]


@pytest.fixture(scope="module")
def dashboard(demo_trace: Path):
    """The dashboard's views over the recorded trace (no server), a generated token selected."""
    from apps.dashboard.app import Dashboard, DashboardConfig

    dash = Dashboard(DashboardConfig(trace=demo_trace, root=demo_trace.parent, drive=False))
    frame = dash.state.sync()
    dash.state.position = frame.session.generated[2][0]
    dash.state.sync()
    for view in (dash.session_map, dash.dsa, dash.kda, dash.health, dash.experts):
        view.__panel__()
    yield dash
    dash.close()


def _hover_text(fig, at: tuple[float, float], tmp_path: Path) -> str:
    """The tooltip a pointer at (x, y), as fractions of the plot frame from its top left, shows in Chromium."""
    from bokeh.embed import file_html
    from bokeh.resources import INLINE

    from k3testing.browser import Browser

    page = tmp_path / "figure.html"
    page.write_text(file_html(fig, INLINE, "hover"))
    with Browser() as browser:
        browser.open(page.as_uri(), wait_for="canvas")
        left, top, width, height = browser.page.evaluate(
            "() => { const v = Bokeh.index.roots[0]; const b = v.frame.bbox;"
            " const c = v.canvas_view.el.getBoundingClientRect(); return [c.left + b.left, c.top + b.top, b.width, b.height]; }")
        browser.page.mouse.move(left + width * at[0], top + height * at[1])
        browser.page.wait_for_timeout(300)
        texts = browser.page.evaluate(
            "() => { const out = []; const walk = (n) => { if (n.shadowRoot) walk(n.shadowRoot);"
            " for (const c of n.children || []) walk(c);"
            " if (n.classList && n.classList.contains('bk-tooltip-content')) out.push(n.innerText); };"
            " walk(document.body); return out; }")
        # JS errors only: the standalone page lacks the server's static files (a stylesheet link fails to load)
        errors = [e for e in browser.counters.errors if not e.startswith("console: Failed to load resource")]
        assert errors == [], errors
    return "\n".join(texts)


def test_dsa_map_shows_counts_beside_chance(dashboard, demo_trace: Path) -> None:
    frame = dashboard.state.frame
    trace = workbench.open_trace(demo_trace)
    heat, chance = frame.dsa.heat, frame.dsa.heat_chance
    assert heat.rows == (2, 5)
    want = dsa_signals.heatmap(trace, [2, 5], bins=heat.values.shape[1], end=frame.session.extent, spread=True)
    np.testing.assert_allclose(np.nan_to_num(heat.values), want, rtol=1e-5)  # the counts, not log(1 + count)
    # random top-64 picks of the same queries make as many selections in all as the model made
    assert chance.sum() == pytest.approx(trace.dsa_heatmap(bins=1)[0, 0], rel=1e-6)
    assert dashboard.dsa.heat.source.data["chance"][0].shape == chance.shape


@pytest.mark.skipif(not __import__("k3testing.browser", fromlist=["x"]).chromium_available(),
                    reason="needs Debian's chromium at /usr/bin/chromium")
def test_dsa_map_hover_names_the_layer_its_keys_and_chance(dashboard, tmp_path: Path) -> None:
    frame = dashboard.state.frame
    heat, chance = frame.dsa.heat, frame.dsa.heat_chance
    bins = heat.values.shape[1]
    column = int(bins * 0.3)
    text = _hover_text(dashboard.dsa.heat.figure, ((column + 0.5) / bins, 0.25), tmp_path)  # the top row
    width = (heat.x1 - heat.x0) / bins
    count = heat.values[1, column]
    assert "DSA layer:\t5" in text, text  # the row's layer id (the row index is 1)
    assert f"keys:\t{round(heat.x0 + column * width):,} – {round(heat.x0 + (column + 1) * width):,}" in text, text
    assert f"selections:\t{count:,.0f}" in text or f"selections:\t{count:,.2f}" in text, (text, count)
    shown = f"{chance[column]:.3g}" if chance[column] < 100 else f"{round(chance[column]):,}"
    assert f"chance (random top-k):\t{shown} (observed / chance {count / chance[column]:.1f}x)" in text, text


def test_kda_health_lists_each_head_once(dashboard) -> None:
    ranked = dashboard.state.frame.health.ranked
    heads = [(r["layer"], r["head"]) for r in ranked]
    assert len(heads) == len(set(heads)) == 8  # 4 KDA layers x 2 heads, each once
    assert {r["kind"] for r in ranked} == {"saturates", "forgets"}
    for r in ranked:
        if r["kind"] == "saturates":
            assert not r["saturate_growth_per_1k"] < 0, r  # a climb to the plateau (NaN: on it from the start)
        else:
            assert r["forget_drop"] > 0 or np.isfinite(r["half_life"]), r
    table = dashboard.health.table.object
    saturate, forget = table.split("Forget fastest")
    assert "norm gained /1k tokens to plateau" in saturate and "half-life" not in saturate
    assert "largest fall" in forget and "plateau" not in forget and "−" in forget
    # the session map's triangles have a legend naming both kinds
    from bokeh.models import Legend

    legends = [l for l in dashboard.session_map.figure.right if isinstance(l, Legend)]
    assert legends and legends[0].title == "KDA heads" and legends[0].items


def test_experts_beside_uniform_and_one_rank(dashboard) -> None:
    experts = dashboard.experts
    assert dashboard.state.frame.experts.heat.values.shape[1] == 16
    assert list(experts.uniform_source.data["y"]) == [1 / 16, 1 / 16]
    np.testing.assert_allclose(experts.heat.source.data["chance"][0], np.full(16, 1 / 16))
    assert "ln 16 = 2.77 nats" in experts.routes_note.object, experts.routes_note.object
    # world size 1: no lone red bar, a sentence instead
    assert not experts.load.visible and "1 expert-parallel rank" in experts.load_note.object


def test_image_overlay_has_a_legend_and_a_caption(dashboard) -> None:
    from bokeh.models import ColorBar

    image = dashboard.dsa.image
    assert any(isinstance(c, ColorBar) and c.title == "selections per patch" for c in image.figure.right)
    assert not image.figure.title or not image.figure.title.text  # nothing cut at the figure's width
    assert "chart.png" in image.caption.object and "uncoloured patches: not read" in image.caption.object


def test_kda_state_map_starts_at_position_zero(dashboard) -> None:
    heat = dashboard.state.frame.kda.heat
    assert heat.rows == (0, 1, 3, 4) and np.isfinite(heat.values[:, :4]).all()
