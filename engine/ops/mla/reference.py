"""Causal MLA attention over the latent cache in pure PyTorch (no [T, T] tensor anywhere).

The cache holds per token the normalised latent c [R] and the shared key part k_r [Dr]. Head h
sees key [W_kb[h] c, k_r] and value W_vb[h] c. Three equivalent ways to attend:

- `dense_attention_expanded`: expand keys/values once per call, then flash-style online softmax over
  key blocks (prefill: cheapest FLOPs when many queries read the same keys).
- `dense_attention_latent`: absorb W_kb into the query and attend in latent space, online softmax over
  key blocks (decode: reads R + Dr values per key instead of H * (Dk + Dv)).
- `sparse_attention_latent`: gather only the keys chosen by the DSA indexer, in latent space.

The latent forms return o_lat `[B, Tq, H, R]` (apply W_vb afterwards); the expanded form returns
`[B, Tq, H, Dv]`. Scores and softmax are fp32.
"""

from __future__ import annotations

import torch

_BLOCK_BUDGET = 8 * 1024 * 1024  # elements of one score or gather block (fp32: 32 MB)


def _online_softmax_step(scores, values_fn, m, l, acc):
    """Fold one key block into running (max, normaliser, accumulator). scores: [B, q, H, k]."""
    block_max = scores.amax(-1)  # [B, q, H]
    m_new = torch.maximum(m, block_max)
    # rows that have seen no visible key yet keep m = -inf; exp(-inf - -inf) would be NaN
    safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    p = (scores - safe.unsqueeze(-1)).exp()
    correction = (m - safe).exp()
    l = l * correction + p.sum(-1)
    acc = acc * correction.unsqueeze(-1) + values_fn(p)
    return m_new, l, acc


def dense_attention_expanded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
    *, key_block: int | None = None,
) -> torch.Tensor:
    """Causal attention with per-head keys and values.

    Args:
        q (torch.Tensor): `[B, Tq, H, Dk]`.
        k (torch.Tensor): `[B, Tk, H, Dk]`; key s sits at position s.
        v (torch.Tensor): `[B, Tk, H, Dv]`.
        q_pos (torch.Tensor): `[Tq]` query positions.

    Returns:
        `[B, Tq, H, Dv]` fp32.
    """
    B, Tq, H, _ = q.shape
    Tk, Dv = k.shape[1], v.shape[-1]
    kb = key_block or max(64, min(1024, _BLOCK_BUDGET // max(1, B * H * Tq)))
    qf = q.float() * scale
    m = q.new_full((B, Tq, H), float("-inf"), dtype=torch.float32)
    l = q.new_zeros((B, Tq, H), dtype=torch.float32)
    acc = q.new_zeros((B, Tq, H, Dv), dtype=torch.float32)
    last = int(q_pos.max()) + 1
    for k0 in range(0, min(Tk, last), kb):
        k1 = min(Tk, last, k0 + kb)
        s = torch.einsum("bqhd,bkhd->bqhk", qf, k[:, k0:k1].float())
        visible = torch.arange(k0, k1, device=q.device).unsqueeze(0) <= q_pos.unsqueeze(1)  # [Tq, kb]
        s = s.masked_fill(~visible[None, :, None, :], float("-inf"))
        vb = v[:, k0:k1].float()
        m, l, acc = _online_softmax_step(s, lambda p: torch.einsum("bqhk,bkhd->bqhd", p, vb), m, l, acc)
    return acc / l.unsqueeze(-1)


def dense_attention_latent(
    q_lat: torch.Tensor, q_rope: torch.Tensor, c: torch.Tensor, k_r: torch.Tensor, q_pos: torch.Tensor,
    scale: float, *, key_block: int | None = None,
) -> torch.Tensor:
    """Causal attention in latent space (W_kb absorbed into `q_lat`).

    Args:
        q_lat (torch.Tensor): `[B, Tq, H, R]`.
        q_rope (torch.Tensor): `[B, Tq, H, Dr]`.
        c (torch.Tensor): `[B, Tk, R]` normalised latents.
        k_r (torch.Tensor): `[B, Tk, Dr]` shared key part.
        q_pos (torch.Tensor): `[Tq]`.

    Returns:
        o_lat `[B, Tq, H, R]` fp32.
    """
    B, Tq, H, R = q_lat.shape
    Tk = c.shape[1]
    kb = key_block or max(64, min(4096, _BLOCK_BUDGET // max(1, B * H * Tq)))
    ql, qr = q_lat.float() * scale, q_rope.float() * scale
    m = ql.new_full((B, Tq, H), float("-inf"))
    l = ql.new_zeros((B, Tq, H))
    acc = ql.new_zeros((B, Tq, H, R))
    last = int(q_pos.max()) + 1
    for k0 in range(0, min(Tk, last), kb):
        k1 = min(Tk, last, k0 + kb)
        cb = c[:, k0:k1].float()
        s = torch.einsum("bqhr,bkr->bqhk", ql, cb) + torch.einsum("bqhd,bkd->bqhk", qr, k_r[:, k0:k1].float())
        visible = torch.arange(k0, k1, device=c.device).unsqueeze(0) <= q_pos.unsqueeze(1)
        s = s.masked_fill(~visible[None, :, None, :], float("-inf"))
        m, l, acc = _online_softmax_step(s, lambda p: torch.einsum("bqhk,bkr->bqhr", p, cb), m, l, acc)
    return acc / l.unsqueeze(-1)


def sparse_attention_latent(
    q_lat: torch.Tensor, q_rope: torch.Tensor, c: torch.Tensor, k_r: torch.Tensor, idx: torch.Tensor,
    scale: float, *, q_block: int | None = None,
) -> torch.Tensor:
    """Attention restricted to the selected keys of each query (DSA), in latent space.

    Args:
        q_lat, q_rope, c, k_r: as `dense_attention_latent`.
        idx (torch.Tensor): `[B, Tq, K]` selected key positions, -1 for empty slots. Every query must
            select at least one key (its own position is always visible).

    Returns:
        o_lat `[B, Tq, H, R]` fp32.
    """
    B, Tq, H, R = q_lat.shape
    K = idx.shape[-1]
    Dr = k_r.shape[-1]
    qb = q_block or max(1, min(Tq, _BLOCK_BUDGET // max(1, B * K * (R + Dr))))
    latents = torch.cat((c.float(), k_r.float()), dim=-1)  # [B, Tk, R + Dr]
    out = q_lat.new_empty((B, Tq, H, R), dtype=torch.float32)
    batch = torch.arange(B, device=c.device)[:, None, None]
    for q0 in range(0, Tq, qb):
        q1 = min(Tq, q0 + qb)
        sel = idx[:, q0:q1]  # [B, qb, K]
        empty = sel < 0
        rows = latents[batch, sel.clamp_min(0)]  # [B, qb, K, R + Dr]
        s = (torch.einsum("bqhr,bqkr->bqhk", q_lat[:, q0:q1].float(), rows[..., :R])
             + torch.einsum("bqhd,bqkd->bqhk", q_rope[:, q0:q1].float(), rows[..., R:])) * scale
        s = s.masked_fill(empty.unsqueeze(2), float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[:, q0:q1] = torch.einsum("bqhk,bqkr->bqhr", p, rows[..., :R])
    return out
