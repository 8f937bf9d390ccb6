"""Running sums of delta tables, updated part by part as a live trace grows.

The dashboard asks for the DSA heat map and the expert-count matrix every second. Re-summing all
delta rows each time would cost O(rows so far); `DenseSums` folds each new part in once and keeps
one dense vector per group (e.g. per layer: counts by key bin), so a refresh costs O(new rows).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from workbench.trace.bounds import MAX_DENSE_CELLS
from workbench.trace.schema import MODALITIES


def _codes(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Integer codes of a column; dictionary (modality) columns map to their index in MODALITIES."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_dictionary(column.type):
        lookup = np.array([MODALITIES.index(v) for v in column.dictionary.to_pylist()], dtype=np.int64)
        return lookup[column.indices.to_numpy(zero_copy_only=False)] if len(lookup) else np.zeros(0, np.int64)
    return column.to_numpy(zero_copy_only=False).astype(np.int64)


def _distinct(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`np.unique(values, return_inverse=True)`, in O(n) for small non-negative integers (layers,
    segments, modalities, group ids: the common case, where sorting each part dominated a refresh)."""
    if len(values) and values.min() >= 0 and values.max() < (1 << 20):
        present = np.bincount(values) > 0
        distinct = np.flatnonzero(present)
        lookup = np.cumsum(present) - 1
        return distinct.astype(values.dtype), lookup[values]
    return np.unique(values, return_inverse=True)


class DenseSums:
    """Sum of `value` over rows, as a dense vector over `index` for each distinct tuple of `groups`.

    Args:
        groups (tuple[str, ...]): columns that pick the vector (e.g. ("layer",)).
        index (str): integer column giving the slot inside the vector (e.g. "key_bin").
        value (str): column to add up (e.g. "count").
    """

    def __init__(self, groups: tuple[str, ...], index: str, value: str, max_cells: int = MAX_DENSE_CELLS) -> None:
        self.groups = groups
        self.index = index
        self.value = value
        self.max_cells = max_cells
        self.sums: dict[tuple[int, ...], np.ndarray] = {}
        self.seen: set[str] = set()

    def add(self, part_id: str, table: pa.Table) -> None:
        """Fold one part in (a part already folded in is ignored)."""
        if part_id in self.seen:
            return
        self.seen.add(part_id)
        if table.num_rows == 0:
            return
        idx = _codes(table[self.index])
        if idx.min() < 0:
            raise ValueError(f"negative {self.index} in part {part_id}")
        val = table[self.value].to_numpy()
        # one integer per group tuple: mixed radix over each column's range of values (first column most
        # significant, so groups come out in the order of their values)
        columns = [_codes(table[g]) for g in self.groups]
        ranges = [(int(c.min()), int(c.max())) for c in columns]
        # a column's values stand for themselves (offset by its lowest); if their ranges multiplied could
        # overflow int64, each column is first replaced by the rank of its value among its distinct values
        distinct: list[np.ndarray | None] = [None] * len(columns)
        if np.prod([float(hi - lo + 1) for lo, hi in ranges]) >= 2.0 ** 62:
            for i, c in enumerate(columns):
                distinct[i], columns[i] = _distinct(c)
                ranges[i] = (0, len(distinct[i]) - 1)
        gid, space = np.zeros(len(idx), np.int64), 1
        for code, (low, high) in zip(columns, ranges):
            gid = gid * (high - low + 1) + (code - low)
            space *= high - low + 1
        size = int(idx.max()) + 1
        flat = None
        if space * size <= max(4 * len(idx), 1 << 16):
            # the common case (a part's layers x segments x modalities x experts): one bincount over every
            # possible (group, slot) cell, no sort or unique (3x faster on moe_counts of a 1M trace); the
            # allocation is bounded by the part's own row count
            flat = np.bincount(gid * size + idx, weights=val, minlength=space * size).reshape(space, size)
            used = np.flatnonzero(np.bincount(gid, minlength=space))
            flat = flat[used]
        else:
            used, inv = _distinct(gid)
        keys = []
        for g in used.tolist():
            key = []
            for (low, high), values in zip(reversed(ranges), reversed(distinct)):
                g, c = divmod(g, high - low + 1)
                key.append(int(values[c]) if values is not None else low + c)
            keys.append(tuple(reversed(key)))
        # every size here comes from a file: refuse before allocating what no session could produce
        touched = set(keys)
        after = sum(len(v) for k, v in self.sums.items() if k not in touched) + sum(
            max(size, len(self.sums.get(k, ()))) for k in touched)
        if len(used) * size > self.max_cells or after > self.max_cells:
            raise ValueError(f"{self.index} up to {size - 1} over {len(used)} group(s) would need "
                             f"{len(used) * size:,} dense cells, more than the {self.max_cells:,} allowed")
        if flat is None:
            # bincount over (group, slot) pairs; exact in float64 up to 2**53 per slot and part
            flat = np.bincount(inv * size + idx, weights=val, minlength=len(used) * size).reshape(len(used), size)
        flat = flat.astype(np.int64)  # exact: integer weights sum exactly in float64 below 2**53
        for row, key in enumerate(keys):
            current = self.sums.get(key)
            if current is None or len(current) < size:
                grown = np.zeros(max(size, 0 if current is None else len(current)), np.int64)
                if current is not None:
                    grown[:len(current)] = current
                current = grown
                self.sums[key] = current
            current[:size] += flat[row]

    def total(self, select: dict[str, list[int] | None] | None = None, by: str | None = None
              ) -> dict[int, np.ndarray]:
        """Sum of the vectors whose group values are in `select`, keyed by the group column `by`.

        Args:
            select (dict, Optional): {group column: allowed values or None for all}.
            by (str, Optional): group column to keep apart (e.g. "layer"); None sums everything under key 0.
        """
        select = select or {}
        positions = {g: i for i, g in enumerate(self.groups)}
        out: dict[int, np.ndarray] = {}
        for key, vec in self.sums.items():
            if any(allowed is not None and key[positions[g]] not in allowed for g, allowed in select.items()):
                continue
            k = key[positions[by]] if by is not None else 0
            acc = out.get(k)
            if acc is None or len(acc) < len(vec):
                grown = np.zeros(len(vec), np.int64)
                if acc is not None:
                    grown[:len(acc)] = acc
                acc = grown
            acc[:len(vec)] += vec
            out[k] = acc
        return out

    def restore(self, sums: dict[tuple[int, ...], np.ndarray], seen: set[str]) -> bool:
        """Take sums made earlier from exactly the parts `seen` (a finished trace's, kept by a cache)
        instead of folding them in again. False, and nothing changes, when a part was already folded
        in or `sums` do not fit: a key per group column of ints, 1-D non-negative int64 vectors, at
        most `max_cells` in all."""
        if self.seen or self.sums:
            return False
        cells = 0
        for key, vec in sums.items():
            if not (isinstance(key, tuple) and len(key) == len(self.groups) and all(isinstance(k, int) for k in key)):
                return False
            if not (isinstance(vec, np.ndarray) and vec.ndim == 1 and vec.dtype == np.int64) or (vec < 0).any():
                return False
            cells += len(vec)
        if cells > self.max_cells:
            return False
        self.sums = dict(sums)
        self.seen = set(seen)
        return True
