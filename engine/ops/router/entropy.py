"""Entropy of a sigmoid router's choice: how spread out a token's preference over experts is.

The K3 router scores every expert independently (s_e = sigmoid(x . w_e)); normalised over all
experts, p_e = s_e / sum_j s_j is a distribution whose entropy -sum_e p_e log p_e is 0 when one
expert takes all and log(E) when the router has no preference.
"""

from __future__ import annotations

import torch


def router_entropy(scores: torch.Tensor) -> torch.Tensor:
    """scores `[N, E]` (sigmoid, > 0) -> `[N]` entropy in nats of the normalised scores (fp32 in, fp32 out)."""
    p = scores / scores.sum(-1, keepdim=True)
    # p log p -> 0 as p -> 0: the clamp only keeps log() finite for underflowed scores
    return -(p * p.clamp_min(1e-30).log()).sum(-1)
