"""Position axes reduced to a screen: values and counts binned into equal ranges, and KDA carry-forward.

Shared by the dashboard (every position axis is drawn at about one bin per pixel) and notebooks
(the same pictures from a script). Pure numpy: no trace, no I/O.

- `bin_mean`: values at arbitrary positions averaged into `bins` equal ranges (NaN where empty).
- `bin_counts`: how many positions fall into each range.
- `carry_forward`: fill the gaps between sparse measurements (a KDA norm every 64 tokens).
"""

from __future__ import annotations

import numpy as np


def bin_mean(positions: np.ndarray, values: np.ndarray, bins: int, extent: float) -> np.ndarray:
    """Mean of `values` over `bins` equal position ranges of [0, extent): float32 [..., bins], NaN where empty.

    Args:
        positions (np.ndarray): [P] positions of the measurements.
        values (np.ndarray): [P] or [P, H] values (H series are binned independently).
        bins (int): number of ranges.
        extent (float): right end of the covered range (exclusive).
    """
    positions = np.asarray(positions, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    squeeze = values.ndim == 1
    if squeeze:
        values = values[:, None]
    out = np.full((values.shape[1], bins), np.nan, dtype=np.float32)
    if len(positions) == 0 or extent <= 0:
        return out[0] if squeeze else out
    idx = np.clip((positions * bins / extent).astype(np.int64), 0, bins - 1)
    counts = np.bincount(idx, minlength=bins)
    filled = counts > 0
    for h in range(values.shape[1]):
        sums = np.bincount(idx, weights=values[:, h], minlength=bins)
        out[h, filled] = sums[filled] / counts[filled]
    return out[0] if squeeze else out


def carry_forward(values: np.ndarray) -> np.ndarray:
    """Fill NaN bins between measurements with the last measured value, along the last axis.

    A KDA norm is measured every 64 tokens; on a screen with more bins than measurements the state is
    what the last measurement says until the next one, so the gaps are not "no data". Bins before the
    first and after the last measurement stay NaN (nothing known there yet).
    """
    out = np.array(values, dtype=np.float32, copy=True)
    flat = out.reshape(-1, out.shape[-1])
    for row in flat:
        known = ~np.isnan(row)
        if not known.any():
            continue
        idx = np.where(known, np.arange(len(row)), 0)
        np.maximum.accumulate(idx, out=idx)
        last = np.flatnonzero(known)[-1]
        first = np.flatnonzero(known)[0]
        filled = row[idx]
        row[first:last + 1] = filled[first:last + 1]
    return out


def bin_counts(positions: np.ndarray, bins: int, extent: float) -> np.ndarray:
    """How many of `positions` fall into each of `bins` equal ranges of [0, extent): float32 [bins]."""
    positions = np.asarray(positions, dtype=np.float64)
    if len(positions) == 0 or extent <= 0:
        return np.zeros(bins, np.float32)
    idx = np.clip((positions * bins / extent).astype(np.int64), 0, bins - 1)
    return np.bincount(idx, minlength=bins).astype(np.float32)
