"""KDA memory health (spec section 6: which KDA heads saturate or forget fastest, and where?).

Pure functions, arrays in and frames out; no I/O.

- `effective_rank(S)`: exp of the entropy of the normalised singular values of each state (float64 SVD:
  the independent check of the recorded `kda_norms.eff_rank`).
- `half_lives(g)`: per-channel half-life ln 2 / -g in tokens from the log-decay g.
- `decay_timescales(g, context)`: per head: median half-life, share of "global" channels outliving the context.
- `write_vs_forget(positions, norms, mean_beta, mean_decay)`: per head: mean write strength (beta) against
  mean decay, state norm growth rate.
- `memory_health(kda_norms, segments)`: every layer's heads from the `kda_norms` table, one row per
  (layer, head) with where it saturated and where it forgot; `heads_at_risk` ranks them.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from workbench.analysis.common import Frame, segment_of, to_pandas

LN2 = float(np.log(2.0))


def effective_rank(S: np.ndarray) -> np.ndarray:
    """S [..., K, V] -> [...] float64: exp(-sum p log p) with p = sigma / sum(sigma); 0 for S = 0."""
    sigma = np.linalg.svd(np.asarray(S, dtype=np.float64), compute_uv=False)
    total = sigma.sum(-1, keepdims=True)
    p = np.divide(sigma, total, out=np.zeros_like(sigma), where=total > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(-1)
    return np.where(total[..., 0] > 0, np.exp(entropy), 0.0)


def half_lives(g: np.ndarray) -> np.ndarray:
    """Per-channel half-life in tokens, ln 2 / -g, for log-decay g <= 0 (inf where g == 0)."""
    g = np.asarray(g, dtype=np.float64)
    if np.any(g > 0):
        raise ValueError("half_lives: the log-decay g must be <= 0")
    with np.errstate(divide="ignore"):
        return np.where(g < 0, LN2 / np.where(g < 0, -g, 1.0), np.inf)


def decay_timescales(g: np.ndarray, context: int) -> pd.DataFrame:
    """Decay timescales per head from the log-decay of a span of tokens.

    Args:
        g (np.ndarray): [T, H, K] log-decay per token, head and channel (or [H, K]: one token / a mean).
        context (int): tokens of context so far; a channel is "global" when its half-life exceeds it.

    Returns: head, median_half_life (tokens; median over channels of ln 2 / -mean_t g), min_half_life,
    global_share (share of channels with half-life > context).
    """
    g = np.asarray(g, dtype=np.float64)
    mean_g = g.mean(0) if g.ndim == 3 else g  # [H, K]
    half = half_lives(mean_g)
    return pd.DataFrame({"head": np.arange(half.shape[0]), "median_half_life": np.median(half, axis=-1),
                         "min_half_life": half.min(-1), "global_share": (half > context).mean(-1)})


def write_vs_forget(positions: np.ndarray, norms: np.ndarray, mean_beta: np.ndarray | None = None,
                    mean_decay: np.ndarray | None = None) -> pd.DataFrame:
    """Write strength against forgetting, per head of one layer.

    Args:
        positions (np.ndarray): [P] measured positions, ascending.
        norms (np.ndarray): [P, H] state norms.
        mean_beta / mean_decay (np.ndarray, Optional): [P, H] interval means of beta and of exp(g).

    Returns: head, mean_beta, mean_decay (token-weighted over the intervals), write_forget_ratio
    (mean_beta / (1 - mean_decay): writes per unit of forgetting), norm_growth_per_1k (least-squares
    slope of the norm per 1000 tokens), relative_growth (last / first norm - 1).
    """
    positions = np.asarray(positions, dtype=np.float64)
    norms = np.asarray(norms, dtype=np.float64)
    n_heads = norms.shape[1] if norms.ndim == 2 else 0
    weights = np.diff(np.concatenate([[-1.0], positions]))  # tokens in each interval

    def weighted(values: np.ndarray | None) -> np.ndarray:
        if values is None or len(values) == 0:
            return np.full(n_heads, np.nan)
        v = np.asarray(values, dtype=np.float64)
        return (v * weights[:, None]).sum(0) / weights.sum()

    beta, decay = weighted(mean_beta), weighted(mean_decay)
    if len(positions) > 1:
        x = positions - positions.mean()
        slope = (x[:, None] * (norms - norms.mean(0))).sum(0) / (x * x).sum() * 1000.0
        rel = norms[-1] / np.maximum(np.abs(norms[0]), 1e-12) - 1.0
    else:
        slope = rel = np.full(n_heads, np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = beta / (1.0 - decay)
    return pd.DataFrame({"head": np.arange(n_heads), "mean_beta": beta, "mean_decay": decay,
                         "write_forget_ratio": ratio, "norm_growth_per_1k": slope, "relative_growth": rel})


def _matrix(df: pd.DataFrame, name: str) -> np.ndarray | None:
    if name not in df or df[name].isna().all():
        return None
    cells = df[name].tolist()
    if any(c is None for c in cells):
        return None
    return np.stack([np.asarray(c, dtype=np.float64) for c in cells])


HEALTH_STATS = ("norm", "mean_decay", "mean_beta", "eff_rank", "half_life", "global_share")  # per-head statistics it reads


def memory_health(kda_norms: Frame, segments: pd.DataFrame | None = None, plateau: float = 0.9) -> pd.DataFrame:
    """Per (layer, head) health from the kda_norms table (as `trace.df("kda_norms")` returns it).

    Returns one row per layer and head: layer, head, final_norm, peak_norm, saturate_position (first
    position where the norm reaches `plateau` x its peak; earlier = saturates faster), saturate_fraction
    (of the context), forget_position (largest relative fall of the norm between measurements; -1 if
    it never fell), forget_drop, forget_segment, min_eff_rank / min_eff_rank_position / final_eff_rank
    (NaN when not recorded), half_life (median channel half-life at the last measurement, or from
    mean_decay when only that was recorded), global_share (final), mean_beta, mean_decay,
    norm_growth_per_1k (least-squares slope over the whole session: negative once a full state decays),
    saturate_growth_per_1k (norm gained per 1000 tokens from the first measurement to the plateau: >= 0,
    NaN when the first measurement is already on it). `health_of_layers` gives the same from per-layer
    matrices.
    """
    df = to_pandas(kda_norms)
    layers = {}
    for layer, g in df.groupby("layer", sort=True):
        stats = {name: _matrix(g, name) for name in HEALTH_STATS}
        layers[int(layer)] = (g["position"].to_numpy().astype(np.int64), stats)
    return health_of_layers(layers, segments, plateau)


def health_of_layers(layers: "dict[int, tuple[np.ndarray, dict[str, np.ndarray | None]]]",
                     segments: pd.DataFrame | None = None, plateau: float = 0.9) -> pd.DataFrame:
    """`memory_health` from per-layer arrays instead of a table of list cells (what a reader that
    folded `kda_norms` part by part holds: no round trip through one Python list per row).

    Args:
        layers: layer -> (positions [P], {statistic: float [P, H] matrix or None}) with the statistics
            of `HEALTH_STATS` (missing ones are None); rows in any order, a repeated position keeps
            its last row.
        segments / plateau: as in `memory_health`.
    """
    rows = []
    for layer in sorted(layers):
        positions, stats = layers[layer]
        positions = np.asarray(positions, dtype=np.int64)
        if stats.get("norm") is None or len(positions) == 0:
            continue
        # sorted by position, a repeated position keeping its last row
        order = np.argsort(positions, kind="stable")
        ordered = positions[order]
        last = np.append(ordered[1:] != ordered[:-1], True)
        keep = order[last]
        one = _layer_health(int(layer), positions[keep],
                            {k: (np.asarray(v, dtype=np.float64)[keep] if v is not None else None)
                             for k, v in stats.items()}, plateau)
        rows.append(one)
    out = pd.concat(rows, ignore_index=True) if rows else pd.DataFrame()
    if len(out):
        forget = out["forget_position"].to_numpy()
        out["forget_segment"] = np.where(forget >= 0, segment_of(np.maximum(forget, 0), segments), -1)
        out["saturate_segment"] = segment_of(out["saturate_position"].to_numpy(), segments)
    return out


def _layer_health(layer: int, pos: np.ndarray, stats: dict, plateau: float) -> pd.DataFrame:
    """One layer's rows of `memory_health` (positions ascending and distinct, float64 matrices)."""
    norms = stats["norm"]
    n_heads = norms.shape[1]
    peak = norms.max(0)
    reached = (norms >= plateau * peak).argmax(0)
    saturate = pos[reached]
    heads = np.arange(n_heads)
    with np.errstate(divide="ignore", invalid="ignore"):
        climb = np.where(reached > 0, (norms[reached, heads] - norms[0]) / (saturate - pos[0]) * 1000.0, np.nan)
    if len(pos) > 1:
        drops = (norms[:-1] - norms[1:]) / np.maximum(norms[:-1], 1e-12)
        at = drops.argmax(0)
        drop = np.maximum(drops[at, np.arange(n_heads)], 0.0)
        forget = np.where(drop > 0, pos[at + 1], -1)
    else:
        drop, forget = np.zeros(n_heads), np.full(n_heads, -1)
    beta, decay = stats.get("mean_beta"), stats.get("mean_decay")
    wf = write_vs_forget(pos, norms, beta, decay)
    rank = stats.get("eff_rank")
    if rank is not None and np.isfinite(rank).any():
        filled = np.where(np.isfinite(rank), rank, np.inf)
        min_rank, min_at = filled.min(0), pos[filled.argmin(0)]
        last_ok = np.where(np.isfinite(rank), np.arange(len(pos))[:, None], -1).max(0)
        final_rank = rank[np.maximum(last_ok, 0), np.arange(n_heads)]
    else:
        min_rank = final_rank = np.full(n_heads, np.nan)
        min_at = np.full(n_heads, -1)
    half, share = stats.get("half_life"), stats.get("global_share")
    if half is not None:
        half_final = half[-1]
    elif decay is not None:
        with np.errstate(divide="ignore"):
            half_final = np.where(decay[-1] < 1, LN2 / -np.log(np.clip(decay[-1], 1e-12, 1.0)), np.inf)
    else:
        half_final = np.full(n_heads, np.nan)
    # one frame per layer from whole columns (a dict per head is slow at K3.1 Pro's 69 x 96 heads)
    return pd.DataFrame({
        "layer": np.full(n_heads, layer), "head": np.arange(n_heads), "final_norm": norms[-1],
        "peak_norm": peak, "saturate_position": saturate.astype(np.int64),
        "saturate_fraction": saturate / max(int(pos[-1]), 1), "forget_position": forget.astype(np.int64),
        "forget_drop": drop, "min_eff_rank": min_rank, "min_eff_rank_position": min_at.astype(np.int64),
        "final_eff_rank": final_rank, "half_life": half_final,
        "global_share": share[-1] if share is not None else np.full(n_heads, np.nan),
        "mean_beta": wf["mean_beta"].to_numpy(), "mean_decay": wf["mean_decay"].to_numpy(),
        "norm_growth_per_1k": wf["norm_growth_per_1k"].to_numpy(), "saturate_growth_per_1k": climb})


