"""Issue 42 item 5 (Arrow summaries): columns without buffers (the null type) cost nothing in the file and
a value each once converted, so a summary is bounded by its fields and by the values of all its
columns together, not only per column; a running-sums summary converts only a few integer columns."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from tests.hardening.conftest import bounded
from workbench.trace import summary_cache
from workbench.trace.arrow_limits import MAX_FIELDS, VALUES_PER_ROW_LIMIT, BoundsError, read_bounded


def _ipc(path, table: pa.Table):
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)
    return path


def test_thousands_of_bufferless_columns_are_refused(tmp_path):
    many = _ipc(tmp_path / "many.arrow", pa.table({f"c{i}": pa.nulls(1 << 20) for i in range(2000)}))
    assert many.stat().st_size < 1 << 20
    with bounded(seconds=5, rss_mib=50):
        with pytest.raises(BoundsError, match=f"its schema holds 2,000 fields, more than the {MAX_FIELDS}"):
            read_bounded(many, summary_cache.MAX_DENSE_CELLS)


def test_the_values_of_all_columns_together_are_bounded(tmp_path):
    limit = 1 << 16
    wide = _ipc(tmp_path / "wide.arrow", pa.table({f"c{i}": pa.nulls(limit) for i in range(VALUES_PER_ROW_LIMIT)}))
    with pytest.raises(BoundsError, match="values together, more than the"):
        read_bounded(wide, limit)
    ok = _ipc(tmp_path / "ok.arrow", pa.table({"a": np.arange(limit), "b": np.arange(limit)}))
    assert read_bounded(ok, limit).num_rows == limit


def test_a_sums_summary_with_odd_group_columns_is_not_converted(tmp_path, monkeypatch):
    from workbench.trace import TraceWriter, open_trace
    monkeypatch.setenv("K3WB_DASHBOARD_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "t"
    w = TraceWriter.create(path, {"model": {"layers": 8, "num_experts": 16}}, fsync=False)
    w.append("dsa_key_counts", layer=3, step=0, rank=0, key_bin=np.arange(4), count=np.ones(4, np.int64))
    w.close()
    t = open_trace(path)
    key = summary_cache.key(t, ("dsa_key_counts",))
    n = 1 << 20
    counts = pa.LargeListArray.from_arrays(pa.array(np.zeros(n + 1, np.int64)), pa.array([], pa.int64()))
    # 60 group columns of the null type: 1 MB in the file, 480 MB of None once converted
    groups = {f"g{i}": pa.nulls(n) for i in range(60)}
    summary_cache.save_arrow(key, "sums-dsa_key_counts", pa.table({**groups, "counts": counts}))
    with bounded(seconds=10, rss_mib=100):
        assert summary_cache.restore_sums(t, "dsa_key_counts") is False
    assert t.dsa_heatmap(bins=4).sum() == 4
