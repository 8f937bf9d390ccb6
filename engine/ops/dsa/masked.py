"""DSA indexer top-k for the decode step: one masked pass over a static-size key buffer.

The decode step (`engine.decode.step`) keeps its caches at a fixed capacity, so the indexer scores
every slot of the buffer and masks the ones a query cannot see (later positions, slots not yet
written, left padding). Nothing depends on the data: no host synchronisation, no branch on the
scores, the same shapes at every step, so the step compiles into one graph (and one CUDA graph).

Selection equals `reference.indexer_topk` exactly: the largest scores, ties at the k-th score
going to the earliest positions. The reference repairs only the rows where a tie straddles the
k-th place (a host branch). Here one top-k over a 64-bit rank does it for every row: the high half
is an order-preserving integer image of the fp32 score, the low half `cap - 1 - position`, so the
largest ranks are the largest scores, earliest first among equal ones. One pass over the buffer
instead of two top-ks and a `where` (about twice as fast with the key-major buffer of `engine.cache`;
docs/benchmarks.md, 'Kernels and layers (CPU)').

On long buffers (at least PRUNE_MIN_RATIO * topk * PRUNE_BLOCK slots: 65,536 for top-256) the top-k
is taken among the slots of the best blocks (`pruned_top_slots`, exact), not over every slot's
rank. The choice is a shape fact, so a decode step compiled with a dynamic capacity compiles once
more when its cache first grows past that size (the demo preset: once, at 64K context).
"""

from __future__ import annotations

import torch

from engine.interventions import DsaRule
from engine.ops.dsa.reference import indexer_scores
from engine.ops.integrity import topk_ties


