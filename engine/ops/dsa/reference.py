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
would then disagree with the full forward. So selection is exact and deterministic: the keys with
the largest scores, and among keys tied at the k-th score the earliest ones, whatever the blocking.
"""

from __future__ import annotations

import torch

# scores held at once: q_block * key_block * indexer heads (fp32) stays near 64 MB
_SCORE_BUDGET = 16 * 1024 * 1024


def _block_sizes(n_heads: int, topk: int, n_keys: int, q_block: int | None, key_block: int | None) -> tuple[int, int]:
    # wide key blocks: one selection per query over its whole context when it fits the budget
    kb = key_block or max(1, min(n_keys, max(2 * topk, 65536)))
    qb = q_block or max(1, min(1024, _SCORE_BUDGET // max(1, kb * (n_heads + 1))))
    return qb, kb


def _select(scores: torch.Tensor, positions: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the k best of each row: largest score, ties at the k-th score go to the earliest position.

    Args:
        scores: `[B, q, n]` fp32, -inf for invisible keys.
        positions: `[n]` or `[B, q, n]` key positions, ascending along the last dim.

    Returns:
        scores and positions `[B, q, k]` in ascending position order (-inf entries remain when a
        row has fewer than k visible keys; they are its latest positions).
    """
    positions = positions.expand_as(scores)
    vals, sel = scores.topk(k, dim=-1, sorted=False)
    kth = vals.amin(-1, keepdim=True)
    # topk's choice among keys tied at the k-th score is arbitrary: redo the rows that have surplus ties
    surplus = (scores >= kth).sum(-1) > k  # [B, q]
    idx = positions.gather(-1, sel)
    if bool(surplus.any()):
        rows = surplus.nonzero(as_tuple=True)
        s_rows, p_rows, t_rows = scores[rows], positions[rows], kth[rows]  # [r, n], [r, n], [r, 1]
        above, tied = s_rows > t_rows, s_rows == t_rows
        take = above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
        vals[rows] = s_rows[take].view(-1, k)
        idx[rows] = p_rows[take].view(-1, k)
    order = idx.argsort(dim=-1)
    return vals.gather(-1, order), idx.gather(-1, order)


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


def indexer_topk(
    q: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    q_pos: torch.Tensor,
    topk: int,
    *,
    q_block: int | None = None,
    key_block: int | None = None,
    key_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k key positions per query, scored blockwise.

    Args:
        q (torch.Tensor): `[B, Tq, Hi, D]` indexer queries.
        w (torch.Tensor): `[B, Tq, Hi]` head weights.
        k (torch.Tensor): `[B, Tk, D]` indexer keys; key s sits at position s.
        q_pos (torch.Tensor): `[Tq]` positions of the queries (keys at <= pos are visible).
        topk (int): keys kept per query.
        key_start (torch.Tensor, Optional): `[B]` first visible key of each row (left padding).

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
        run_idx = torch.empty((B, q1 - q0, 0), dtype=torch.long, device=q.device)
        for k0 in range(0, last, kb):
            k1 = min(last, k0 + kb)
            s = indexer_scores(q[:, q0:q1], w[:, q0:q1], k[:, k0:k1])  # [B, qb, kb]
            visible = key_pos[k0:k1].unsqueeze(0) <= pos.unsqueeze(1)  # [qb, kb]
            if key_start is not None:  # [B, qb, kb]
                visible = visible & (key_pos[k0:k1] >= key_start.view(-1, 1, 1))
            s = s.masked_fill(~visible, float("-inf"))
            # running set first: its positions all precede this block's, so ties keep favouring earlier keys
            run_score = torch.cat((run_score, s), dim=-1)
            run_idx = torch.cat((run_idx, key_pos[k0:k1].expand(B, q1 - q0, k1 - k0)), dim=-1)
            if run_score.shape[-1] > topk:
                run_score, run_idx = _select(run_score, run_idx, topk)
        n = run_score.shape[-1]
        # positions are ascending; invisible keys (-inf) are the latest ones, so empty slots end up last
        out_idx[:, q0:q1, :n] = run_idx.masked_fill(run_score == float("-inf"), -1)
        out_score[:, q0:q1, :n] = run_score
    return out_idx, out_score
