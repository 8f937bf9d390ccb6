"""Fuzz the trace reader: mutated session.json, damaged parts and adversarial column values either read
or raise TraceError (or are listed in trace.problems), within bounded time and memory."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from workbench.trace import TraceError, TraceWriter, open_trace
from workbench.trace.schema import TABLES, TOKENS_FILE, parquet_options
from tests.hardening.conftest import bounded
from tests.helpers import nullable_copy

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=8)
TABLE_NAMES = ["dsa_key_counts", "moe_counts", "kda_norms", "dsa_topk", "tokens"]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "t"
    w = TraceWriter.create(path, {"model": {"layers": 4, "num_experts": 8, "max_position_embeddings": 4096},
                                  "segments": []}, fsync=False)
    w.append("tokens", position=np.arange(8), token_id=np.arange(8), piece=["a"] * 8, segment=0, modality="text")
    w.append("dsa_key_counts", layer=1, step=0, rank=0, key_bin=np.arange(3), count=np.ones(3, np.int64))
    w.append("moe_counts", layer=2, step=0, rank=0, segment=0, modality="text", expert=np.arange(8),
             count=np.ones(8, np.int64))
    w.append("kda_norms", layer=0, step=0, rank=0, position=np.arange(4), norm=np.ones((4, 2)))
    w.append("dsa_topk", layer=1, step=0, rank=0, position=np.arange(2), selected=[[0, 1], [1]])
    w.flush()
    w.close("recording")
    return path


def _exercise(path) -> None:
    with bounded():
        try:
            t = open_trace(path)
            t.refresh()
            t.dsa_heatmap(bins=8)
            t.dsa_heatmap(bins=4, steps=(0, 10))
            t.moe_counts_matrix()
            t.segments()
            t.tokens()
            for name in ("dsa_key_counts", "moe_counts", "kda_norms"):
                t.layers(name)
            t.kda_norm_matrix(0)
            t.topk_for(1)
            t.check()
            assert all("\n" not in p for p in t.problems)
        except TraceError as exc:
            assert "\n" not in str(exc)


def _copy(template, tmp_path_factory):
    dst = tmp_path_factory.mktemp("fz") / "t"
    shutil.copytree(template, dst)
    return dst


@given(key=st.sampled_from(["tokens", "parts", "policy", "model", "segments", "status", "schema_version"]),
       value=JSON, sub=st.none() | st.sampled_from(["dsa_bin_tokens", "layers", "num_experts", "summary",
                                                     "max_position_embeddings", "tokens", "dsa_key_counts"]))
@example(key="parts", value={"\n": None}, sub=None)  # a table name with a newline once split the error over two lines
def test_mutated_session_json(template, tmp_path_factory, key, value, sub):
    path = _copy(template, tmp_path_factory)
    session = json.loads((path / "session.json").read_text())
    if sub is not None and isinstance(session.get(key), dict):
        session[key][sub] = value
    else:
        session[key] = value
    (path / "session.json").write_text(json.dumps(session))
    _exercise(path)


@given(table=st.sampled_from(TABLE_NAMES), blob=st.binary(max_size=400), flips=st.lists(st.integers(0, 4000),
                                                                                          max_size=6))
def test_damaged_parts(template, tmp_path_factory, table, blob, flips):
    path = _copy(template, tmp_path_factory)
    part = path / table / "part-000000.parquet"
    if not part.exists():
        return
    data = bytearray(part.read_bytes())
    if blob:
        data = bytearray(blob)
    for i in flips:
        if data:
            data[i % len(data)] ^= 0xA5
    part.write_bytes(bytes(data))
    _exercise(path)


INT = st.integers(-2 ** 31, 2 ** 31 - 1)


@given(table=st.sampled_from(["dsa_key_counts", "moe_counts", "kda_norms"]), data=st.data(),
       statistics=st.booleans(), rows=st.integers(1, 5))
def test_adversarial_column_values(template, tmp_path_factory, table, data, statistics, rows):
    path = _copy(template, tmp_path_factory)
    spec = TABLES[table]
    good = pq.read_table(path / table / "part-000000.parquet")
    cols = {}
    for field in spec.arrow_schema:
        t = field.type
        if pa.types.is_integer(t):
            bits = t.bit_width
            cols[field.name] = pa.array(data.draw(st.lists(st.integers(-2 ** (bits - 1), 2 ** (bits - 1) - 1),
                                                           min_size=rows, max_size=rows)), t)
        elif pa.types.is_dictionary(t):
            cols[field.name] = pa.array(data.draw(st.lists(st.sampled_from(["text", "image"]), min_size=rows,
                                                           max_size=rows))).dictionary_encode().cast(t)
        elif pa.types.is_list(t):
            width = data.draw(st.integers(0, 3))
            cols[field.name] = pa.array([[1.0] * data.draw(st.integers(0, 3)) if width else None
                                         for _ in range(rows)], t)
        else:
            cols[field.name] = pa.array([1.0] * rows, t)
    bad = pa.table(cols, schema=spec.arrow_schema)
    assert bad.schema.names == good.schema.names
    pq.write_table(bad, path / table / "part-000001.parquet",
                   **{**parquet_options(spec), "write_statistics": statistics})
    _exercise(path)


@pytest.mark.parametrize("table_name", ["dsa_topk", "kda_norms", "moe_counts"])
def test_a_part_written_with_nullable_columns_reads_beside_the_others(template, tmp_path_factory, table_name):
    """Another writer may declare every column nullable: such a part once failed the whole table
    ("Schema at index 1 was different"); now it reads with the others when it holds no null."""
    path = _copy(template, tmp_path_factory)
    good = pq.read_table(path / table_name / "part-000000.parquet")
    pq.write_table(nullable_copy(good), path / table_name / "part-000001.parquet",
                   **parquet_options(TABLES[table_name]))
    t = open_trace(path)
    both = t.table(table_name)
    assert both.num_rows == 2 * good.num_rows and not t.problems
    spec = TABLES[table_name].arrow_schema
    assert all(f.nullable == spec.field(f.name).nullable for f in both.schema)


def test_a_compacted_tokens_file_written_with_nullable_columns_reads(template, tmp_path_factory):
    """The tokens table of a closed trace is one compacted file (not parts): the same holds for it."""
    path = _copy(template, tmp_path_factory)
    good = pq.read_table(path / TOKENS_FILE)
    pq.write_table(nullable_copy(good), path / TOKENS_FILE, **parquet_options(TABLES["tokens"]))
    t = open_trace(path)
    tokens = t.table("tokens")
    assert tokens.num_rows == good.num_rows and not t.problems
    spec = TABLES["tokens"].arrow_schema
    assert all(f.nullable == spec.field(f.name).nullable for f in tokens.schema)


def test_a_part_with_nulls_where_the_schema_allows_none_is_skipped_and_named(template, tmp_path_factory):
    path = _copy(template, tmp_path_factory)
    good = pq.read_table(path / "dsa_topk" / "part-000000.parquet")
    layers = pa.array([None] + good["layer"].to_pylist()[1:], pa.int16())
    bad = nullable_copy(good).set_column(0, pa.field("layer", pa.int16()), layers)
    pq.write_table(bad, path / "dsa_topk" / "part-000001.parquet", **parquet_options(TABLES["dsa_topk"]))
    t = open_trace(path)
    assert t.table("dsa_topk").num_rows == good.num_rows  # the good part's rows are all there
    assert any("part-000001.parquet" in p and "column layer holds 1 null(s)" in p for p in t.problems), t.problems
