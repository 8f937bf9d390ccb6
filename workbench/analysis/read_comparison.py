"""K3 vs K3.1 layer by layer: pure comparisons of two runs of the same input (arrays in, frames out).

- `relative_difference(a, b)`: per position ||a - b|| / ||a|| of two [T, D] layer outputs.
- `next_token_kl(logits_a, logits_b)`: KL(p_a || p_b) of the next-token distributions at every position.
- `read_changes(topk_a, topk_b)`: per DSA layer and query recorded in both traces, whether (and how much)
  the selected set changed: Jaccard, keys only in A / only in B.
- `summarize_reads(changes)`: per layer, the share of queries whose reads changed.
- `reads_vs_chance(changes)`: per layer, the mean Jaccard of A's and B's selections beside the Jaccard
  two random selections of the same sizes would give (hypergeometric, `chance_jaccard`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from workbench.analysis.common import Frame
from workbench.analysis.dsa_structure import _rows_by_layer, chance_jaccard


def relative_difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a, b [T, D] -> [T] float64: ||a_t - b_t|| / ||a_t|| (0 where both are 0, inf where only a_t is 0)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    num, den = np.linalg.norm(a - b, axis=-1), np.linalg.norm(a, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.where(num > 0, np.inf, 0.0))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def next_token_kl(logits_a: np.ndarray, logits_b: np.ndarray) -> np.ndarray:
    """[T, V] logits of the same positions from runs A and B -> [T] float64 KL(p_a || p_b) in nats."""
    la, lb = _log_softmax(logits_a), _log_softmax(logits_b)
    return (np.exp(la) * (la - lb)).sum(-1)


def read_changes(topk_a: Frame, topk_b: Frame) -> pd.DataFrame:
    """Which queries' reads changed between two traces (dsa_topk rows of each).

    Returns one row per (layer, position) recorded in both: layer, position, jaccard, only_a (keys read
    in A but not B), only_b, changed (the sets differ), keys_a / keys_b (sizes of the two selections).
    """
    a, b = _rows_by_layer(topk_a), _rows_by_layer(topk_b)
    out = []
    for layer in sorted(set(a) & set(b)):
        for pos in sorted(set(a[layer]) & set(b[layer])):
            sa, sb = set(a[layer][pos].tolist()), set(b[layer][pos].tolist())
            union = len(sa | sb)
            out.append({"layer": layer, "position": pos, "jaccard": len(sa & sb) / union if union else 1.0,
                        "only_a": len(sa - sb), "only_b": len(sb - sa), "changed": sa != sb,
                        "keys_a": len(sa), "keys_b": len(sb)})
    return pd.DataFrame(out, columns=["layer", "position", "jaccard", "only_a", "only_b", "changed", "keys_a",
                                      "keys_b"])


def summarize_reads(changes: pd.DataFrame) -> pd.DataFrame:
    """Per DSA layer: queries compared, changed_share, mean_jaccard, first_changed (position, -1 if none)."""
    rows = []
    for layer, g in changes.groupby("layer", sort=True):
        changed = g[g["changed"]]
        rows.append({"layer": int(layer), "queries": len(g), "changed_share": float(g["changed"].mean()),
                     "mean_jaccard": float(g["jaccard"].mean()),
                     "first_changed": int(changed["position"].min()) if len(changed) else -1})
    return pd.DataFrame(rows, columns=["layer", "queries", "changed_share", "mean_jaccard", "first_changed"])


def reads_vs_chance(changes: pd.DataFrame) -> pd.DataFrame:
    """Per DSA layer: how alike A's and B's reads are, beside what chance alone would give.

    Takes `read_changes(...)`. A query at position p sees p + 1 keys; two independent uniform random
    selections of keys_a and keys_b of them have the expected Jaccard `chance_jaccard(p + 1, keys_a,
    keys_b)`. Returns layer, queries, changed_share, mean_jaccard, chance_jaccard (mean over the same
    queries), ratio (mean_jaccard / chance_jaccard), first_changed (position, -1 if none).
    """
    cols = ["layer", "queries", "changed_share", "mean_jaccard", "chance_jaccard", "ratio", "first_changed"]
    if len(changes) == 0:
        return pd.DataFrame(columns=cols)
    missing = {"keys_a", "keys_b"} - set(changes.columns)
    if missing:
        raise ValueError(f"reads_vs_chance needs the selection sizes {sorted(missing)} (from read_changes)")
    cache: dict[tuple[int, int, int], float] = {}

    def chance(visible: int, ka: int, kb: int) -> float:
        key = (visible, ka, kb)
        if key not in cache:
            cache[key] = chance_jaccard(*key)
        return cache[key]

    rows = []
    for layer, g in changes.groupby("layer", sort=True):
        ch = [chance(int(p) + 1, int(a), int(b)) for p, a, b in zip(g["position"], g["keys_a"], g["keys_b"])]
        mean, base = float(g["jaccard"].mean()), float(np.mean(ch))
        changed = g[g["changed"]]
        rows.append({"layer": int(layer), "queries": len(g), "changed_share": float(g["changed"].mean()),
                     "mean_jaccard": mean, "chance_jaccard": base, "ratio": mean / base if base > 0 else np.nan,
                     "first_changed": int(changed["position"].min()) if len(changed) else -1})
    return pd.DataFrame(rows, columns=cols)
