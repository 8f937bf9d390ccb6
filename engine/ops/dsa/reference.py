"""DSA lightning indexer in pure PyTorch: blockwise scoring with a running top-k.

    I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s] * head_dim^-0.5)      for s <= pos(t)

and each query keeps the `topk` keys of largest I. Queries are processed in blocks and keys in
blocks; a block's scores are merged into the running top-k, so the largest tensor is
[B, q_block, max(key_block, topk)]: nothing is [T, T].

A query with fewer than `topk` visible keys keeps all of them; unused slots hold index -1 and
score -inf. Indices come back sorted by position (ascending), which recorders and the gather in
sparse attention both like.

Ties are common (relu makes every key whose head logits are all negative score exactly 0), and
an arbitrary tie-break would make the selection depend on how keys were blocked: chunked prefill
would then disagree with the full forward. So selection ranks by the exact pair (score, -position):
among equal scores the earlier key wins, whatever the blocking. The pair is packed into one int64
(order-preserving bits of the fp32 score above, the inverted position below) and top-k runs on it.
"""

from __future__ import annotations

import torch

# scores held at once: q_block * key_block * indexer heads (fp32) stays near 64 MB
_SCORE_BUDGET = 16 * 1024 * 1024


def _block_sizes(n_heads: int, topk: int, n_keys: int, q_block: int | None, key_block: int | None) -> tuple[int, int]:
    kb = key_block or max(topk, min(n_keys, 8192))
    qb = q_block or max(1, min(256, _SCORE_BUDGET // max(1, kb * n_heads)))
    return qb, kb


def indexer_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Index scores of every query against every given key.

    Args:
        q (torch.Tensor): `[B, Tq, Hi, D]` indexer queries.
        w (torch.Tensor): `[B, Tq, Hi]` head weights (already scaled by Hi^-0.5).
        k (torch.Tensor): `[B, Tk, D]` indexer keys.

    Returns:
        `[B, Tq, Tk]` fp32 scores (no causal mask).
    """
    scale = q.shape[-1] ** -0.5
    logits = torch.einsum("bqhd,bkd->bqhk", q.float(), k.float()) * scale
    return torch.einsum("bqhk,bqh->bqk", logits.relu_(), w.float())


def _rank_keys(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """fp32 scores [..., n] and key positions [n] -> int64 keys ordered by (score, -position)."""
    bits = (scores + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)  # monotone in the float
    return (ordered << 32) | (0xFFFFFFFF - positions)


def indexer_topk(
    q: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    q_pos: torch.Tensor,
    topk: int,
    *,
    q_block: int | None = None,
    key_block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k key positions per query, scored blockwise.

    Args:
        q (torch.Tensor): `[B, Tq, Hi, D]` indexer queries.
        w (torch.Tensor): `[B, Tq, Hi]` head weights.
        k (torch.Tensor): `[B, Tk, D]` indexer keys; key s sits at position s.
        q_pos (torch.Tensor): `[Tq]` positions of the queries (keys at <= pos are visible).
        topk (int): keys kept per query.

    Returns:
        idx `[B, Tq, topk]` int64 (ascending, -1 = empty) and scores `[B, Tq, topk]` fp32 (-inf = empty).
    """
    B, Tq, Hi, _ = q.shape
    Tk = k.shape[1]
    qb, kb = _block_sizes(Hi, topk, Tk, q_block, key_block)
    out_idx = torch.full((B, Tq, topk), -1, dtype=torch.long, device=q.device)
    out_score = torch.full((B, Tq, topk), float("-inf"), dtype=torch.float32, device=q.device)
    key_pos = torch.arange(Tk, device=q.device)
    for q0 in range(0, Tq, qb):
        q1 = min(Tq, q0 + qb)
        pos = q_pos[q0:q1]
        last = int(pos.max()) + 1  # keys beyond the last query position are never visible
        run_score = torch.full((B, q1 - q0, 0), float("-inf"), device=q.device)
        run_rank = torch.empty((B, q1 - q0, 0), dtype=torch.long, device=q.device)
        run_idx = torch.empty((B, q1 - q0, 0), dtype=torch.long, device=q.device)
        for k0 in range(0, last, kb):
            k1 = min(last, k0 + kb)
            s = indexer_scores(q[:, q0:q1], w[:, q0:q1], k[:, k0:k1])  # [B, qb, kb]
            visible = key_pos[k0:k1].unsqueeze(0) <= pos.unsqueeze(1)  # [qb, kb]
            s = s.masked_fill(~visible, float("-inf"))
            idx = key_pos[k0:k1].expand(B, q1 - q0, k1 - k0)
            run_score = torch.cat((run_score, s), dim=-1)
            run_rank = torch.cat((run_rank, _rank_keys(s, key_pos[k0:k1])), dim=-1)
            run_idx = torch.cat((run_idx, idx), dim=-1)
            if run_score.shape[-1] > topk:
                sel = run_rank.topk(topk, dim=-1).indices
                run_score, run_rank, run_idx = (t.gather(-1, sel) for t in (run_score, run_rank, run_idx))
        n = run_score.shape[-1]
        run_idx = run_idx.masked_fill(run_score == float("-inf"), -1)
        # ascending positions, empty slots (-1) last
        order = torch.where(run_idx < 0, torch.full_like(run_idx, Tk), run_idx).argsort(dim=-1)
        out_idx[:, q0:q1, :n] = run_idx.gather(-1, order)
        out_score[:, q0:q1, :n] = run_score.gather(-1, order)
    return out_idx, out_score
