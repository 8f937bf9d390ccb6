"""The DSA lightning indexer module (spec section 4, step 5): its weights and projections.

Queries come from the MLA query latent (`q_resid`), keys from the layer input; one 128-d key per
token is shared by all indexer heads and normalised by a LayerNorm with bias. Scoring and top-k
selection are in `engine.ops.dsa`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import DSAConfig


class IndexerKeyNorm(nn.Module):
    """LayerNorm with weight and bias, fp32 statistics (`indexer.k_norm`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), self.eps).to(x.dtype)


class Indexer(nn.Module):
    def __init__(self, dsa: DSAConfig, hidden: int, q_lora_rank: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = dsa.n_heads, dsa.head_dim, dsa.topk
        self.wq_b = nn.Linear(q_lora_rank, dsa.n_heads * dsa.head_dim, bias=False)
        self.wk = nn.Linear(hidden, dsa.head_dim, bias=False)
        self.k_norm = IndexerKeyNorm(dsa.head_dim, dsa.k_norm_eps)
        self.weights_proj = nn.Linear(hidden, dsa.n_heads, bias=False)

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden] -> indexer keys [B, T, Di]."""
        return self.keys_of(self.wk(x))

    def keys_of(self, projected: torch.Tensor) -> torch.Tensor:
        """`wk(x)` (computed with the layer's other projections) -> indexer keys [B, T, Di]."""
        return self.k_norm(projected)

    def queries(self, q_resid: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> queries [B, T, Hi, Di] and head weights [B, T, Hi] (scaled by Hi^-0.5)."""
        return self.queries_of(self.wq_b(q_resid), self.weights_proj(x))

    def queries_of(self, projected_q: torch.Tensor, projected_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`wq_b(q_resid)` and `weights_proj(x)` (computed by fused matmuls) -> as `queries`."""
        q = projected_q.unflatten(-1, (self.n_heads, self.head_dim))
        return q, projected_w.float() * self.n_heads ** -0.5
