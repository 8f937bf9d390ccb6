"""Writer -> reader round trips: accepted input shapes, padding and ordering rules, delta coalescing,
session updates, token compaction, derived matrices, bounded buffers."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from workbench.trace import TABLES, TraceError, TraceWriter, open_trace
from workbench.trace.schema import SCHEMA_VERSION, describe

SEGMENTS = [{"id": 0, "kind": "document", "name": "doc", "start": 0, "end": 90, "modality": "text"},
            {"id": 1, "kind": "image", "name": "img", "start": 90, "end": 94, "modality": "image",
             "image": {"width": 56, "height": 56, "grid_rows": 2, "grid_cols": 2}},
            {"id": 2, "kind": "turn", "name": "q", "start": 94, "end": 100, "modality": "text"}]


def _writer(tmp_path, **kw) -> TraceWriter:
    return TraceWriter.create(tmp_path / "t", {"policy": {"dsa_bin_tokens": 16}, "segments": SEGMENTS,
                                               "model": {"summary": {"num_experts": 8}}}, fsync=False, **kw)


def _tokens(w: TraceWriter, lo: int, hi: int) -> None:
    pos = np.arange(lo, hi)
    img = (pos >= 90) & (pos < 94)
    w.append("tokens", position=pos, token_id=pos * 3, piece=[f"t{p}" for p in pos],
             segment=np.where(img, 1, np.where(pos < 90, 0, 2)), modality=np.where(img, "image", "text"),
             image_id=np.where(img, 1, -1), patch_row=np.where(img, (pos - 90) // 2, -1),
             patch_col=np.where(img, (pos - 90) % 2, -1))


def test_schema_is_data_with_docs():
    for spec in TABLES.values():
        assert spec.doc and all(c.doc and isinstance(c.type, pa.DataType) for c in spec.columns)
        if spec.name != "tokens":
            assert spec.names[:3] == ["layer", "step", "rank"]
        if spec.kind == "delta":
            assert spec.sums and "step" in spec.maxes
    assert f"version {SCHEMA_VERSION}" in describe()


def test_roundtrip_all_input_shapes(tmp_path):
    w = _writer(tmp_path)
    _tokens(w, 0, 100)
    # 2-D selections, descending and padded with -1: stored ascending, padding dropped, scores follow
    sel = np.array([[9, 5, 1, -1], [7, 3, 2, 0]])
    scores = np.array([[0.9, 0.5, 0.1, 0.0], [0.7, 0.3, 0.2, 0.0]], np.float32)
    w.append("dsa_topk", layer=3, step=0, rank=0, position=[10, 11], selected=sel, scores=scores)
    # ragged lists and a mapping, scores omitted (nullable)
    w.append("dsa_topk", {"layer": 7, "step": 1, "rank": 0, "position": [12], "selected": [np.array([0, 4, 12])]})
    w.append("kda_norms", layer=0, step=0, rank=0, position=[63, 99], norm=np.array([[1, 2], [3, 4]]),
             mean_decay=np.full((2, 2), 0.5))
    w.append("moe_routes", layer=1, step=0, rank=0, position=[5], experts=[[3, -1, 6]], weights=[[0.6, 0.0, 0.4]],
             entropy=[1.5])
    assert w.flush()["dsa_topk"] == 3
    t = open_trace(tmp_path / "t")
    assert t.problems == [] and t.status == "recording" and t.session["tokens"] == 100
    topk = t.table("dsa_topk")
    assert topk["selected"].to_pylist() == [[1, 5, 9], [0, 2, 3, 7], [0, 4, 12]]
    assert np.allclose(topk["scores"][0].as_py(), [0.1, 0.5, 0.9]) and topk["scores"][2].as_py() is None
    assert t.table("moe_routes")["experts"].to_pylist() == [[3, 6]]
    assert t.table("moe_routes")["weights"].type == pa.list_(pa.float16())
    tok = t.tokens()
    assert len(tok) == 100 and tok.loc[91, "patch_col"] == 1 and np.isnan(tok.loc[5, "image_id"])
    assert set(tok["modality"]) == {"text", "image"}
    positions, norms = t.kda_norm_matrix(0)
    assert positions.tolist() == [63, 99] and norms.tolist() == [[1, 2], [3, 4]]
    assert t.kda_norm_matrix(0, "mean_decay")[1].tolist() == [[0.5, 0.5], [0.5, 0.5]]
    assert t.table("dsa_topk", layers=[7])["position"].to_pylist() == [12]
    assert t.table("dsa_topk", layers=[]).num_rows == 0
    assert t.table("tokens", columns=["piece"], positions=(90, 92))["piece"].to_pylist() == ["t90", "t91", "t92"]
    with pytest.raises(TraceError, match="no step column"):
        t.table("tokens", steps=(0, 1))
    assert t.topk_for(11)["selected"].to_pylist() == [[0, 2, 3, 7]]
    assert len(t.df("dsa_topk", columns=["layer", "position"]).columns) == 2
    seg = t.segments()
    assert seg["tokens"].tolist() == [90, 4, 6] and seg.loc[1, "image_grid_cols"] == 2
    w.close()


def test_append_takes_arrow_tables_and_dataframes(tmp_path):
    w = _writer(tmp_path)
    _tokens(w, 0, 100)
    w.flush()
    tokens = open_trace(tmp_path / "t").table("tokens")
    w2 = TraceWriter.create(tmp_path / "u", {}, fsync=False)
    w2.append("tokens", tokens)
    w2.append("tokens", tokens.to_pandas().assign(position=lambda d: d.position + 100, image_id=-1, patch_row=-1,
                                                   patch_col=-1))
    w2.close()
    back = open_trace(tmp_path / "u").table("tokens")
    assert back.slice(0, 100).equals(tokens) and back["position"].to_pylist() == list(range(200))
    assert back["image_id"].null_count == 196 and back["modality"].to_pylist()[100:] == tokens["modality"].to_pylist()
    w.close()


def test_bad_appends_fail_at_the_call_site(tmp_path):
    w = _writer(tmp_path)
    with pytest.raises(TraceError, match="unknown trace table"):
        w.append("nope", layer=1)
    with pytest.raises(TraceError, match="no column"):
        w.append("dsa_sink", layer=1, step=0, rank=0, position=1, queries=1, sink_hits=1, bogus=2)
    with pytest.raises(TraceError, match="required"):
        w.append("dsa_sink", layer=1, step=0, rank=0, queries=1, sink_hits=1)
    with pytest.raises(TraceError, match="different lengths"):
        w.append("dsa_dense_mass", layer=1, step=0, rank=0, position=[1, 2], mass=[0.5])
    with pytest.raises(TraceError, match="value 70000 does not fit int16"):
        w.append("moe_rank_load", layer=70000, step=0, rank=0, ep_rank=0, tokens=1)
    with pytest.raises(TraceError, match=r"values \[0, 40000\] do not fit int16"):
        w.append("moe_rank_load", layer=[0, 40000], step=0, rank=0, ep_rank=0, tokens=1)
    with pytest.raises(TraceError, match="expected integers"):
        w.append("dsa_dense_mass", layer=1, step=0, rank=0, position=[1.5], mass=[0.5])
    with pytest.raises(TraceError, match="modality"):
        w.append("moe_counts", layer=1, step=0, rank=0, segment=0, modality="audio", expert=1, count=1)
    with pytest.raises(TraceError, match="lengths differ"):
        w.append("moe_routes", layer=1, step=0, rank=0, position=[1], experts=[[1, 2]], weights=[[1.0]], entropy=[0])
    with pytest.raises(TraceError, match="managed by the writer"):
        w.update_session(status="complete")
    with pytest.raises(TraceError, match="kind"):
        w.update_session(segments=[{"id": 0, "kind": "video", "start": 0, "end": 1}])
    with pytest.raises(TraceError, match="JSON"):
        w.update_session(engine={"bad": object()})
    w.close()
    with pytest.raises(TraceError, match="closed"):
        w.append("dsa_sink", layer=1, step=0, rank=0, position=1, queries=1, sink_hits=1)


def test_deltas_coalesce_and_sum(tmp_path):
    w = _writer(tmp_path)
    for step in range(4):
        w.append("dsa_key_counts", layer=3, step=step, rank=0, key_bin=[0, 2], count=[1, 10])
        w.append("dsa_key_counts", layer=7, step=step, rank=0, key_bin=[5], count=[2])
        w.append("moe_counts", layer=1, step=step, rank=0, segment=[0, 1], modality=["text", "image"], expert=[2, 2],
                 count=[3, 4])
    w.flush()
    w.append("dsa_key_counts", layer=3, step=9, rank=0, key_bin=[0], count=[5])
    w.flush()
    t = open_trace(tmp_path / "t")
    first = t.table("dsa_key_counts").slice(0, 3)
    # one flush = one row per key, step = the last step it covers
    assert first.to_pydict() == {"layer": [3, 3, 7], "step": [3, 3, 3], "rank": [0, 0, 0], "key_bin": [0, 2, 5],
                                 "count": [4, 40, 8]}
    assert t.layers("dsa_key_counts") == [3, 7]
    heat = t.dsa_heatmap(bins=6, start=0, end=96)  # stored bins of 16 tokens onto 6 bins of 16
    assert heat.shape == (2, 6) and heat[0].tolist() == [9, 0, 40, 0, 0, 8 * 0] and heat[1, 5] == 8
    assert t.dsa_heatmap(layer=7, bins=3, start=0, end=96).tolist() == [[0, 0, 8]]
    capped = t.dsa_heatmap(bins=12, start=0, end=96)  # never finer than the stored 16-token bins (issue 42)
    assert capped.shape == (2, 6) and capped[0].tolist() == [9, 0, 40, 0, 0, 0] and capped.layers == (3, 7)
    from workbench.signals import dsa as dsa_signals  # the dashboard's screen bins spread a stored bin's count

    assert np.isclose(dsa_signals.heatmap(t, bins=12, start=0, end=96, spread=True)[0, :2], [4.5, 4.5]).all()
    assert t.moe_counts_matrix().tolist() == [[0, 0, 28, 0, 0, 0, 0, 0]]
    assert t.moe_counts_matrix("image").tolist() == [[0, 0, 16, 0, 0, 0, 0, 0]]
    assert t.moe_counts_matrix(segments=[0]).sum() == 12
    w.close()


def test_refresh_follows_and_close_compacts_tokens(tmp_path):
    w = _writer(tmp_path)
    _tokens(w, 0, 50)
    w.flush()
    t = open_trace(tmp_path / "t")
    assert len(t.tokens()) == 50 and t.refresh() == set()
    _tokens(w, 50, 100)
    w.append("dsa_sink", layer=3, step=0, rank=0, position=99, queries=100, sink_hits=97)
    w.update_session(timings={"ttft_s": 1.5})
    w.update_session(timings={"tpot_s": 0.03})
    w.flush()
    assert t.refresh() == {"session", "tokens", "dsa_sink"}
    assert t.session["timings"] == {"ttft_s": 1.5, "tpot_s": 0.03} and len(t.tokens()) == 100
    w.add_segment({"id": 3, "kind": "generated", "name": "answer", "start": 100, "end": 100})
    w.close()
    assert t.refresh() >= {"session", "tokens"}
    assert t.status == "complete" and len(t.tokens()) == 100
    assert (tmp_path / "t" / "tokens.parquet").is_file() and not (tmp_path / "t" / "tokens").exists()
    assert t.parts("tokens") == [tmp_path / "t" / "tokens.parquet"]
    assert json.loads((tmp_path / "t" / "session.json").read_text())["segments"][-1]["kind"] == "generated"
    assert open_trace(tmp_path / "t").tokens()["position"].tolist() == list(range(100))


def test_buffers_flush_themselves(tmp_path):
    w = _writer(tmp_path, max_buffer_rows=100, max_buffer_bytes=1 << 30)
    for i in range(7):
        w.append("dsa_dense_mass", layer=3, step=i, rank=0, position=np.arange(40) + 40 * i, mass=np.ones(40))
    # the buffer reached 100 rows after appends 3 and 6 (two background flushes); 40 rows wait
    w.flush()
    sizes = [p.rows for p in open_trace(tmp_path / "t")._parts["dsa_dense_mass"]]
    assert sizes == [120, 120, 40]
    w2 = TraceWriter.create(tmp_path / "u", {}, fsync=False, max_buffer_bytes=10_000)
    for i in range(10):
        w2.append("dsa_topk", layer=3, step=i, rank=0, position=[i], selected=np.arange(1000)[None])
    w.close()
    w2.close()
    assert len(list((tmp_path / "u" / "dsa_topk").glob("part-*.parquet"))) >= 3
    assert open_trace(tmp_path / "u").table("dsa_topk").num_rows == 10


def test_background_flush(tmp_path):
    w = _writer(tmp_path)
    for step in range(5):
        w.append("dsa_sink", layer=3, step=step, rank=0, position=step, queries=1, sink_hits=1)
        assert w.flush(wait=False) == {}
    w.close()
    t = open_trace(tmp_path / "t")
    assert t.problems == [] and len(t.parts("dsa_sink")) == 5 and t.session["parts"]["dsa_sink"] == 5
    assert t.table("dsa_sink")["step"].to_pylist() == [0, 1, 2, 3, 4]


def test_create_refuses_to_clobber(tmp_path):
    w = _writer(tmp_path)
    w.close()
    with pytest.raises(TraceError, match="not empty"):
        _writer(tmp_path)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(TraceError, match="holds no trace"):
        TraceWriter.create(other, {}, overwrite=True)
    assert (other / "keep.txt").read_text() == "mine"
    TraceWriter.create(tmp_path / "t", {}, overwrite=True).close()
    assert open_trace(tmp_path / "t").session["segments"] == []


def test_context_manager_marks_failure(tmp_path):
    with pytest.raises(RuntimeError):
        with TraceWriter.create(tmp_path / "t", {}, fsync=False) as w:
            w.append("dsa_sink", layer=3, step=0, rank=0, position=9, queries=10, sink_hits=10)
            raise RuntimeError("engine crashed")
    t = open_trace(tmp_path / "t")
    assert t.status == "failed" and t.table("dsa_sink")["queries"].to_pylist() == [10]
