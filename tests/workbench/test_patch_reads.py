"""workbench.analysis.patch_reads: selections per merged patch by layer, and their chance values."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from workbench.analysis import format_patches, image_grid, patch_reads


def _tokens() -> pd.DataFrame:
    # positions 0..3 text, 4..9 a 2x3 image (segment 1), 10.. text
    rows = [(p, -1, -1, -1) for p in range(4)] + [(4 + i, 1, i // 3, i % 3) for i in range(6)]
    return pd.DataFrame(rows, columns=["position", "image_id", "patch_row", "patch_col"])


def _topk(rows: list[tuple[int, int, list[int]]]) -> pa.Table:
    return pa.table({"layer": [r[0] for r in rows], "position": [r[1] for r in rows],
                     "selected": pa.array([r[2] for r in rows], pa.list_(pa.int32()))})


def test_counts_per_layer_and_patch() -> None:
    topk = _topk([(3, 19, [0, 4, 5, 9, 12]), (3, 20, [4, 4 + 5]), (7, 19, [8, 1]), (7, 30, [6])])
    reads = patch_reads(topk, _tokens(), 1)
    assert reads.grid == (2, 3) and reads.layers == (3, 7)
    assert reads.grid_of(3).tolist() == [[2, 1, 0], [0, 0, 2]]
    assert reads.grid_of(7).tolist() == [[0, 0, 1], [0, 1, 0]]
    assert reads.grid_of(None).tolist() == [[2, 1, 1], [0, 1, 2]]
    assert reads.queries.tolist() == [2, 2] and reads.picks.tolist() == [7, 3]
    only = patch_reads(topk, _tokens(), 1, queries=(19, 19))
    assert only.grid_of(None).tolist() == [[1, 1, 0], [0, 1, 1]]
    assert patch_reads(topk, _tokens(), 1, layers=[7]).layers == (7,)


def test_chance_matches_the_hypergeometric_model() -> None:
    # layer 3: query at 19 picks 5 of 20 visible keys; query at 20 picks 2 of 21
    topk = _topk([(3, 19, [0, 4, 5, 9, 12]), (3, 20, [4, 9])])
    s = patch_reads(topk, _tokens(), 1).summary(3)
    miss = (1 - 5 / 20) * (1 - 2 / 21)
    assert s["patches"] == 6 and s["patches_read"] == 3 and s["selections"] == 5
    assert s["chance_patches"] == pytest.approx(6 * (1 - miss))
    assert s["expected_selections"] == pytest.approx(5 * 6 / 20 + 2 * 6 / 21)
    text = format_patches(s)
    assert text.startswith("patches read: 3 of 6, chance ") and "expected" in text


def test_partly_visible_image_and_full_reads() -> None:
    # the query at 6 sees patches 4, 5, 6 only; picking all 7 visible keys reads each for sure
    topk = _topk([(1, 6, list(range(7)))])
    s = patch_reads(topk, _tokens(), 1).summary()
    assert s["patches_read"] == 3
    assert s["chance_patches"] == pytest.approx(3.0)
    assert s["expected_selections"] == pytest.approx(3.0)


def test_empty_inputs() -> None:
    empty = _topk([])
    reads = patch_reads(empty, _tokens(), 1)
    assert reads.layers == () and reads.summary()["patches_read"] == 0
    assert image_grid(_tokens().iloc[:0], 1, {"image": {"grid_rows": 4, "grid_cols": 5}}) == (4, 5)
    assert reads.table()["layer"].tolist() == [-1]
