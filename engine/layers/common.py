"""Small building blocks shared by the layers: norms, activations, the gated MLP.

- `RMSNorm` (fp32 statistics), `GatedRMSNorm` (KDA output: norm * weight * sigmoid(gate)).
- `situ` (K3's bounded SiLU pair) and `silu_mul` (Kimi-Linear), chosen by `activation(config)`.
- `l2norm` with fla's `x / sqrt(sum x^2 + eps)` form (not `max(norm, eps)`).
- `GatedMLP`: gate/up/down projections (gate and up as one matmul), used for the dense layer and the
  shared experts.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.layers.fused import FusedLinears


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, statistics in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * weight * sigmoid(gate), all in fp32 (the KDA output norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float() * torch.sigmoid(gate.float())).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU(g, u) = beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta), in fp32."""
    g, u = gate.float(), up.float()
    out = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return out.to(gate.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if (torch.is_grad_enabled() or torch.compiler.is_compiling() or up.dtype != gate.dtype
            or up.shape != gate.shape):
        return F.silu(gate) * up
    # the product written over silu's own output: a prefill's MLPs then hold one [T, F] buffer fewer
    # (autograd needs that output kept; a compiled graph fuses the two anyway; mixed dtypes or a
    # broadcast product need a new buffer)
    return F.silu(gate).mul_(up)


def activation(config: ModelConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The gated activation every MLP of `config` uses."""
    if config.hidden_act == "situ":
        beta, linear_beta = config.situ_beta, config.situ_linear_beta
        return lambda g, u: situ(g, u, beta, linear_beta)
    return silu_mul


class GatedMLP(nn.Module):
    """down(act(gate(x), up(x))): the dense layer-0 MLP and the shared experts."""

    def __init__(self, hidden: int, intermediate: int, act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = act
        # gate and up as one matmul; None when an owner fuses them with its own projections
        self.gate_up: FusedLinears | None = FusedLinears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down(self.gate_proj(x), self.up_proj(x))
        return self.down(*self.gate_up(x))

    def down(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """down_proj(act(gate, up)) from gate_proj(x) and up_proj(x) computed elsewhere."""
        return self.down_proj(self.act(gate, up))
