"""`DenseSums.add` against a plain dictionary sum, on both of its paths (one bincount over every cell of
the groups' value ranges, and ranks of distinct values when those ranges are far apart or huge)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from workbench.trace.aggregates import DenseSums
from workbench.trace.schema import MODALITIES


def _naive(rows: list[tuple], groups: int) -> dict[tuple, np.ndarray]:
    out: dict[tuple, dict[int, int]] = {}
    for *key, idx, val in rows:
        cells = out.setdefault(tuple(key[:groups]), {})
        cells[idx] = cells.get(idx, 0) + val
    return {k: np.bincount(list(c), weights=list(c.values())).astype(np.int64) for k, c in out.items()}


def _table(segment, modality, layer, expert, count) -> pa.Table:
    mod = pa.DictionaryArray.from_arrays(pa.array(modality, pa.int8()), pa.array(list(MODALITIES)))
    return pa.table({"segment": pa.array(segment, pa.int32()), "modality": mod, "layer": pa.array(layer, pa.int16()),
                     "expert": pa.array(expert, pa.int16()), "count": pa.array(count, pa.int64())})


@pytest.mark.parametrize("segment_range", [(0, 3), (-5, 2), (0, 2_000_000_000)],
                         ids=["small", "negative", "far-apart"])
def test_dense_sums_equal_a_plain_sum_over_parts(segment_range: tuple[int, int]) -> None:
    rng = np.random.default_rng(7)
    sums = DenseSums(("segment", "modality", "layer"), "expert", "count")
    rows: list[tuple] = []
    for part in range(4):
        n = 500
        seg = rng.integers(*segment_range, n)
        mod = rng.integers(0, len(MODALITIES), n)
        layer = rng.integers(1, 9, n)
        expert = rng.integers(0, 40 + 10 * part, n)  # vectors grow between parts
        count = rng.integers(1, 1000, n)
        sums.add(f"part-{part}", _table(seg, mod, layer, expert, count))
        rows += [(int(s), int(m), int(l), int(e), int(c)) for s, m, l, e, c in zip(seg, mod, layer, expert, count)]
    sums.add("part-0", _table([0], [0], [1], [0], [10**6]))  # a part folded twice counts once
    want = _naive(rows, 3)
    assert set(sums.sums) == set(want)
    for key, vec in want.items():
        got = sums.sums[key]
        assert np.array_equal(got[:len(vec)], vec) and not got[len(vec):].any(), key


def test_dense_sums_refuse_a_part_that_would_need_too_many_cells() -> None:
    sums = DenseSums(("layer",), "expert", "count", max_cells=1000)
    with pytest.raises(ValueError, match="dense cells"):
        sums.add("p", pa.table({"layer": pa.array([0, 1], pa.int16()), "expert": pa.array([0, 999], pa.int16()),
                                "count": pa.array([1, 1], pa.int64())}))
    assert sums.sums == {}
