"""Reductions from probe payloads to trace rows: pure functions, computed where the data lives.

Every function takes the tensors a probe emitted (on the model's device) and returns small numpy
columns for one trace table. Counting (bincount) happens on the device, so a GPU run copies out
kilobytes per step, not the [T, 2048] index lists.
"""

from __future__ import annotations

import numpy as np
import torch

Columns = dict[str, np.ndarray]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").numpy()


def _nonzero_counts(values: torch.Tensor, minlength: int = 0) -> tuple[np.ndarray, np.ndarray]:
    counts = torch.bincount(values.reshape(-1), minlength=minlength)
    keys = counts.nonzero().reshape(-1)
    return _np(keys), _np(counts[keys])


def dsa_key_counts(indices: torch.Tensor, bin_tokens: int) -> Columns:
    """indices [T, k] (-1 = empty) -> selections per key bin."""
    valid = indices[indices >= 0]
    bins, counts = _nonzero_counts(torch.div(valid, bin_tokens, rounding_mode="floor"))
    return {"key_bin": bins.astype(np.int32), "count": counts.astype(np.int64)}


def dsa_distance_hist(positions: torch.Tensor, indices: torch.Tensor) -> Columns:
    """Read distance d = query - key in log2 bins: b = floor(log2(d + 1))."""
    valid = indices >= 0
    d = (positions.unsqueeze(-1) - indices)[valid].clamp_min(0)
    b = torch.floor(torch.log2(d.double() + 1)).long()
    bins, counts = _nonzero_counts(b)
    return {"log2_bin": bins.astype(np.int8), "count": counts.astype(np.int64)}


def dsa_segment_totals(indices: torch.Tensor, segment_of: torch.Tensor) -> Columns:
    """Selections of keys inside each segment; segment_of maps position -> segment id."""
    valid = indices[indices >= 0]
    segs, counts = _nonzero_counts(segment_of[valid])
    return {"segment": segs.astype(np.int32), "count": counts.astype(np.int64)}


def dsa_sink(positions: torch.Tensor, indices: torch.Tensor, sink_tokens: int) -> Columns:
    hits = ((indices >= 0) & (indices < sink_tokens)).any(-1)
    return {"position": np.array([int(positions[-1])], np.int32), "queries": np.array([len(positions)], np.int32),
            "sink_hits": np.array([int(hits.sum())], np.int32)}


def dsa_lists(positions: torch.Tensor, indices: torch.Tensor, scores: torch.Tensor | None,
              keep: torch.Tensor) -> Columns | None:
    """Full index lists of the kept queries (keep: [T] bool); -1 padding is dropped by the writer."""
    if not bool(keep.any()):
        return None
    cols: Columns = {"position": _np(positions[keep]).astype(np.int32),
                     "selected": _np(indices[keep]).astype(np.int32)}
    if scores is not None:
        s = scores[keep]
        cols["scores"] = _np(torch.where(torch.isfinite(s), s, torch.zeros_like(s))).astype(np.float32)
    return cols


def kda_rows(positions: torch.Tensor, stats: dict[str, torch.Tensor], keep: torch.Tensor) -> Columns | None:
    """Per-head state statistics [n, H] at the kept measurement positions."""
    if not bool(keep.any()):
        return None
    cols: Columns = {"position": _np(positions[keep]).astype(np.int32)}
    for name in ("norm", "max_abs", "mean_decay", "mean_beta"):
        if name in stats:
            cols[name] = _np(stats[name][keep].float()).astype(np.float16)
    return cols


def moe_counts(experts: torch.Tensor, segment_ids: torch.Tensor, modality_ids: torch.Tensor, num_experts: int,
               modalities: tuple[str, ...]) -> Columns:
    """Token slots per (segment, modality, expert). experts [T, k]; segment/modality ids [T]."""
    k = experts.shape[-1]
    seg = segment_ids.unsqueeze(-1).expand(-1, k)
    mod = modality_ids.unsqueeze(-1).expand(-1, k)
    key = (seg * len(modalities) + mod) * num_experts + experts
    keys, counts = _nonzero_counts(key)
    expert = keys % num_experts
    rest = keys // num_experts
    return {"segment": (rest // len(modalities)).astype(np.int32),
            "modality": np.array(modalities, dtype=object)[rest % len(modalities)],
            "expert": expert.astype(np.int16), "count": counts.astype(np.int64)}


def moe_rank_load(experts: torch.Tensor, num_experts: int, ep_world: int) -> Columns:
    """Token slots handled by each expert-parallel rank (contiguous expert ranges)."""
    per_rank = -(-num_experts // ep_world)
    ranks, counts = _nonzero_counts(torch.div(experts, per_rank, rounding_mode="floor"))
    return {"ep_rank": ranks.astype(np.int16), "tokens": counts.astype(np.int64)}


def moe_routes(positions: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, entropy: torch.Tensor | None,
               keep: torch.Tensor) -> Columns | None:
    if not bool(keep.any()):
        return None
    cols: Columns = {"position": _np(positions[keep]).astype(np.int32),
                     "experts": _np(experts[keep]).astype(np.int16),
                     "weights": _np(weights[keep].float()).astype(np.float16)}
    cols["entropy"] = (_np(entropy[keep].float()).astype(np.float32) if entropy is not None
                       else np.full(int(keep.sum()), np.nan, np.float32))
    return cols
