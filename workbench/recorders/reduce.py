"""Reductions from probe payloads to trace rows, computed where the data lives.

Every function takes the tensors a probe emitted (on the model's device) and returns a dict of
device tensors with fixed, data-independent shapes: counting is a dense `bincount` with a known
`minlength`, and which rows are kept is decided from positions on the CPU. So recording never
forces a device synchronisation inside the forward pass; the recorder copies the pending results
out (non-blocking) and turns them into Parquet rows when it flushes (`to_columns`).
"""

from __future__ import annotations

import numpy as np
import torch

Pending = dict[str, torch.Tensor]
DISTANCE_BINS = 64  # floor(log2(d + 1)) < 64 for any int64 distance


def dsa_key_counts(indices: torch.Tensor, bin_tokens: int, n_bins: int) -> Pending:
    """indices [T, k] (-1 = empty) -> selections per key bin (dense over n_bins)."""
    valid = indices >= 0
    bins = torch.div(indices.clamp_min(0), bin_tokens, rounding_mode="floor")
    counts = torch.bincount(bins.reshape(-1), weights=valid.reshape(-1).double(), minlength=n_bins)[:n_bins]
    return {"key_bin": torch.arange(n_bins, device=indices.device), "count": counts.long()}


def dsa_distance_hist(positions: torch.Tensor, indices: torch.Tensor) -> Pending:
    """Read distance d = query - key in log2 bins b = floor(log2(d + 1)); positions [T] on the device."""
    valid = indices >= 0
    d = (positions.unsqueeze(-1) - indices).clamp_min(0)
    b = torch.floor(torch.log2(d.double() + 1)).long()
    counts = torch.bincount(b.reshape(-1), weights=valid.reshape(-1).double(), minlength=DISTANCE_BINS)
    return {"log2_bin": torch.arange(DISTANCE_BINS, device=indices.device), "count": counts[:DISTANCE_BINS].long()}


def dsa_segment_totals(indices: torch.Tensor, segment_of: torch.Tensor, n_segments: int) -> Pending:
    """Selections of keys inside each segment; segment_of maps position -> segment id."""
    valid = indices >= 0
    seg = segment_of[indices.clamp_min(0)]
    counts = torch.bincount(seg.reshape(-1), weights=valid.reshape(-1).double(), minlength=n_segments)
    return {"segment": torch.arange(n_segments, device=indices.device), "count": counts[:n_segments].long()}


def dsa_sink(last_position: int, indices: torch.Tensor, sink_tokens: int) -> Pending:
    hits = ((indices >= 0) & (indices < sink_tokens)).any(-1)
    return {"position": torch.tensor([last_position]), "queries": torch.tensor([indices.shape[0]]),
            "sink_hits": hits.sum().reshape(1)}


def select_rows(keep: np.ndarray, **columns: torch.Tensor | None) -> Pending | None:
    """Rows `keep` (CPU indices) of every given [T, ...] tensor; None when nothing is kept."""
    if len(keep) == 0:
        return None
    out: Pending = {}
    for name, t in columns.items():
        if t is not None:
            out[name] = t[torch.as_tensor(keep, device=t.device)]
    return out


def moe_counts(experts: torch.Tensor, segment_ids: torch.Tensor, modality_ids: torch.Tensor, num_experts: int,
               n_segments: int, n_modalities: int) -> Pending:
    """Token slots per (segment, modality, expert), dense. experts [T, k]; segment/modality ids [T]."""
    k = experts.shape[-1]
    key = ((segment_ids * n_modalities + modality_ids).unsqueeze(-1).expand(-1, k) * num_experts + experts)
    size = n_segments * n_modalities * num_experts
    counts = torch.bincount(key.reshape(-1), minlength=size)[:size]
    flat = torch.arange(size, device=experts.device)
    rest = torch.div(flat, num_experts, rounding_mode="floor")
    return {"segment": torch.div(rest, n_modalities, rounding_mode="floor"), "modality": rest % n_modalities,
            "expert": flat % num_experts, "count": counts}


def moe_rank_load(experts: torch.Tensor, num_experts: int, ep_world: int) -> Pending:
    """Token slots handled by each expert-parallel rank (contiguous expert ranges)."""
    per_rank = -(-num_experts // ep_world)
    counts = torch.bincount(torch.div(experts, per_rank, rounding_mode="floor").reshape(-1), minlength=ep_world)
    return {"ep_rank": torch.arange(ep_world, device=experts.device), "tokens": counts[:ep_world]}


def to_columns(pending: Pending, drop_zero: str | None = None) -> dict:
    """Device tensors -> numpy columns (the copy happens here, at flush time); scalars stay scalars.
    With drop_zero, rows whose `drop_zero` column is 0 are dropped (dense counts -> sparse rows)."""
    cols = {name: t.detach().to("cpu").numpy() if isinstance(t, torch.Tensor) else t for name, t in pending.items()}
    if drop_zero is not None:
        nz = cols[drop_zero] != 0
        cols = {name: c[nz] if isinstance(c, np.ndarray) and c.ndim > 0 else c for name, c in cols.items()}
    return cols
