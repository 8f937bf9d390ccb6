"""Stacked expert matrices as the MoE ops read them: dense `[E, out, in]` or MXFP4-packed.

`take` reads the rows of some experts (the selected ones of a decode step) and `take_range` a
contiguous run of experts (a chunk of a prefill), dequantising only what is read.
"""

from __future__ import annotations

from typing import NamedTuple, Union

import torch

from engine.ops.mxfp4 import dequantize


class MXFP4(NamedTuple):
    """One stacked MXFP4 matrix: `packed` uint8 [E, out, in/2], `scale` uint8 [E, out, in/32]."""

    packed: torch.Tensor
    scale: torch.Tensor
    impl: str = "auto"  # kernel choice for the dequantisation (`RuntimeOptions.kernels`)


ExpertMatrix = Union[torch.Tensor, MXFP4]


def num_experts(w: ExpertMatrix) -> int:
    return (w.packed if isinstance(w, MXFP4) else w).shape[0]


def dense_bytes(w: ExpertMatrix, dtype: torch.dtype) -> int:
    """Bytes of the whole stack once dense in `dtype`."""
    if isinstance(w, MXFP4):
        e, out_f, half = w.packed.shape
        return e * out_f * 2 * half * torch.empty((), dtype=dtype).element_size()
    return w.numel() * torch.empty((), dtype=dtype).element_size()


def take(w: ExpertMatrix, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dense `[len(slots), out, in]` of the experts at `slots` (repeats allowed)."""
    if isinstance(w, MXFP4):
        return dequantize(w.packed[slots], w.scale[slots], dtype, impl=w.impl)
    return w[slots].to(dtype)


def take_range(w: ExpertMatrix, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Dense `[stop - start, out, in]` of experts [start, stop)."""
    if isinstance(w, MXFP4):
        return dequantize(w.packed[start:stop], w.scale[start:stop], dtype, impl=w.impl)
    return w[start:stop].to(dtype)
