"""DSA lightning indexer: blockwise scoring with a running top-k (`indexer_topk`).

Scores come from the pure-torch reference, or on CUDA from the fused Triton kernel
(`triton_scores.py`, no [T, H, S] intermediate); selection is the same exact, deterministic top-k.
"""

from __future__ import annotations

import torch

from engine.ops.backend import use_triton
from engine.ops.dsa import reference

__all__ = ["indexer_topk"]


def indexer_topk(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, topk: int, *,
                 impl: str = "auto", **blocks) -> tuple[torch.Tensor, ...]:
    """See `reference.indexer_topk`; `impl` = "auto" (Triton scores on CUDA) or "reference"."""
    scorer = reference.indexer_scores
    if use_triton(q, impl):
        from engine.ops.dsa.triton_scores import indexer_scores as scorer
    return reference.indexer_topk(q, w, k, q_pos, topk, scorer=scorer, **blocks)
