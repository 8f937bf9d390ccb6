"""The view reducers on a real recorded session (tiny preset, `workbench.record`), checked against the
trace's own public readers: each view shows what the trace says, reduced to the screen, nothing else."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import workbench
from workbench.analysis.views import (DSAMapReducer, ExpertsReducer, KDAHealthReducer, KDAStateReducer, RecordingMapReducer,
                                     ViewOptions, part_feed)
from workbench.analysis.views.part_feed import PartFeeds
from apps.dashboard.follower import TraceFollower
from workbench.analysis.views.kda_state import from_the_start
from workbench.analysis import bin_mean, carry_forward, token_reads
from workbench.trace.schema import TABLES, parquet_options
from workbench.signals import dsa as dsa_signals

BINS = 96


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int], object]:
    """A tiny-preset session recorded with the default policy: a document with a planted fact, a question
    and a generated answer. Returns (trace dir, generated positions, model config)."""
    from engine import load_model
    from engine.session import Session
    from engine.tokenizer import Tokenizer

    model = load_model("preset:tiny", seed=0)
    tokenizer = Tokenizer.byte_level()
    session = Session(model, tokenizer, prefill_chunk=64, progress=False)
    doc = workbench.plant("The vault code is 4-7-1-9.", 320, tokenizer, depth=0.4, seed=3)
    path = tmp_path_factory.mktemp("reducers") / "tiny"
    with workbench.record(session, trace=path):
        session.append(doc.text, name="notes.txt")
        session.append(" What is the vault code?", name="question")
        generated = [t.position for t in session.generate(6, temperature=0, stop_ids=())]
    return path, generated, model.config


def _reduce(path: Path, options: ViewOptions):
    trace = workbench.open_trace(path)
    session = RecordingMapReducer().reduce(trace, options)
    return trace, session


def test_session_map(recorded) -> None:
    path, generated, _ = recorded
    trace = workbench.open_trace(path)
    reducer = RecordingMapReducer()
    data = reducer.reduce(trace, ViewOptions(bins=BINS))
    assert data.status == "complete" and data.tokens == trace.session["tokens"] == generated[-1] + 1
    assert [s["kind"] for s in data.segments] == list(trace.segments()["kind"])
    assert [p for p, _ in data.generated] == generated
    pieces = dict(zip(trace.tokens()["position"], trace.tokens()["piece"]))
    assert [piece for _, piece in data.generated] == [pieces[p] for p in generated]
    assert reducer.reduce(trace, ViewOptions(bins=BINS)) is data  # nothing changed: the same object


def test_dsa_map_heat_and_readout(recorded) -> None:
    path, generated, config = recorded
    trace, session = _reduce(path, ViewOptions(bins=BINS))
    reducer = DSAMapReducer()
    data = reducer.reduce(trace, ViewOptions(bins=BINS), session)
    assert data.heat.rows == tuple(config.dsa.layers) and data.heat.values.shape == (len(config.dsa.layers), BINS)
    expected = dsa_signals.heatmap(trace, list(config.dsa.layers), bins=BINS, end=session.extent, spread=True)
    np.testing.assert_allclose(np.nan_to_num(data.heat.values.astype(np.float64)), expected, rtol=1e-5)
    # beside each bin: what random picks of the recorded top-k would select there, as many in all as were read
    # (the stored 256-token bins spread the last one's count past the end of the context: a few % lost there)
    assert data.heat_chance.shape == (BINS,) and data.heat_chance.sum() == pytest.approx(
        trace.dsa_heatmap(bins=1)[0, 0], rel=1e-6)
    assert data.reads is None and data.reads_html == ""
    query = generated[2]
    picked = reducer.reduce(trace, ViewOptions(bins=BINS, position=query), session)
    assert picked.heat is data.heat  # the heat map did not change: not recomputed
    rows = trace.topk_for(query)
    direct = token_reads(query, rows, session.token_text, list(session.segments), BINS, session.extent)
    assert picked.reads["layers"] == direct["layers"] == sorted(config.dsa.layers)
    for got, want, layer_rows in zip(picked.reads["rows"], direct["rows"], sorted(rows.to_pylist(), key=lambda r: r["layer"])):
        assert got["keys"] == want["keys"] == len(layer_rows["selected"]) > 0
        assert 0 <= got["nearest"] <= got["farthest"] <= query
    assert "<table class='k3-reads'>" in picked.reads_html


def test_kda_state_heat_and_heads(recorded) -> None:
    path, _, config = recorded
    trace, session = _reduce(path, ViewOptions(bins=BINS))
    reducer = KDAStateReducer()
    data = reducer.reduce(trace, ViewOptions(bins=BINS), session)
    layers = sorted(config.kda_layers)
    assert data.heat.rows == tuple(layers) and data.head_layer == layers[0]
    for row, layer in enumerate(layers):
        pos, norms = trace.kda_norm_matrix(layer)
        want = from_the_start(carry_forward(bin_mean(pos, norms.mean(axis=1), BINS, session.extent)), pos)
        np.testing.assert_allclose(data.heat.values[row], want, rtol=1e-5, equal_nan=True)
        assert np.isfinite(data.heat.values[row, 0])  # the first 64 positions wrote the first measured state
    other = layers[-1]
    switched = reducer.reduce(trace, ViewOptions(bins=BINS, kda_layer=other), session)
    pos, norms = trace.kda_norm_matrix(other)
    assert switched.head_layer == other and switched.heads.values.shape == (config.kda_num_heads, BINS)
    np.testing.assert_allclose(switched.heads.values, bin_mean(pos, norms, BINS, session.extent), rtol=1e-5,
                               equal_nan=True)
    peak = reducer.reduce(trace, ViewOptions(bins=BINS, kda_layer=other, kda_reduce="max"), session)
    assert np.nanmean(peak.heat.values) >= np.nanmean(data.heat.values)


def test_experts_usage_load_and_routes(recorded) -> None:
    path, generated, config = recorded
    trace, session = _reduce(path, ViewOptions(bins=BINS))
    data = ExpertsReducer().reduce(trace, ViewOptions(bins=BINS, position=generated[1]), session)
    counts = trace.moe_counts_matrix()
    assert data.heat.rows == tuple(trace.layers("moe_counts")) and data.heat.values.shape == counts.shape
    np.testing.assert_allclose(data.heat.values, counts / counts.sum(axis=1, keepdims=True), rtol=1e-6)
    np.testing.assert_array_equal(data.text, trace.moe_counts_matrix("text").sum(axis=0))
    assert data.rank_load.sum() == trace.table("moe_rank_load", columns=["tokens"])["tokens"].to_numpy().sum()
    routes = sorted(trace.routes_for(generated[1]).to_pylist(), key=lambda r: r["layer"])
    assert [r["layer"] for r in data.routes] == [r["layer"] for r in routes] and routes
    assert all(len(r["experts"]) == config.num_experts_per_token for r in data.routes)


def test_follower_builds_the_same_views_view_by_view(recorded) -> None:
    path, generated, _ = recorded
    options = ViewOptions(bins=BINS, position=generated[0])
    follower = TraceFollower(path)
    follower.set_options(bins=BINS, position=generated[0])
    seen = []
    frame = follower.compute(seen.append)
    follower.stop()
    trace, session = _reduce(path, options)
    assert frame.error is None and frame.session.generated == session.generated
    np.testing.assert_array_equal(frame.dsa.heat.values, DSAMapReducer().reduce(trace, options, session).heat.values)
    np.testing.assert_array_equal(frame.kda.heat.values, KDAStateReducer().reduce(trace, options, session).heat.values)
    assert frame.experts.routes == ExpertsReducer().reduce(trace, options, session).routes
    # the session map was handed out before the other views were built
    assert seen and seen[0].session.generated == session.generated and seen[0].dsa.heat is None


def test_read_part_matches_the_table(recorded) -> None:
    path, _, config = recorded
    trace = workbench.open_trace(path)
    parts = [trace.read_part("kda_norms", p, ["layer", "position"]) for p in trace.parts("kda_norms")]
    whole = trace.table("kda_norms", columns=["layer", "position"])
    assert sum(t.num_rows for t in parts) == whole.num_rows > 0
    layer = sorted(config.kda_layers)[1]
    only = [trace.read_part("kda_norms", p, ["layer"], layers=[layer]) for p in trace.parts("kda_norms")]
    assert all(set(t["layer"].to_pylist()) <= {layer} for t in only)
    assert trace.layer_range("kda_norms") == (min(config.kda_layers), max(config.kda_layers))


def test_read_part_leaves_columns_without_values_undecoded(recorded, monkeypatch) -> None:
    """The default policy records no optional KDA statistic: its columns are all null, and decoding them
    cost as much as the norms; `read_part` makes them from the footer instead, with the same result."""
    path, _, _ = recorded
    trace = workbench.open_trace(path)
    columns = ["layer", "position", "norm", "mean_decay", "eff_rank"]
    asked: list[list[str]] = []
    real = pq.ParquetFile.read

    def spy(self, columns=None, **kwargs):
        asked.append(list(columns or []))
        return real(self, columns=columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read", spy)
    parts = [trace.read_part("kda_norms", p, columns) for p in trace.parts("kda_norms")]
    assert len(asked) == len(parts) > 0 and all(a == ["layer", "position", "norm"] for a in asked)
    monkeypatch.undo()
    whole = trace.table("kda_norms", columns=columns)
    assert whole["mean_decay"].null_count == whole.num_rows  # what the footer said
    assert pa.concat_tables(parts).equals(whole)


def test_read_part_decodes_a_column_with_one_value(recorded, tmp_path) -> None:
    """A part whose optional statistic holds a value in a single row is decoded as usual."""
    path, _, _ = recorded
    copy = tmp_path / "copy"
    shutil.copytree(path, copy, ignore=shutil.ignore_patterns("summaries"))
    first = sorted((copy / "kda_norms").glob("part-*.parquet"))[0]
    table = pq.read_table(first)
    heads = len(table["norm"][0])
    decay = pa.array([[0.5] * heads] + [None] * (table.num_rows - 1), table.schema.field("mean_decay").type)
    table = table.set_column(table.schema.get_field_index("mean_decay"), table.schema.field("mean_decay"), decay)
    pq.write_table(table, first, **parquet_options(TABLES["kda_norms"]))
    trace = workbench.open_trace(copy)
    read = trace.read_part("kda_norms", first, ["position", "mean_decay"])
    assert read["mean_decay"].to_pylist() == decay.to_pylist() and not trace.problems


def test_the_kda_views_share_one_conversion_of_each_part(recorded, monkeypatch) -> None:
    """Both KDA views fold every part of kda_norms: its norms become a matrix once, for both, and the
    views show what they show when each reads the parts on its own."""
    path, _, _ = recorded
    monkeypatch.setenv("K3WB_DASHBOARD_CACHE", "off")  # every view folds the parts (no summary restored)
    trace = workbench.open_trace(path)
    options = ViewOptions(bins=BINS)
    session = RecordingMapReducer().reduce(trace, options)
    alone = (KDAStateReducer().reduce(trace, options, session), KDAHealthReducer().reduce(trace, options, session))
    made: list[str] = []
    real = part_feed.list_matrix

    def counting(column):
        made.append(str(column.type))
        return real(column)

    monkeypatch.setattr(part_feed, "list_matrix", counting)
    feeds = PartFeeds()
    state, health = KDAStateReducer(feeds), KDAHealthReducer(feeds)
    shared = (state.reduce(trace, options, session), health.reduce(trace, options, session))
    statistics = 6  # norm and the five optional statistics the health view reads (each once per part)
    assert len(made) == statistics * len(trace.parts("kda_norms"))
    np.testing.assert_array_equal(shared[0].heat.values, alone[0].heat.values)
    np.testing.assert_array_equal(shared[0].heads.values, alone[0].heads.values)
    assert pd.DataFrame(shared[1].ranked).equals(pd.DataFrame(alone[1].ranked))  # NaN where not recorded
    assert shared[1].heads == alone[1].heads > 0 and len(shared[1].ranked) > 0
