"""Attention targets for copying: the DSA layers learn to attend from an answer to the fact it copies.

Why: the shipped demo model finds the needle (its last DSA layer selects the value's tokens for
every answer token) but gets the value's first digit wrong after link words it never saw, while
the later digits, copied token after token, are right. The language-model loss
reaches the attention that makes that first jump only through the one answer token it decides, and
weakly. Here every token that is a copy of an earlier one (an answer's value after the restated key,
a restated value in the document; `training.tasks.Sample.copies`) also gives its query row a direct
target: the position of the token it copies, in the last DSA layer's dense attention (the one that
copies, far more than the first DSA layer: training/README.md, "Why the design"; `layers="all"`
supervises every DSA layer).

The loss per (query row, key position) pair and layer is -log(mean over heads of the head's
attention probability on the key): a mixture over heads, so one head may specialise in copying
while the others keep their own jobs (a head that already attends gets most of the gradient).
Gradients reach the layer's query and key projections and, through the layer's input, the layers
below (which must mark the first digit after a key as the one to find). Only the pairs' query rows
are scored, so the largest tensor is [B, heads, pairs, T].
"""

from __future__ import annotations

import math

import torch

from engine.layers.mla import GatedMLA
from engine.model import KimiForCausalLM
from training.row_attention import row_attention_logp


def first_of_runs(pairs: torch.Tensor) -> torch.Tensor:
    """`pairs` [B, P, 2] with every pair that continues a copy (its (query - 1, key - 1) is a pair of the
    same row) set to -1: what is left is the jump to each copied run's first token."""
    out = pairs.clone()
    for b in range(pairs.shape[0]):
        have = {(int(q), int(k)) for q, k in pairs[b].tolist() if q >= 0}
        for i, (q, k) in enumerate(pairs[b].tolist()):
            if q >= 0 and (q - 1, k - 1) in have:
                out[b, i] = -1
    return out


def copy_attention_loss(module: GatedMLA, x: torch.Tensor, pairs: torch.Tensor,
                        heads: str = "mixture") -> tuple[torch.Tensor, float]:
    """(-log attention on each pair's key, averaged over pairs; the mean probability) of `module`'s
    dense attention for input `x` [B, T, D] and `pairs` [B, P, 2] (query row, key position; -1 rows
    are padding). `heads="mixture"`: the mean over heads' probabilities (the loss and the probability
    reported); `"best"`: the most attending head's, so only that head is pushed. The attention is
    recomputed from the module's own weights (`training.row_attention`)."""
    T = x.shape[1]
    valid = pairs[..., 0] >= 0                                                   # [B, P]
    keys = pairs[..., 1].clamp(0, T - 1)
    H = module.num_heads
    logp = row_attention_logp(module, x, pairs[..., 0].clamp(0, T - 1))
    at = logp.gather(-1, keys[:, None, :, None].expand(-1, H, -1, 1)).squeeze(-1)     # [B, H, P]
    mixture = torch.logsumexp(at, dim=1) - math.log(H) if heads == "mixture" else at.max(dim=1).values  # [B, P]
    n = valid.sum().clamp_min(1)
    loss = -(mixture * valid).sum() / n
    return loss, float((mixture.detach().exp() * valid).sum() / n)


class CopySupervision:
    """Forward pre-hooks on the last DSA layer (`layers="last"`) or every one (`"all"`); while `active`
    with `pairs` set, each forward adds one `copy_attention_loss` per layer to `losses` (and its mean
    probability to `mass`)."""

    def __init__(self, model: KimiForCausalLM, layers: str = "last", heads: str = "mixture",
                 first_only: bool = False) -> None:
        if layers not in ("last", "all"):
            raise ValueError(f"layers must be 'last' or 'all', got {layers!r}")
        if heads not in ("mixture", "best"):
            raise ValueError(f"heads must be 'mixture' or 'best', got {heads!r}")
        self.heads, self.first_only = heads, first_only
        dsa = [m for m in model.modules() if isinstance(m, GatedMLA) and m.indexer is not None]
        self.layers = dsa[-1:] if layers == "last" else dsa
        self.active = False
        self.pairs: torch.Tensor | None = None   # [B, P, 2]
        self.losses: list[torch.Tensor] = []
        self.mass: list[float] = []
        self._handles = [m.register_forward_pre_hook(self._hook) for m in self.layers]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _hook(self, module: GatedMLA, args: tuple) -> None:
        if not self.active or self.pairs is None or not bool((self.pairs[..., 0] >= 0).any()):
            return
        pairs = first_of_runs(self.pairs) if self.first_only else self.pairs
        with torch.enable_grad():
            loss, mass = copy_attention_loss(module, args[0], pairs.to(args[0].device), self.heads)
        self.losses.append(loss)
        self.mass.append(mass)

    def take(self) -> tuple[torch.Tensor | None, float]:
        """(sum of the collected losses, mean probability on the targets), and clear them."""
        if not self.losses:
            return None, float("nan")
        out, mass = torch.stack(self.losses).sum(), sum(self.mass) / len(self.mass)
        self.losses, self.mass = [], []
        return out, mass
