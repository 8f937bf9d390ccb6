"""KDA state questions (spec section 6): which heads saturate or forget fastest, and where.

Pure functions over the per-layer matrices that `trace.kda_norm_matrix(layer)` returns
(positions [P], values [P, H]); no I/O.

- `head_dynamics`: per head of one layer: peak, plateau position, late growth, biggest drop and where,
  half-decay time from the mean decay.
- `rank_heads`: all layers' heads in one table, ranked by how fast they saturate or forget.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import pandas as pd

from workbench.analysis.common import segment_of


def half_decay_tokens(mean_decay: np.ndarray) -> np.ndarray:
    """Tokens until the state's memory halves, t = ln(0.5) / ln(decay), for per-token decay in (0, 1]."""
    decay = np.clip(np.asarray(mean_decay, dtype=np.float64), 1e-12, 1.0)
    with np.errstate(divide="ignore"):
        return np.where(decay >= 1.0, np.inf, np.log(0.5) / np.log(decay))


def head_dynamics(positions: np.ndarray, norms: np.ndarray, decay: np.ndarray | None = None,
                  segments: pd.DataFrame | None = None, plateau: float = 0.9) -> pd.DataFrame:
    """How each head's state norm evolves over the context: one row per head.

    Args:
        positions (np.ndarray): [P] measured positions, ascending.
        norms (np.ndarray): [P, H] state norms.
        decay (np.ndarray, Optional): [P, H] mean per-token decay exp(g) (kda_norms.mean_decay).
        segments (DataFrame, Optional): trace.segments(), to name the segment of each drop.
        plateau (float): a head has plateaued at the first position where its norm reaches
            `plateau` x its peak.

    Returns: head, final, peak, plateau_position (earlier = saturates faster), plateau_fraction
    (plateau_position / last position), late_growth (relative growth of the norm over the second
    half of the context; ~0 once saturated), max_drop (largest relative fall between consecutive
    measurements: forgetting), drop_position, drop_segment, half_decay_tokens (median over positions
    when `decay` is given; smaller = forgets faster).
    """
    positions = np.asarray(positions, dtype=np.int64)
    norms = np.asarray(norms, dtype=np.float64)
    n_pos, n_heads = norms.shape
    if n_pos == 0:
        return pd.DataFrame(columns=["head", "final", "peak", "plateau_position", "plateau_fraction",
                                     "late_growth", "max_drop", "drop_position", "drop_segment",
                                     "half_decay_tokens"])
    peak = norms.max(axis=0)
    reached = norms >= plateau * peak
    plateau_idx = reached.argmax(axis=0)
    plateau_pos = positions[plateau_idx]
    mid = np.searchsorted(positions, positions[-1] / 2)
    mid = min(mid, n_pos - 1)
    late_growth = (norms[-1] - norms[mid]) / np.maximum(np.abs(norms[mid]), 1e-12)
    if n_pos > 1:
        prev = np.maximum(norms[:-1], 1e-12)
        drops = (norms[:-1] - norms[1:]) / prev  # [P-1, H], positive when the norm fell
        drop_idx = drops.argmax(axis=0)
        max_drop = np.maximum(drops[drop_idx, np.arange(n_heads)], 0.0)
        drop_pos = np.where(max_drop > 0, positions[drop_idx + 1], -1)
    else:
        max_drop = np.zeros(n_heads)
        drop_pos = np.full(n_heads, -1)
    drop_seg = np.where(drop_pos >= 0, segment_of(np.maximum(drop_pos, 0), segments), -1)
    half = np.full(n_heads, np.nan)
    if decay is not None and len(decay):
        half = np.median(half_decay_tokens(decay), axis=0)
    return pd.DataFrame({
        "head": np.arange(n_heads), "final": norms[-1], "peak": peak, "plateau_position": plateau_pos,
        "plateau_fraction": plateau_pos / max(int(positions[-1]), 1), "late_growth": late_growth,
        "max_drop": max_drop, "drop_position": drop_pos, "drop_segment": drop_seg, "half_decay_tokens": half,
    })


def rank_heads(per_layer: Mapping[int, pd.DataFrame], by: str = "plateau_fraction", ascending: bool = True,
               top: int | None = None) -> pd.DataFrame:
    """All heads of all layers ranked: which heads saturate (plateau_fraction) or forget (max_drop,
    half_decay_tokens) fastest.

    Args:
        per_layer (Mapping[int, DataFrame]): {layer: head_dynamics(...)}.
        by (str): the column to rank on; "max_drop" ranks forgetting (use ascending=False).
        ascending (bool): sort order of `by`.
        top (int, Optional): keep the first `top` rows.
    """
    frames = [df.assign(layer=layer) for layer, df in per_layer.items() if len(df)]
    if not frames:
        return pd.DataFrame()
    df = pd.concat(frames, ignore_index=True)
    df = df[["layer"] + [c for c in df.columns if c != "layer"]]
    df = df.sort_values([by, "layer", "head"], ascending=[ascending, True, True], ignore_index=True)
    df.insert(0, "rank", np.arange(1, len(df) + 1))
    return df if top is None else df.head(top)
