"""Dense latent MLA attention for the decode step: one masked pass over a static-size cache.

`reference.dense_attention_latent` skips key blocks past the last query by reading the query
positions on the host; the decode step keeps its caches at a fixed capacity and must not read
device values, so here every slot is scored and the invisible ones (later positions, unwritten
slots, left padding) are masked. Same function, static shapes (for K3, Kimi-Linear and
`runtime.dsa_force_dense`).
"""

from __future__ import annotations

import torch

from engine.interventions import DsaRule


def masked_attention_latent(q_lat: torch.Tensor, q_rope: torch.Tensor, c: torch.Tensor, k_r: torch.Tensor,
                            q_pos: torch.Tensor, scale: float, *,
                            key_start: torch.Tensor | None = None,
                            intervention: DsaRule | None = None) -> torch.Tensor:
    """Causal attention in latent space over the whole cache buffer.

    Args:
        q_lat (torch.Tensor): `[B, Tq, H, R]` queries with W_kb absorbed.
        q_rope (torch.Tensor): `[B, Tq, H, Dr]`.
        c (torch.Tensor): `[B, cap, R]` latents; slot s holds position s.
        k_r (torch.Tensor): `[B, cap, Dr]` shared key part.
        q_pos (torch.Tensor): `[Tq]` query positions (device tensor).
        key_start (torch.Tensor, Optional): `[B]` first visible key of each row.
        intervention (DsaRule, Optional): its hidden key ranges are masked out (`engine.interventions`).

    Returns:
        o_lat `[B, Tq, H, R]` fp32 (a query with no visible key gets zeros).
    """
    B, Tq, H, R = q_lat.shape
    cap = c.shape[1]
    # the latent and rope parts scored by two matmuls into one sum, not one over a concatenated key
    # buffer: the concatenation copied the whole cache every step (4.6K slots, 2 MLA layers: 5.3 MB each).
    # Scored cache-major (`c @ q^T`, [B, cap, rows], read back transposed): BLAS then streams the cache
    # rows in order; `q @ c^T` read the same bytes 1.7x slower (4.6K slots, cache cold, one thread)
    q_l = q_lat.float().flatten(1, 2) * scale  # [B, Tq * H, R]
    q_r = q_rope.float().flatten(1, 2) * scale  # [B, Tq * H, Dr]
    c = c.float()
    key_pos = torch.arange(cap, device=c.device)
    hidden = key_pos > q_pos.repeat_interleave(H).view(1, -1, 1)  # [1, Tq * H, cap]
    if key_start is not None:
        hidden = hidden | (key_pos < key_start.view(-1, 1, 1))
    if intervention is not None and intervention.hide is not None:
        hidden = hidden | intervention.key_masks(q_pos.repeat_interleave(H), key_pos)[0]
    s = torch.baddbmm(k_r.float() @ q_r.transpose(-1, -2), c, q_l.transpose(-1, -2)).transpose(-1, -2)
    s = s.masked_fill(hidden, float("-inf"))  # [B, Tq * H, cap]
    m = s.amax(-1, keepdim=True)
    p = (s - m.masked_fill(torch.isinf(m), 0.0)).exp()
    out = (p @ c) / p.sum(-1, keepdim=True).clamp_min(1e-30)
    return out.unflatten(1, (Tq, H))
