"""Which implementation an op runs: the Triton kernel (CUDA tensors, Triton importable) or the
pure-torch reference beside it. `impl` comes from `RuntimeOptions.kernels` ("auto" | "reference")."""

from __future__ import annotations

import functools

import torch

IMPLS = ("auto", "reference")


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(tensor: torch.Tensor, impl: str) -> bool:
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel implementation {impl!r}; choose one of {IMPLS}")
    return impl == "auto" and tensor.is_cuda and triton_available()
