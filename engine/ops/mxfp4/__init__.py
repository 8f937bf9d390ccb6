"""MXFP4 expert dequantization: the format's pure-torch definition (`reference.py`) or, on
CUDA, the Triton kernel (`triton_dequant.py`). Both are exact in bf16 and fp32."""

from __future__ import annotations

import torch

from engine.ops.backend import use_triton
from engine.ops.mxfp4.reference import dequantize as dequantize_reference

__all__ = ["dequantize"]


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
               impl: str = "auto") -> torch.Tensor:
    """uint8 [..., out, in/2] + [..., out, in/32] -> dense [..., out, in] in `dtype`."""
    if use_triton(packed, impl):
        from engine.ops.mxfp4.triton_dequant import dequantize as kernel

        return kernel(packed, scale, dtype)
    return dequantize_reference(packed, scale, dtype)
