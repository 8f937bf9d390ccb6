"""Helpers shared by the analysis modules: list columns as flat arrays, segment lookup, log2 bins.

Every analysis function takes pandas DataFrames (as `trace.df(...)` returns them) or Arrow tables
(as `trace.table(...)` returns them); these helpers hide the difference.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

Frame = pd.DataFrame | pa.Table


def column(frame: Frame, name: str) -> np.ndarray:
    """A plain (non-list) column as a numpy array."""
    if isinstance(frame, pa.Table):
        return frame[name].to_numpy()
    return frame[name].to_numpy()


def list_values(frame: Frame, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A list column flattened: (values [N], row index [N]) with row index into the frame's rows."""
    values, offsets = list_offsets(frame, name)
    return values, np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))


def list_offsets(frame: Frame, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A list column flattened: (values [N], offsets [rows + 1]); row i's values are values[offsets[i]:offsets[i+1]].

    What `list_values` gives without its row index of N entries: at 1M tokens the answer's dsa_topk rows
    hold ~50M selected keys, and the index alone was 400 MB and a second of `np.repeat`; a caller that
    needs the row of a few values finds it with `np.searchsorted(offsets, i, side="right") - 1`.
    """
    if isinstance(frame, pa.Table):
        lists = frame[name].combine_chunks() if frame.num_rows else pa.array([], frame.schema.field(name).type)
        lengths = pc.list_value_length(lists).fill_null(0).to_numpy(zero_copy_only=False)
        values = pc.list_flatten(lists).to_numpy(zero_copy_only=False)
    else:
        cells = [np.asarray(v) if v is not None else np.zeros(0) for v in frame[name].tolist()]
        lengths = np.fromiter((len(c) for c in cells), dtype=np.int64, count=len(cells))
        values = np.concatenate(cells) if cells else np.zeros(0)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return values, offsets


def list_chunks(frame: Frame, name: str) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """A list column flattened chunk by chunk: (values, offsets [rows + 1] into values, first row) per chunk.

    What `list_offsets` gives without joining the chunks first: a table read from many parts is as
    many chunks, and joining the answer's ~50M selected keys of a 1M-token trace was a 200 MB copy
    (half a second) before any of them was looked at.
    """
    if not isinstance(frame, pa.Table):
        values, offsets = list_offsets(frame, name)
        yield values, offsets, 0
        return
    first = 0
    for chunk in frame[name].chunks:
        if len(chunk) == 0:
            continue
        lengths = pc.list_value_length(chunk).fill_null(0).to_numpy(zero_copy_only=False)
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        yield chunk.flatten().to_numpy(zero_copy_only=False), offsets, first
        first += len(chunk)


def to_pandas(frame: Frame) -> pd.DataFrame:
    return frame.to_pandas() if isinstance(frame, pa.Table) else frame


def segment_of(positions: Any, segments: pd.DataFrame) -> np.ndarray:
    """Segment id holding each position (-1 outside every segment); `segments` has id, start, end."""
    positions = np.asarray(positions)
    if segments is None or len(segments) == 0:
        return np.full(positions.shape, -1, dtype=np.int64)
    order = np.argsort(segments["start"].to_numpy(), kind="stable")
    starts = segments["start"].to_numpy()[order]
    ends = segments["end"].to_numpy()[order]
    ids = segments["id"].to_numpy()[order]
    idx = np.searchsorted(starts, positions, side="right") - 1
    inside = (idx >= 0) & (positions < ends[np.clip(idx, 0, None)])
    return np.where(inside, ids[np.clip(idx, 0, None)], -1)


def log2_bin(distance: Any) -> np.ndarray:
    """floor(log2(d + 1)): the distance bin of dsa_distance_hist (0 for d = 0, 1 for d in 1..2, ...)."""
    d = np.asarray(distance, dtype=np.int64)
    return np.floor(np.log2(d + 1.0)).astype(np.int64)


def log2_bin_quantiles(counts: np.ndarray, qs: Any) -> np.ndarray:
    """Distance quantiles from log2-bin counts [B], interpolating geometrically inside a bin.

    Bin b holds d + 1 in [2**b, 2**(b+1)); the quantile is placed at d + 1 = 2**(b + fraction).
    """
    counts = np.asarray(counts, dtype=np.float64)
    qs = np.atleast_1d(np.asarray(qs, dtype=np.float64))
    total = counts.sum()
    if total <= 0:
        return np.full(qs.shape, np.nan)
    cum = np.concatenate([[0.0], np.cumsum(counts)]) / total
    # exponent of (d + 1) at each bin edge is the bin index itself, so interpolate on it
    exponent = np.interp(qs, cum, np.arange(len(counts) + 1, dtype=np.float64))
    return np.exp2(exponent) - 1.0
