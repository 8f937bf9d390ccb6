"""Causal MLA attention over the latent cache in pure PyTorch (no [T, T] tensor anywhere).

The cache holds per token the normalised latent c [R] and the shared key part k_r [Dr]. Head h
sees key [W_kb[h] c, k_r] and value W_vb[h] c. Three equivalent ways to attend:

- `dense_attention_expanded`: expand keys/values once per call, then flash-style online softmax over
  query blocks x key blocks, skipping key blocks that lie entirely in a query block's future
  (prefill: cheapest FLOPs when many queries read the same keys).
- `dense_attention_latent`: absorb W_kb into the query and attend in latent space, online softmax over
  key blocks (decode: reads R + Dr values per key instead of H * (Dk + Dv)).
- `sparse_attention_latent`: gather only the keys chosen by the DSA indexer, in latent space.

The latent forms return o_lat `[B, Tq, H, R]` (apply W_vb afterwards); the expanded form returns
`[B, Tq, H, Dv]`. Scores and softmax are fp32. Every block is one batched matmul: heads (or, in the
latent forms, query rows) lead so that no einsum has to permute a score block.
"""

from __future__ import annotations

import torch

from engine.interventions import DsaRule

_BLOCK_BUDGET = 8 * 1024 * 1024  # elements of one score or gather block (fp32: 32 MB)


