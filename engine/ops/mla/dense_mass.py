"""Dense-attention mass inside a sparse selection: how faithful DSA's top-k is, for a few queries.

For query t and head h with dense softmax probabilities p[t, h, s] over the keys s <= t (MLA in its
absorbed latent form, as in `engine.ops.mla.reference`), the mass inside the selected set is

    mass[t, h] = sum over selected keys s of p[t, h, s]          (1.0 = sparse reads lose nothing)

`topk_overlap` compares the selected set with the top-k keys of the dense probabilities (averaged
over heads): set IoU and recall of the dense top-k, asked for only when a listener wants them.

Only the sampled queries are scored ([B, n, H, S] for n queries over S keys: the caller keeps n
small), so no [T, T] tensor appears. Averaging over heads (and summing heads across tensor-parallel
ranks) is left to the caller.
"""

from __future__ import annotations

import torch


def dense_probs(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                w_kb: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense causal softmax probabilities of the sampled queries, `[B, n, H, S]` fp32 (arguments as
    in `dense_mass`)."""
    q_lat = torch.einsum("bthd,hdr->bthr", q_nope.float(), w_kb.float())  # [B, n, H, R]
    scores = (torch.einsum("bthr,bkr->bthk", q_lat, latent.float())
              + torch.einsum("bthd,bkd->bthk", q_rope.float(), k_rope.float())) * scale  # [B, n, H, S]
    keys = torch.arange(latent.shape[1], device=latent.device)
    scores = scores.masked_fill(keys > q_pos.to(keys.device)[None, :, None, None], float("-inf"))
    return torch.softmax(scores, dim=-1)


def mass_inside(probs: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """probs `[B, n, H, S]`, selected `[B, n, k]` (-1 = empty) -> `[B, n, H]` mass on the selected keys."""
    inside = probs.gather(-1, selected.clamp_min(0).unsqueeze(2).expand(-1, -1, probs.shape[2], -1))  # [B, n, H, k]
    return (inside * (selected >= 0).unsqueeze(2)).sum(-1)


def dense_mass(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
               w_kb: torch.Tensor, q_pos: torch.Tensor, selected: torch.Tensor, scale: float) -> torch.Tensor:
    """Share of each sampled query's dense softmax mass, per head, that falls on its selected keys.

    Args:
        q_nope (torch.Tensor): `[B, n, H, Dk]` no-position query parts of the sampled queries.
        q_rope (torch.Tensor): `[B, n, H, Dr]` their shared-key query parts.
        latent (torch.Tensor): `[B, S, R]` normalised latents of keys 0 .. S - 1.
        k_rope (torch.Tensor): `[B, S, Dr]` shared key parts.
        w_kb (torch.Tensor): `[H, Dk, R]` per-head key up-projection (absorbed into the query).
        q_pos (torch.Tensor): `[n]` int64 positions of the queries (keys after a query are masked).
        selected (torch.Tensor): `[B, n, k]` int64 selected key positions, -1 = empty slot.
        scale (float): softmax scale.

    Returns:
        `[B, n, H]` fp32: mass inside the selected set per head, in [0, 1].
    """
    return mass_inside(dense_probs(q_nope, q_rope, latent, k_rope, w_kb, q_pos, scale), selected)


def topk_overlap(mean_probs: torch.Tensor, q_pos: torch.Tensor, selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How well the indexer's set matches the dense top-k: (IoU `[B, n]`, recall `[B, n]`) fp32.

    Args:
        mean_probs (torch.Tensor): `[B, n, S]` dense probabilities averaged over heads.
        q_pos (torch.Tensor): `[n]` int64 query positions (query t sees keys 0..t).
        selected (torch.Tensor): `[B, n, k]` int64 indexer picks, -1 = empty slot.

    The dense set takes as many keys as the indexer picked (k = valid picks of that query, at
    most t + 1); recall is |dense top-k inside the selection| / k, IoU |A & B| / |A | B|.
    """
    B, n, S = mean_probs.shape
    valid = selected >= 0
    picks = valid.sum(-1)  # [B, n]
    width = selected.shape[-1]
    order = mean_probs.topk(min(width, S), dim=-1).indices  # [B, n, width] keys by dense probability
    rank_ok = torch.arange(order.shape[-1], device=order.device) < picks.unsqueeze(-1)  # first `picks` of them
    chosen = torch.zeros(B, n, S + 1, dtype=torch.bool, device=mean_probs.device)
    chosen.scatter_(-1, torch.where(valid, selected, S), True)
    both = (chosen[..., :S].gather(-1, order) & rank_ok).sum(-1).float()
    k = picks.float().clamp_min(1)
    return both / (2 * k - both), both / k