def heads_at_risk(health: pd.DataFrame, top: int = 10) -> pd.DataFrame:
    """Which heads saturate or forget fastest, and where: the answer in one table.

    Takes `memory_health(...)`. Returns the `top` fastest-saturating heads (smallest
    saturate_fraction, then lowest effective rank) and the `top` fastest-forgetting heads (shortest
    half-life, then the largest norm drop), with `kind` ("saturates" / "forgets"), `position` (where it
    happened: the plateau, or the largest drop) and `segment`. Each head is listed once: the two lists
    pick heads in turns down their own orders, saturating first, skipping heads already listed; a head
    that never lost norm and has no recorded half-life does not forget, so it is never listed as forgetting.
    """
    if len(health) == 0:
        return pd.DataFrame(columns=["kind", "rank", "layer", "head", "position", "segment"])
    by_sat = health.sort_values(["saturate_fraction", "min_eff_rank", "layer", "head"], na_position="last")
    can_forget = health[np.isfinite(health["half_life"]) | (health["forget_drop"] > 0)]
    by_forget = can_forget.sort_values(["half_life", "forget_drop", "layer", "head"],
                                       ascending=[True, False, True, True], na_position="last")
    picked: dict[str, list] = {"saturates": [], "forgets": []}
    taken: set = set()
    queues = {"saturates": list(by_sat.index), "forgets": list(by_forget.index)}
    while any(len(picked[k]) < top and queues[k] for k in picked):
        for kind in ("saturates", "forgets"):
            queue = queues[kind]
            while queue and queue[0] in taken:
                queue.pop(0)
            if queue and len(picked[kind]) < top:
                taken.add(queue[0])
                picked[kind].append(queue.pop(0))
    sat = by_sat.loc[picked["saturates"]]
    sat = sat.assign(kind="saturates", position=sat["saturate_position"], segment=sat["saturate_segment"])
    forget = by_forget.loc[picked["forgets"]]
    forget = forget.assign(kind="forgets",
                           position=np.where(forget["forget_position"] >= 0, forget["forget_position"],
                                             forget["saturate_position"]),
                           segment=forget["forget_segment"])
    out = []
    for part in (sat, forget):
        part = part.reset_index(drop=True)
        part.insert(0, "rank", np.arange(1, len(part) + 1))
        out.append(part)
    df = pd.concat(out, ignore_index=True)
    first = ["kind", "rank", "layer", "head", "position", "segment"]
    return df[first + [c for c in df.columns if c not in first]]
