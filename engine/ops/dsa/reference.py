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

from typing import Callable

import torch

from engine.interventions import DsaRule
from engine.probes import Deferred

# scores held at once: q_block * key_block * indexer heads (fp32) stays near 64 MB
_SCORE_BUDGET = 16 * 1024 * 1024


def _block_sizes(n_heads: int, topk: int, n_keys: int, q_block: int | None, key_block: int | None) -> tuple[int, int]:
    # wide key blocks: one selection per query over its whole context when it fits the budget
    kb = key_block or max(1, min(n_keys, max(2 * topk, 65536)))
    qb = q_block or max(1, min(1024, _SCORE_BUDGET // max(1, kb * (n_heads + 1))))
    return qb, kb


def _select(scores: torch.Tensor, positions: torch.Tensor, k: int, ties: bool = False) -> tuple[torch.Tensor, ...]:
    """Keep the k best of each row: largest score, ties at the k-th score go to the earliest position.

    Args:
        scores: `[B, q, n]` fp32, -inf for invisible keys.
        positions: `[n]` or `[B, q, n]` key positions, ascending along the last dim.
        ties: also return the k-th score `[B, q]` and how many keys at the k-th score were left out `[B, q]`
            int64 (`engine.ops.integrity.topk_ties`' cut), or None for the cut when no row had a tie
            straddling the k-th place (then every key at the k-th score is in the selection: a cut of 0,
            and no op is spent on it).

    Returns:
        scores and positions `[B, q, k]` in ascending position order (-inf entries remain when a
        row has fewer than k visible keys; they are its latest positions); with `ties` also
        kth and the cut (or None).
    """
    positions = positions.expand_as(scores)
    # one extra candidate shows whether a tie straddles the k-th place (then topk's pick is arbitrary)
    vals, sel = scores.topk(k + 1, dim=-1)
    kth = vals[..., k - 1: k]
    surplus = (vals[..., k] == vals[..., k - 1])  # [B, q]
    vals, sel = vals[..., :k].contiguous(), sel[..., :k]
    idx = positions.gather(-1, sel)
    cut = None
    if bool(surplus.any()):
        # redo those rows exactly: every key above the k-th score outranks every tied key, and tied
        # keys rank by position (earliest first); one more top-k on that order picks the set
        rows = surplus.nonzero(as_tuple=True)
        s_rows, p_rows, t_rows = scores[rows], positions[rows], kth[rows]  # [r, n], [r, n], [r, 1]
        order_key = torch.where(s_rows > t_rows, torch.inf,
                                torch.where(s_rows == t_rows, -p_rows.float(), -torch.inf))
        pick = order_key.topk(k, dim=-1).indices
        vals[rows] = s_rows.gather(-1, pick)
        idx[rows] = p_rows.gather(-1, pick)
        if ties:  # these rows left keys at the k-th score out: the row's whole band less the selection's share
            cut = torch.zeros(surplus.shape, dtype=torch.long, device=scores.device)
            tied_kept = (vals[rows] == t_rows).sum(-1)
            cut[rows] = ((s_rows == t_rows).sum(-1) - tied_kept) * t_rows[:, 0].isfinite()
    order = idx.argsort(dim=-1)
    if ties:
        return vals.gather(-1, order), idx.gather(-1, order), kth[..., 0], cut
    return vals.gather(-1, order), idx.gather(-1, order)


def selection_tie_band(selected: torch.Tensor) -> torch.Tensor:
    """The selected scores `[B, q, k]` of full rows (-inf: empty slot) -> `[B, q]` int64: how many of them
    share the k-th (smallest) score; 0 where the k-th score is not finite (the row kept every visible key).
    With the keys a selection left out at that score (`_select`'s cut), the row's tie band at rank k."""
    kth = selected.amin(-1, keepdim=True)
    return (selected == kth).sum(-1) * kth[..., 0].isfinite()


def no_tie_cut(selected: torch.Tensor) -> torch.Tensor:
    """`[B, q, k]` -> `[B, q]` zeros (int64): no key at the k-th score was left out."""
    return torch.zeros(selected.shape[:-1], dtype=torch.long, device=selected.device)


def indexer_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Index scores of every query against every given key.

    Args:
        q (torch.Tensor): `[B, Tq, Hi, D]` indexer queries.
        w (torch.Tensor): `[B, Tq, Hi]` head weights (already scaled by Hi^-0.5).
        k (torch.Tensor): `[B, Tk, D]` indexer keys.

    Returns:
        `[B, Tq, Tk]` fp32 scores (no causal mask).
    """
    B, Tq, Hi, D = q.shape
    # heads folded into query rows: one [Tq * Hi, D] x [D, Tk] matmul, then a per-query weighted sum
    logits = (q.float().reshape(B, Tq * Hi, D) * D ** -0.5) @ k.float().transpose(1, 2)  # [B, Tq * Hi, Tk]
    logits.relu_()
    return (w.float().reshape(B * Tq, 1, Hi) @ logits.view(B * Tq, Hi, -1)).view(B, Tq, -1)


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
    scorer: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    intervention: DsaRule | None = None,
    ties: bool = False,
    defer_ties: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Top-k key positions per query, scored blockwise.

    Args:
        q (torch.Tensor): `[B, Tq, Hi, D]` indexer queries.
        w (torch.Tensor): `[B, Tq, Hi]` head weights.
        k (torch.Tensor): `[B, Tk, D]` indexer keys; key s sits at position s.
        q_pos (torch.Tensor): `[Tq]` positions of the queries (keys at <= pos are visible).
        topk (int): keys kept per query.
        key_start (torch.Tensor, Optional): `[B]` first visible key of each row (left padding).
        scorer (callable, Optional): computes a score block like `indexer_scores` (a fused kernel).
        intervention (DsaRule, Optional): key ranges hidden from the selection (score -inf) or pinned
            into it (score +inf), see `engine.interventions`.
        ties (bool): also return each query's tie band at rank k (`engine.ops.integrity.topk_ties`),
            counted as the blocks merge: a key dropped at a merge can only tie the final k-th score if
            the k-th score has not risen since, so the dropped ties are summed while it stays and reset
            when it rises (no second pass over the keys).
        defer_ties (bool): with `ties`, a call of one query block where no tie was cut (the common case)
            returns band and cut as `engine.probes.Deferred` of its selected scores (a decode step's
            listener that takes them counts many steps at once: no op per step).

    Returns:
        idx `[B, Tq, topk]` int64 (ascending, -1 = empty) and scores `[B, Tq, topk]` fp32 (-inf = empty);
        with `ties`, also band and cut `[B, Tq]` int64 (see `topk_ties`).
    """
    B, Tq, Hi, _ = q.shape
    Tk = k.shape[1]
    qb, kb = _block_sizes(Hi, topk, Tk, q_block, key_block)
    out_idx = torch.full((B, Tq, topk), -1, dtype=torch.long, device=q.device)
    out_score = torch.full((B, Tq, topk), float("-inf"), dtype=torch.float32, device=q.device)
    key_pos = torch.arange(Tk, device=q.device)
    bands: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # with `ties`: (q0, q1, band, cut) per query block
    for q0 in range(0, Tq, qb):
        q1 = min(Tq, q0 + qb)
        pos = q_pos[q0:q1]
        last = int(pos.max()) + 1  # keys beyond the last query position are never visible
        first = int(pos.min())
        run_score: torch.Tensor | None = None
        run_idx: torch.Tensor | None = None
        run_kth: torch.Tensor | None = None  # the k-th score after the last merge, and the ties it dropped
        dropped: torch.Tensor | None = None  # None: none so far
        selected = False
        for k0 in range(0, last, kb):
            k1 = min(last, k0 + kb)
            s = (scorer or indexer_scores)(q[:, q0:q1], w[:, q0:q1], k[:, k0:k1])  # [B, qb, kb]
            lo = max(first, k0)  # keys before the block's first query are visible to all of it
            if lo < k1:
                s[..., lo - k0:].masked_fill_(key_pos[lo:k1] > pos.unsqueeze(1), float("-inf"))
            if key_start is not None:
                hi = min(k1, int(key_start.max()))  # keys from here on are past every row's padding
                if hi > k0:
                    s[..., : hi - k0].masked_fill_((key_pos[k0:hi] < key_start.view(-1, 1, 1)), float("-inf"))
            if intervention is not None:
                hidden, pinned = intervention.key_masks(pos, key_pos[k0:k1])
                if pinned is not None:  # never a key the causal mask or the padding hides
                    s.masked_fill_(pinned & (s > float("-inf")), float("inf"))
                if hidden is not None:
                    s.masked_fill_(hidden, float("-inf"))
            if run_score is None:
                run_score, run_idx = s, key_pos[k0:k1]
            else:
                # running set first: its positions all precede this block's, so ties keep favouring earlier keys
                run_score = torch.cat((run_score, s), dim=-1)
                run_idx = torch.cat((run_idx, key_pos[k0:k1].expand(B, q1 - q0, k1 - k0)), dim=-1)
            if run_score.shape[-1] > topk and not ties:
                run_score, run_idx = _select(run_score, run_idx, topk)
            elif run_score.shape[-1] > topk:
                run_score, run_idx, kth, now = _select(run_score, run_idx, topk, ties=True)
                selected = True
                if dropped is not None:  # ties left out before stay counted while the k-th score stays
                    now = torch.zeros_like(dropped) if now is None else now
                    dropped = torch.where(kth == run_kth, dropped + now, now)
                else:
                    dropped = now
                run_kth = kth
            elif run_idx.dim() == 1:
                run_idx = run_idx.expand(B, q1 - q0, -1)
        assert run_score is not None and run_idx is not None
        n = run_score.shape[-1]
        # positions are ascending; invisible keys (-inf) are the latest ones, so empty slots end up last
        out_idx[:, q0:q1, :n] = run_idx.masked_fill(run_score == float("-inf"), -1)
        out_score[:, q0:q1, :n] = run_score
        if ties and selected:  # not selected: fewer keys than top-k, every visible key kept, no band
            bands.append((q0, q1, dropped))
    if intervention is not None and intervention.hide is not None:
        # hidden keys leave holes among the selected positions: empty slots go last again
        order = torch.where(out_idx < 0, Tk, out_idx).argsort(dim=-1)
        out_idx, out_score = out_idx.gather(-1, order), out_score.gather(-1, order)
    if not ties:
        return out_idx, out_score
    if len(bands) == 1 and bands[0][:2] == (0, Tq):  # one query block (a decode step): no zeros to fill in
        dropped = bands[0][2]
        if dropped is None and defer_ties:
            # nothing was cut: the band is the selection's own, which the recorder counts in bulk later
            return out_idx, out_score, Deferred(selection_tie_band, out_score), Deferred(no_tie_cut, out_score)
        band = selection_tie_band(out_score)
        return (out_idx, out_score, band, no_tie_cut(out_score)) if dropped is None else (
            out_idx, out_score, band + dropped, dropped)
    out_band = torch.zeros((B, Tq), dtype=torch.long, device=q.device)
    out_cut = torch.zeros((B, Tq), dtype=torch.long, device=q.device)
    for q0, q1, dropped in bands:
        out_band[:, q0:q1] = selection_tie_band(out_score[:, q0:q1])
        if dropped is not None:
            out_band[:, q0:q1] += dropped
            out_cut[:, q0:q1] = dropped
    return out_idx, out_score, out_band, out_cut
