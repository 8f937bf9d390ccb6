"""DSA indexer top-k for the decode step: one masked pass over a static-size key buffer.

The decode step (`engine.decode_step`) keeps its caches at a fixed capacity, so the indexer scores
every slot of the buffer and masks the ones a query cannot see (later positions, slots not yet
written, left padding). Nothing depends on the data: no host synchronisation, no branch on the
scores, the same shapes at every step, so the step compiles into one graph (and one CUDA graph).

Selection equals `reference.indexer_topk` exactly: the largest scores, ties at the k-th score
going to the earliest positions. The reference repairs only the rows where a tie straddles the
k-th place (a host branch); here every row takes the repair's second top-k, which on rows without
such a tie selects the same set.
"""

from __future__ import annotations

import torch

from engine.ops.dsa.reference import indexer_scores


def masked_indexer_topk(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, topk: int, *,
                        key_start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k key positions per query over the whole key buffer.

    Args:
        q (torch.Tensor): `[B, Tq, Hi, D]` indexer queries.
        w (torch.Tensor): `[B, Tq, Hi]` head weights.
        k (torch.Tensor): `[B, cap, D]` the key buffer; slot s holds position s (slots past the
            last query position are ignored whatever they hold). `cap` must exceed `topk`.
        q_pos (torch.Tensor): `[Tq]` query positions (a device tensor: no host value is read).
        topk (int): keys kept per query.
        key_start (torch.Tensor, Optional): `[B]` first visible key of each row (left padding).

    Returns:
        idx `[B, Tq, topk]` int64 (ascending, -1 = empty, empty slots last) and scores
        `[B, Tq, topk]` fp32 (-inf = empty), as `reference.indexer_topk`.
    """
    cap = k.shape[1]
    if cap <= topk:
        raise ValueError(f"key buffer of {cap} slots must exceed top-k {topk} (reserve more capacity)")
    key_pos = torch.arange(cap, device=k.device)
    scores = indexer_scores(q, w, k)  # [B, Tq, cap]
    hidden = key_pos > q_pos.view(1, -1, 1)
    if key_start is not None:
        hidden = hidden | (key_pos < key_start.view(-1, 1, 1))
    scores = scores.masked_fill(hidden, float("-inf"))
    kth = scores.topk(topk, dim=-1).values[..., topk - 1:]  # [B, Tq, 1]
    # every key above the k-th score outranks every tied key; tied keys rank earliest first
    order_key = torch.where(scores > kth, torch.inf,
                            torch.where(scores == kth, -key_pos.to(torch.float32), -torch.inf))
    pick = order_key.topk(topk, dim=-1).indices  # [B, Tq, topk] slots = positions
    vals = scores.gather(-1, pick)
    idx = pick.masked_fill(vals == float("-inf"), -1)
    # ascending positions, empty slots last (as the reference leaves them)
    order = torch.where(idx < 0, cap, idx).argsort(dim=-1)
    return idx.gather(-1, order), vals.gather(-1, order)
