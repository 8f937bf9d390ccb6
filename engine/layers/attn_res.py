"""Block Attention Residuals (spec section 2): a learned softmax over block residuals.

    V = stack(B_0 .. B_{n-1}, p)
    K = V / sqrt(mean(V^2) + eps)
    score_i = sum(K_i * norm.weight * proj.weight)
    out = softmax_i(score) . V              (fp32)

A mixing point has two checkpoint tensors: `*_res_norm.weight` [hidden] (a `ResNorm`, applied
inside `attn_res`) and `*_res_proj.weight` [1, hidden] (a bias-free `Linear(hidden, 1)`).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.hooks import HookPoint, through


def attn_res(prefix: torch.Tensor, blocks: list[torch.Tensor], norm_weight: torch.Tensor,
             proj_weight: torch.Tensor, eps: float, weights_hook: HookPoint | None = None,
             start: int | torch.Tensor = 0) -> torch.Tensor:
    """Mix `prefix` [..., D] with block residuals (each [..., D]); returns [..., D] in prefix's dtype.
    `weights_hook` sees (and may edit) the softmax weights as [..., n] (the blocks in order, then prefix)."""
    values = torch.stack([*blocks, prefix], dim=0).float()  # [n, ..., D]
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
    query = norm_weight.float() * proj_weight.float().reshape(-1)  # [D]
    probs = torch.softmax(keys @ query, dim=0)  # [n, ...]
    if weights_hook is not None and weights_hook.attached:
        probs = through(weights_hook, probs.movedim(0, -1), start).movedim(-1, 0)
    return (probs.unsqueeze(-1) * values).sum(0).to(prefix.dtype)


class ResNorm(nn.Module):
    """Holds `*_res_norm.weight` (the norm is applied inside `attn_res`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

