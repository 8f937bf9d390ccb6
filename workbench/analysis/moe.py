"""Expert questions (spec section 6): are image tokens routed to other experts than text? Is an
expert-parallel rank overloaded? Pure functions over moe_counts / moe_rank_load rows and count matrices.

- `expert_shares`: each expert's share of a layer's routed slots, by modality.
- `modality_divergence`: per layer, how different the text and image expert distributions are.
- `rank_load_balance`: per layer, load of the busiest expert-parallel rank against the mean.
- `expert_imbalance`: per layer, max/mean load over experts (from a [layers, experts] matrix).
- `js_chance`: the divergence two samples of one distribution show by chance (beside an observed one).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from workbench.analysis.common import Frame, to_pandas


def expert_shares(counts: Frame) -> pd.DataFrame:
    """Routed slots per (layer, modality, expert) and their share of the (layer, modality) total."""
    df = to_pandas(counts).copy()
    df["modality"] = df["modality"].astype(str)
    agg = df.groupby(["layer", "modality", "expert"], as_index=False)["count"].sum()
    agg["share"] = agg["count"] / agg.groupby(["layer", "modality"])["count"].transform("sum")
    return agg


def js_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen-Shannon divergence in bits (0 = same distribution, 1 = disjoint) of two count vectors."""
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    if p.sum() <= 0 or q.sum() <= 0:
        return float("nan")
    p, q = p / p.sum(), q / q.sum()
    m = 0.5 * (p + q)

    def kl(a: np.ndarray) -> float:
        nz = a > 0
        return float(np.sum(a[nz] * np.log2(a[nz] / m[nz])))

    return 0.5 * kl(p) + 0.5 * kl(q)


def modality_divergence(counts: Frame, num_experts: int | None = None, top: int = 5) -> pd.DataFrame:
    """Are image tokens routed differently from text tokens? One row per layer of moe_counts.

    Returns: layer, text_slots, image_slots, js_divergence (bits, NaN without both modalities),
    image_experts (the `top` experts whose share among image tokens most exceeds their text share),
    sorted by divergence descending.
    """
    df = to_pandas(counts).copy()
    df["modality"] = df["modality"].astype(str)
    width = int(num_experts or (df["expert"].max() + 1 if len(df) else 0))
    out = []
    for layer, g in df.groupby("layer", sort=True):
        vec = {}
        for mod in ("text", "image"):
            sel = g[g["modality"] == mod]
            vec[mod] = np.bincount(sel["expert"].to_numpy().astype(np.int64), weights=sel["count"].to_numpy(),
                                   minlength=width)
        text, image = vec["text"], vec["image"]
        lift = image / max(image.sum(), 1) - text / max(text.sum(), 1)
        out.append({"layer": int(layer), "text_slots": int(text.sum()), "image_slots": int(image.sum()),
                    "js_divergence": js_divergence(text, image),
                    "image_experts": [int(e) for e in np.argsort(-lift, kind="stable")[:top]] if image.sum() else []})
    return pd.DataFrame(out, columns=["layer", "text_slots", "image_slots", "js_divergence", "image_experts"]
                        ).sort_values("js_divergence", ascending=False, ignore_index=True, na_position="last")


def rank_load_balance(rank_load: Frame) -> pd.DataFrame:
    """Is an expert-parallel rank overloaded? One row per layer of moe_rank_load.

    Returns: layer, ranks, total, max, mean, imbalance (= max / mean; 1.0 is perfectly balanced; the
    busiest rank sets the step time), busiest_rank; sorted by imbalance descending.
    """
    df = to_pandas(rank_load)
    per = df.groupby(["layer", "ep_rank"], as_index=False)["tokens"].sum()
    out = []
    for layer, g in per.groupby("layer", sort=True):
        loads = g["tokens"].to_numpy().astype(np.float64)
        mean = loads.mean()
        out.append({"layer": int(layer), "ranks": len(loads), "total": int(loads.sum()), "max": int(loads.max()),
                    "mean": float(mean), "imbalance": float(loads.max() / mean) if mean > 0 else np.nan,
                    "busiest_rank": int(g["ep_rank"].to_numpy()[loads.argmax()])})
    return pd.DataFrame(out, columns=["layer", "ranks", "total", "max", "mean", "imbalance", "busiest_rank"]
                        ).sort_values("imbalance", ascending=False, ignore_index=True)


def expert_imbalance(matrix: np.ndarray) -> np.ndarray:
    """Per layer max/mean routed load over experts of a [layers, experts] count matrix (NaN for empty rows)."""
    matrix = np.asarray(matrix, dtype=np.float64)
    mean = matrix.mean(axis=1) if matrix.size else np.zeros(len(matrix))
    return np.divide(matrix.max(axis=1, initial=0.0), mean, out=np.full(len(matrix), np.nan), where=mean > 0)


def js_chance(text: np.ndarray, image: np.ndarray, draws: int = 200, seed: int = 0) -> float:
    """The JS divergence (bits) two samples of these sizes show by chance alone: the mean over `draws` of
    JS(text', image') where both are drawn (multinomial, same slot totals) from the pooled distribution.

    Finite samples of one distribution never have divergence 0, so an observed text-vs-image
    divergence is shown beside this value (NaN without both modalities).
    """
    text = np.asarray(text, dtype=np.float64)
    image = np.asarray(image, dtype=np.float64)
    n_text, n_image = int(text.sum()), int(image.sum())
    if n_text <= 0 or n_image <= 0:
        return float("nan")
    pooled = (text + image) / (n_text + n_image)
    rng = np.random.default_rng(seed)
    return float(np.mean([js_divergence(rng.multinomial(n_text, pooled), rng.multinomial(n_image, pooled))
                          for _ in range(draws)]))