def masked_indexer_topk(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, topk: int, *,
                        key_start: torch.Tensor | None = None,
                        intervention: DsaRule | None = None, ties: bool = False) -> tuple[torch.Tensor, ...]:
    """Top-k key positions per query over the whole key buffer.

    Args:
        q (torch.Tensor): `[B, Tq, Hi, D]` indexer queries.
        w (torch.Tensor): `[B, Tq, Hi]` head weights.
        k (torch.Tensor): `[B, cap, D]` the key buffer; slot s holds position s (slots past the
            last query position are ignored whatever they hold). `cap` must exceed `topk`.
        q_pos (torch.Tensor): `[Tq]` query positions (a device tensor: no host value is read).
        topk (int): keys kept per query.
        key_start (torch.Tensor, Optional): `[B]` first visible key of each row (left padding).
        intervention (DsaRule, Optional): hidden (-inf) and pinned (+inf) key ranges (`engine.interventions`).
        ties (bool): also return the tie band at rank k and the part of it left out, `[B, Tq]` int64
            each (`engine.ops.integrity.topk_ties`, one compare over the scores already here).

    Returns:
        idx `[B, Tq, topk]` int64 (ascending, -1 = empty, empty slots last) and scores
        `[B, Tq, topk]` fp32 (-inf = empty), as `reference.indexer_topk` (with `ties`, band and cut).
    """
    cap = k.shape[1]
    if cap <= topk:
        raise ValueError(f"key buffer of {cap} slots must exceed top-k {topk} (reserve more capacity)")
    key_pos = torch.arange(cap, device=k.device)
    scores = indexer_scores(q, w, k)  # [B, Tq, cap]
    hidden = key_pos > q_pos.view(1, -1, 1)
    if key_start is not None:
        hidden = hidden | (key_pos < key_start.view(-1, 1, 1))
    if intervention is not None:
        hide, pin = intervention.key_masks(q_pos, key_pos)
        if pin is not None:
            scores = scores.masked_fill(pin, float("inf"))
        if hide is not None:
            hidden = hidden | hide
    scores = scores.masked_fill(hidden, float("-inf"))
    if cap % PRUNE_BLOCK == 0 and cap >= PRUNE_MIN_RATIO * topk * PRUNE_BLOCK:
        pick = pruned_top_slots(scores, topk)
    else:
        rank = score_rank(scores, key_pos)
        if k.device.type == "cpu" and cap % 2 == 0 and cap >= 2 * topk:
            # each half's top-k holds every global top-k member in it, and aten's CPU top-k runs the
            # two halves on two threads: faster with two threads, no slower with one (docs/benchmarks.md)
            rank = rank.unflatten(-1, (2, cap // 2)).topk(topk, dim=-1, sorted=False).values.flatten(-2)
        top = rank.topk(topk, dim=-1, sorted=False).values  # [B, Tq, topk]
        pick = (cap - 1) - (top & 0xFFFFFFFF)  # slots = positions
    vals = scores.gather(-1, pick)
    idx = pick.masked_fill(vals == float("-inf"), -1)
    # ascending positions, empty slots last (as the reference leaves them)
    order = torch.where(idx < 0, cap, idx).argsort(dim=-1)
    if ties:
        band, cut = topk_ties(scores, vals.amin(-1), vals)
        return idx.gather(-1, order), vals.gather(-1, order), band, cut
    return idx.gather(-1, order), vals.gather(-1, order)


# Block pruning before the top-k (`pruned_top_slots`): blocks of PRUNE_BLOCK slots, used when the
# buffer holds at least PRUNE_MIN_RATIO times the candidates it keeps (topk * PRUNE_BLOCK).
PRUNE_BLOCK = 64
PRUNE_MIN_RATIO = 4


def pruned_top_slots(scores: torch.Tensor, topk: int, block: int = PRUNE_BLOCK) -> torch.Tensor:
    """The slots of the `topk` largest scores (earliest first among equal ones), as a top-k over the
    64-bit rank of every slot would give them, found among the slots of the `topk` best blocks:
    `[..., cap]` fp32 scores (cap a multiple of `block`) -> `[..., topk]` slots, unordered.

    Exact. Blocks rank by (maximum score, earliest block first): for blocks whose maxima are equal,
    the earlier block's best slot is the earlier slot, so this orders blocks as their best slots'
    ranks do. If a top-k slot sat in a block outside the `topk` best, `topk` other blocks would hold
    a slot ranked above that block's best, hence above it: `topk` slots would beat a top-k slot.
    What it saves: a vectorised fp32 max over the buffer and top-ks over cap / block maxima and
    topk * block candidates, instead of an int64 rank of every slot and a top-k over all of them
    (at long context that selection would otherwise cost as much as the scoring matmul; figures in
    docs/benchmarks.md, 'Kernels and layers (CPU)')."""
    cap = scores.shape[-1]
    n_blocks = cap // block
    maxima = scores.unflatten(-1, (n_blocks, block)).amax(-1)  # [..., n_blocks]
    block_pos = torch.arange(n_blocks, device=scores.device)
    best = score_rank(maxima, block_pos).topk(topk, dim=-1, sorted=False).values
    best = (n_blocks - 1) - (best & 0xFFFFFFFF)  # block ids
    slots = (best.unsqueeze(-1) * block + torch.arange(block, device=scores.device)).flatten(-2)
    rank = score_rank(scores.gather(-1, slots), slots, cap)
    top = rank.topk(topk, dim=-1, sorted=False).values
    return (cap - 1) - (top & 0xFFFFFFFF)


def score_rank(scores: torch.Tensor, key_pos: torch.Tensor, cap: int | None = None) -> torch.Tensor:
    """int64 ranks ordered like (score descending, position ascending): `[..., n]` fp32 scores and their
    positions (`[n]`, or `[..., n]` like the scores; all < `cap` <= 2^32, default cap = n) -> `[..., n]`;
    equal scores (-0.0 and +0.0 included) tie on the score half, so the position decides."""
    cap = key_pos.shape[-1] if cap is None else cap
    bits = (scores + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    # negative floats order backwards as integers: flip their magnitude bits
    mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (mono.to(torch.int64) << 32) | (cap - 1 - key_pos)
