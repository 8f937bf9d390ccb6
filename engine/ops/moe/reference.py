"""Routed experts, the readable definition: one Python iteration per locally held expert.

    out[n] = sum_k w[n, k] * W2_e( act(W1_e x_n, W3_e x_n) ),  e = ids[n, k], over experts held here

This is the per-expert loop the engine ran before the grouped path (`engine.ops.moe.grouped`); it
syncs with the host (`.tolist()`, one slice per expert) and is kept as the oracle the grouped path
is tested against.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.ops.moe.weights import ExpertMatrix, take
from engine.ops.mxfp4 import reference as mxfp4

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def routed_experts_reference(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor,
                             w1: ExpertMatrix, w3: ExpertMatrix, w2: ExpertMatrix, act: Activation,
                             mxfp8: bool = False) -> torch.Tensor:
    """Sum of the routed experts held here, expert by expert.

    Args:
        h (torch.Tensor): expert inputs `[N, D]`.
        ids (torch.Tensor): global expert ids `[N, k]`.
        weights (torch.Tensor): route weights `[N, k]`.
        slot_of (torch.Tensor): global id -> local slot `[E_global]` int64, -1 for experts held elsewhere.
        w1, w3 (ExpertMatrix): gate / up `[E, F, D]`, dense or `MXFP4`; w2: down `[E, D, F]`.
        act: the gated activation `act(gate, up)`.
        mxfp8 (bool): round the GEMM inputs through MXFP8 (training-time activation format).

    Returns:
        `[N, D]` fp32; routes to experts held elsewhere contribute nothing.
    """
    N, k = ids.shape
    out = h.new_zeros(N, h.shape[-1], dtype=torch.float32)
    slots = slot_of[ids.flatten()]  # [N * k]
    for slot in sorted(set(slots[slots >= 0].tolist())):
        routes = (slots == slot).nonzero().flatten()
        tokens = routes // k
        x = h[tokens]  # [n, D]
        if mxfp8:
            x = mxfp4.fake_quantize_mxfp8(x)
        one = torch.tensor([slot], device=h.device)
        inner = act(x @ take(w1, one, x.dtype)[0].t(), x @ take(w3, one, x.dtype)[0].t())  # [n, F]
        if mxfp8:
            inner = mxfp4.fake_quantize_mxfp8(inner)
        y = inner @ take(w2, one, x.dtype)[0].t()  # [n, D]
        out.index_add_(0, tokens, y.float() * weights.flatten()[routes].unsqueeze(-1))
    return out
