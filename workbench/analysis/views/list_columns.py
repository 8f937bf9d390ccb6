"""Fixed-width list columns (per-head statistics of `kda_norms`) as float32 matrices.

    flat_lists(column) -> (flat float32 values, width)      (empty, 0) when ragged or empty
    list_matrix(column) -> float32 [rows, width] | None     null rows NaN; None when nothing to show
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def flat_lists(column: pa.ChunkedArray) -> tuple[np.ndarray, int]:
    """A fixed-length list column as (flat float32 values, list length); (empty, 0) if ragged or empty."""
    lists = column.combine_chunks()
    if len(lists) == 0:
        return np.zeros(0, np.float32), 0
    lengths = pc.list_value_length(lists).to_numpy(zero_copy_only=False)
    if (lengths != lengths[0]).any():
        return np.zeros(0, np.float32), 0
    values = pc.list_flatten(lists).to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return values, int(lengths[0])


def list_matrix(column: pa.ChunkedArray) -> np.ndarray | None:
    """A fixed-length list column as float32 [rows, width]; null rows NaN; None when all null, empty or
    ragged (a statistic that was not recorded, or widths that disagree)."""
    if column.null_count == len(column):
        return None
    if column.null_count == 0:
        flat, width = flat_lists(column)
        return flat.reshape(len(column), width) if width else None
    cells = column.to_pylist()
    widths = {len(c) for c in cells if c is not None}
    if len(widths) != 1 or 0 in widths:
        return None
    width = widths.pop()
    return np.array([c if c is not None else [np.nan] * width for c in cells], dtype=np.float32)
