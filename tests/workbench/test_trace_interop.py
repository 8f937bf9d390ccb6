"""A trace is plain Parquet + JSON: DuckDB SQL, pandas and pyarrow read it with no project code.

The reading happens in a fresh interpreter that imports only duckdb, pandas and pyarrow, so nothing of
this project can help; it prints JSON that is compared with what the project's reader says.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from workbench.trace import open_trace
from k3testing.synthetic import Dims, Policy, write_synthetic_trace

READER = textwrap.dedent(r"""
    import json, sys
    import duckdb, pandas as pd, pyarrow.parquet as pq
    trace = sys.argv[1]
    assert not any(m.split(".")[0] in ("workbench", "engine") for m in sys.modules)
    out = {}
    out["duck_key_counts"] = duckdb.sql(
        f"SELECT layer, sum(count) AS n FROM read_parquet('{trace}/dsa_key_counts/part-*.parquet') "
        "GROUP BY layer ORDER BY layer").fetchall()
    out["duck_image_tokens"] = duckdb.sql(
        f"SELECT count(*), max(patch_row) FROM read_parquet('{trace}/tokens.parquet') WHERE modality = 'image'"
    ).fetchall()
    out["duck_topk"] = duckdb.sql(
        f"SELECT count(*), sum(len(selected)), min(list_min(selected)) FROM "
        f"read_parquet('{trace}/dsa_topk/part-*.parquet')").fetchall()
    out["duck_norm_heads"] = duckdb.sql(
        f"SELECT DISTINCT len(norm), typeof(norm[1]) FROM read_parquet('{trace}/kda_norms/part-*.parquet')").fetchall()
    out["duck_join"] = duckdb.sql(
        f"SELECT t.modality, sum(c.count) FROM read_parquet('{trace}/moe_counts/part-*.parquet') c "
        f"JOIN (SELECT DISTINCT segment, modality FROM read_parquet('{trace}/tokens.parquet')) t "
        "USING (segment, modality) GROUP BY 1 ORDER BY 1").fetchall()
    routes = pd.read_parquet(f"{trace}/moe_routes")
    out["pandas_routes"] = [len(routes), int(routes["experts"].iloc[0].shape[0]), str(routes["weights"].iloc[0].dtype)]
    tokens = pd.read_parquet(f"{trace}/tokens.parquet")
    out["pandas_tokens"] = [len(tokens), str(tokens["modality"].dtype), int(tokens["position"].iloc[-1])]
    session = json.load(open(f"{trace}/session.json"))
    out["session"] = [session["schema"], session["schema_version"], session["status"], len(session["segments"])]
    out["arrow_meta"] = pq.read_schema(f"{trace}/dsa_sink/part-000000.parquet").metadata[b"k3wb.table"].decode()
    print(json.dumps(out, default=str))
""")


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("interop") / "trace"
    return write_synthetic_trace(path, 24576, Dims.demo(), Policy(prefill_chunk=4096, decode_tokens=256), seed=3)


def test_duckdb_and_pandas_read_the_trace_without_project_code(trace_path):
    run = subprocess.run([sys.executable, "-c", READER, str(trace_path)], capture_output=True, text=True, timeout=120,
                         cwd="/")
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    t = open_trace(trace_path)
    expected = t.table("dsa_key_counts").group_by("layer").aggregate([("count", "sum")]).sort_by("layer")
    assert got["duck_key_counts"] == [list(r.values()) for r in expected.to_pylist()]
    image = t.segments().query("kind == 'image'").iloc[0]
    assert got["duck_image_tokens"] == [[image["tokens"], image["image_grid_rows"] - 1]]
    topk = t.table("dsa_topk")
    assert got["duck_topk"][0][:2] == [topk.num_rows, sum(len(s) for s in topk["selected"].to_pylist())]
    assert got["duck_norm_heads"] == [[4, "FLOAT"]]
    moe = t.moe_counts_matrix
    assert got["duck_join"] == [["image", int(moe("image").sum())], ["text", int(moe("text").sum())]]
    assert got["pandas_routes"] == [t.table("moe_routes").num_rows, 4, "float16"]
    assert got["pandas_tokens"] == [24576, "category", 24575]
    assert got["session"] == ["k3-workbench-trace", 1, "complete", 6]
    assert got["arrow_meta"] == "dsa_sink"


def test_pyarrow_dataset_reads_a_table_directory(trace_path):
    import pyarrow.dataset as ds

    table = ds.dataset(trace_path / "dsa_dense_mass", format="parquet").to_table()
    assert table.num_rows == open_trace(trace_path).table("dsa_dense_mass").num_rows
    assert np.all((table["mass"].to_numpy() > 0) & (table["mass"].to_numpy() <= 1))
