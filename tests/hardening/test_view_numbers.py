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
from workbench.analysis import chance_of_hit, cross_layer_jaccard, faithfulness, locality, sink_over_time
from workbench.trace.schema import TABLES

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
