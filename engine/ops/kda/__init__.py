"""KDA core: `kda_chunked` (prefill) and `kda_recurrent` (decode), same function.

Pure torch everywhere (`reference.py`); on CUDA, token-by-token decode runs the fused Triton kernel
(`triton_recurrent.py`), which keeps the state slice in registers across tokens.
"""

from __future__ import annotations

import torch

from engine.ops.backend import use_triton
from engine.ops.kda.reference import StateObserver, kda_chunked
from engine.ops.kda.reference import kda_recurrent as kda_recurrent_reference

__all__ = ["kda_chunked", "kda_recurrent"]


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: torch.Tensor | None = None, scale: float | None = None,
                  observe: StateObserver | None = None, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """See `reference.kda_recurrent`; `impl` = "auto" (Triton on CUDA) or "reference"."""
    # the kernel exposes only the final state: an observer of every token needs the reference
    if use_triton(q, impl) and (observe is None or q.shape[1] == 1):
        from engine.ops.kda.triton_recurrent import kda_recurrent as fused

        o, state = fused(q, k, v, g, beta, initial_state, scale)
        if observe is not None:
            observe(0, state)
        return o, state
    return kda_recurrent_reference(q, k, v, g, beta, initial_state, scale, observe=observe)