def _online_softmax_step(
    scores: torch.Tensor, values: torch.Tensor, m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one key block into the running (max, normaliser, accumulator).

    Args:
        scores: `[..., n, kb]` fp32, masked keys at -inf.
        values: `[..., kb, Dv]` (broadcast over the leading dims).
        m, l: `[..., n, 1]` running max and normaliser; acc: `[..., n, Dv]`.
    """
    m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
    # rows that have seen no visible key yet keep m = -inf; exp(-inf - -inf) would be NaN
    safe = m_new.masked_fill(torch.isinf(m_new), 0.0)
    p = (scores - safe).exp_()
    correction = (m - safe).exp_()
    l = l * correction + p.sum(-1, keepdim=True)
    acc = acc * correction + p @ values
    return m_new, l, acc


def dense_attention_expanded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
    *, key_block: int | None = None, q_block: int | None = None, key_start: torch.Tensor | None = None,
    intervention: DsaRule | None = None,
) -> torch.Tensor:
    """Causal attention with per-head keys and values.

    Args:
        q (torch.Tensor): `[B, Tq, H, Dk]`.
        k (torch.Tensor): `[B, Tk, H, Dk]`; key s sits at position s.
        v (torch.Tensor): `[B, Tk, H, Dv]`.
        q_pos (torch.Tensor): `[Tq]` query positions (ascending).
        key_block, q_block (int, Optional): block sizes (a score block is [B, H, q_block, key_block]).
        key_start (torch.Tensor, Optional): `[B]` first visible key of each row (left padding);
            a query with no visible key gets a zero output.
        intervention (DsaRule, Optional): its hidden key ranges are masked out (`engine.interventions`).

    Returns:
        `[B, Tq, H, Dv]` fp32.
    """
    B, Tq, H, _ = q.shape
    Tk, Dv = k.shape[1], v.shape[-1]
    # 128 x 512 score tiles measured fastest on CPU (a tile stays in cache; larger ones do not pay)
    kb = key_block or 512
    qb = q_block or max(1, min(128, _BLOCK_BUDGET // max(1, B * H * kb)))
    # heads first, made contiguous once, so each block below is a plain batched matmul
    qh = (q.float() * scale).transpose(1, 2).contiguous()  # [B, H, Tq, Dk]
    kh = k.float().transpose(1, 2).contiguous()  # [B, H, Tk, Dk]
    vh = v.float().transpose(1, 2).contiguous()  # [B, H, Tk, Dv]
    key_pos = torch.arange(Tk, device=q.device)
    out = qh.new_empty(B, H, Tq, Dv)
    for q0 in range(0, Tq, qb):
        q1 = min(Tq, q0 + qb)
        pos = q_pos[q0:q1]
        first, last = int(pos.min()), min(Tk, int(pos.max()) + 1)
        m = qh.new_full((B, H, q1 - q0, 1), float("-inf"))
        l = qh.new_zeros((B, H, q1 - q0, 1))
        acc = qh.new_zeros((B, H, q1 - q0, Dv))
        # key blocks after the block's last query are never visible: causal attention skips them
        for k0 in range(0, last, kb):
            k1 = min(last, k0 + kb)
            s = qh[:, :, q0:q1] @ kh[:, :, k0:k1].transpose(-1, -2)  # [B, H, qb, kb]
            if k1 - 1 > first:  # only blocks reaching past some query's position need the mask
                s = s.masked_fill(key_pos[k0:k1] > pos.unsqueeze(-1), float("-inf"))
            if key_start is not None:
                s = s.masked_fill((key_pos[k0:k1] < key_start.unsqueeze(-1))[:, None, None, :], float("-inf"))
            if intervention is not None and intervention.hide is not None:
                s = s.masked_fill(intervention.key_masks(pos, key_pos[k0:k1])[0], float("-inf"))
            m, l, acc = _online_softmax_step(s, vh[:, :, k0:k1], m, l, acc)
        out[:, :, q0:q1] = acc / l.clamp_min(1e-30)  # l = 0 only for rows with no visible key (padding)
    return out.transpose(1, 2)


def dense_attention_latent(
    q_lat: torch.Tensor, q_rope: torch.Tensor, c: torch.Tensor, k_r: torch.Tensor, q_pos: torch.Tensor,
    scale: float, *, key_block: int | None = None, key_start: torch.Tensor | None = None,
    intervention: DsaRule | None = None,
) -> torch.Tensor:
    """Causal attention in latent space (W_kb absorbed into `q_lat`).

    Args:
        q_lat (torch.Tensor): `[B, Tq, H, R]`.
        q_rope (torch.Tensor): `[B, Tq, H, Dr]`.
        c (torch.Tensor): `[B, Tk, R]` normalised latents.
        k_r (torch.Tensor): `[B, Tk, Dr]` shared key part.
        q_pos (torch.Tensor): `[Tq]`.
        key_start (torch.Tensor, Optional): `[B]` first visible key of each row (left padding).
        intervention (DsaRule, Optional): its hidden key ranges are masked out (`engine.interventions`).

    Returns:
        o_lat `[B, Tq, H, R]` fp32.
    """
    B, Tq, H, R = q_lat.shape
    Tk = c.shape[1]
    kb = key_block or max(64, min(4096, _BLOCK_BUDGET // max(1, B * H * Tq)))
    # every head reads the same latent key, so heads fold into query rows [B, Tq * H, R] / [.., Dr].
    # The latent and rope parts are scored by two matmuls into one sum over views of the cache: a key
    # buffer concatenated from them copied the whole cache on every call (eager decode at 4K: 5 MB per
    # MLA layer per token). Scored cache-major (`c @ q^T`, read back transposed) so that BLAS streams
    # the cache rows in order, as `masked.masked_attention_latent` does.
    q_l = (q_lat.float() * scale).flatten(1, 2).transpose(-1, -2)  # [B, R, Tq * H]
    q_r = (q_rope.float() * scale).flatten(1, 2).transpose(-1, -2)  # [B, Dr, Tq * H]
    c, k_r = c.float(), k_r.float()  # no copy when the cache is fp32
    row_pos = q_pos.repeat_interleave(H)  # [Tq * H]
    key_pos = torch.arange(Tk, device=c.device)
    m = q_l.new_full((B, Tq * H, 1), float("-inf"))
    l = q_l.new_zeros((B, Tq * H, 1))
    acc = q_l.new_zeros((B, Tq * H, R))
    first, last = int(q_pos.min()), min(Tk, int(q_pos.max()) + 1)
    # a tail of at most an eighth of a block joins the block before it: a decode step at 4,097 keys
    # read 4,096 + 1, and the one-key block cost a whole online-softmax step (8% of the call)
    edges = [*range(0, last, kb), last]
    if len(edges) > 2 and last - edges[-2] <= kb // 8:
        del edges[-2]
    for k0, k1 in zip(edges[:-1], edges[1:]):
        block = c[:, k0:k1]  # [B, k1 - k0, R], a view
        s = torch.baddbmm(k_r[:, k0:k1] @ q_r, block, q_l).transpose(-1, -2)  # [B, Tq * H, kb]
        if k1 - 1 > first:
            s = s.masked_fill(key_pos[k0:k1] > row_pos.unsqueeze(-1), float("-inf"))
        if key_start is not None:
            s = s.masked_fill((key_pos[k0:k1] < key_start.unsqueeze(-1)).unsqueeze(1), float("-inf"))
        if intervention is not None and intervention.hide is not None:
            s = s.masked_fill(intervention.key_masks(row_pos, key_pos[k0:k1])[0], float("-inf"))
        m, l, acc = _online_softmax_step(s, block, m, l, acc)
    return (acc / l.clamp_min(1e-30)).unflatten(1, (Tq, H))


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
    q_all = torch.cat((q_lat.float(), q_rope.float()), dim=-1) * scale  # [B, Tq, H, R + Dr]
    out = q_lat.new_empty((B, Tq, H, R), dtype=torch.float32)
    batch = torch.arange(B, device=c.device)[:, None, None]
    for q0 in range(0, Tq, qb):
        q1 = min(Tq, q0 + qb)
        sel = idx[:, q0:q1]  # [B, qb, K]
        safe = sel.clamp_min(0)
        # gather only the selected rows (never copy the whole cache): [B, qb, K, R + Dr]
        rows = torch.cat((c[batch, safe].float(), k_r[batch, safe].float()), dim=-1)
        s = q_all[:, q0:q1] @ rows.transpose(-1, -2)  # [B, qb, H, K]
        # a large finite mask: a padding query with no selected key gets a finite (ignored) output
        s = s.masked_fill((sel < 0).unsqueeze(2), -1e30)
        out[:, q0:q1] = torch.softmax(s, dim=-1) @ rows[..., :R]
    return out
