"""Where a training run computes: the device (`--device cpu|cuda|auto`) and its number format.

The trainable model is built and seeded on the CPU (the same initial weights on every device), then
moved; batches are drawn on the CPU (pure functions of (seed, step)) and moved per step, and saved
states hold host tensors (`training.state`), so a run may resume on another device.

On CUDA the forward runs under bf16 autocast: matmuls take bf16 inputs and accumulate in fp32 while
the weights, optimizer moments, losses and softmaxes stay fp32 (the engine's layers cast what they
need to fp32 themselves and run under autocast on the CPU too; `tests/training/test_gpu_run.py`).
`--precision fp32` keeps every matmul fp32 (TF32 allowed on CUDA) where bf16 is suspected of harm.
"""

from __future__ import annotations

import contextlib

import torch

DEVICES = ("cpu", "cuda", "auto")
PRECISIONS = ("auto", "bf16", "fp32")


def resolve_device(name: str) -> torch.device:
    """`cpu`, `cuda` or `auto` (CUDA when a device is visible, else the CPU) -> a torch device; `cuda`
    with no visible CUDA device is a clear error rather than a crash at the first tensor moved."""
    if name not in DEVICES:
        raise SystemExit(f"--device must be one of {DEVICES}, got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to torch "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'})")
    return torch.device(name)


def uses_bf16(device: torch.device, precision: str) -> bool:
    """Whether the forward runs under bf16 autocast: `auto` means on CUDA only (on a CPU bf16 matmuls
    are slower than fp32 ones)."""
    if precision not in PRECISIONS:
        raise SystemExit(f"--precision must be one of {PRECISIONS}, got {precision!r}")
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def prepare(device: torch.device) -> None:
    """Process-wide settings for training on `device`: TF32 matmuls on CUDA (fp32 weights keep their
    precision; only the products' inputs are rounded, as bf16 autocast rounds them further)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def autocast(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager:
    """The forward's number format: bf16 autocast on `device` when `bf16`, else nothing changes."""
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def describe(device: torch.device, bf16: bool) -> str:
    """`one NVIDIA H200 (CUDA, bf16 autocast)` or `a CPU (fp32)`: the hardware line of a run's record."""
    fmt = "bf16 autocast" if bf16 else "fp32"
    if device.type == "cuda":
        return f"one {torch.cuda.get_device_name(device)} (CUDA, {fmt})"
    return f"a CPU ({fmt})"


__all__ = ["DEVICES", "PRECISIONS", "autocast", "describe", "prepare", "resolve_device", "uses_bf16"]
