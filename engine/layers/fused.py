"""Projections that read the same input, run as one matmul (fewer, larger ops in decode).

A decode step of the demo model was ~155 tiny matmuls, each paying a fixed dispatch cost larger
than its arithmetic. `FusedLinears(a, b, c)` runs bias-free `nn.Linear`s that share their input
as one `F.linear` over their weights stacked along the output dimension, split afterwards.

The stacked weight is not a copy: it is built once (at the first no-grad call, or by
`refresh_fused` before a compiled step) and every source `weight` is then re-pointed at its rows
of it, so memory is unchanged, parameter names and `state_dict()` are the checkpoint's, and an
in-place update of a weight (`load_state_dict`, an optimizer step) updates the stack too. If a
weight stops being such a view (`model.to(...)`, `load_state_dict(assign=True)`), the pointer
check notices and the stack is rebuilt.

The stack is stored input-major (`[in, sum of out]` in memory, read through a transposed view):
`F.linear` then hands BLAS a plain `x @ W` whose weight rows are read in order: a decode step's
single row reads the weights at nearly twice the bandwidth of the out-major layout, and prefill is no
slower (figures in docs/benchmarks.md, 'Kernels and layers (CPU)').
The source weights are then strided views (`[out, in]`, strides `(1, sum of out)`). With grad enabled (training) the linears run one by one,
so gradients reach each parameter as before. Note for writers: the source weights share one
storage, so safetensors needs them copied apart before saving (`engine.weights.write` does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedLinears:
    """Bias-free `nn.Linear`s with one input, as one matmul when no gradient is needed."""

    def __init__(self, *linears: nn.Linear) -> None:
        if any(lin.bias is not None for lin in linears):
            raise ValueError("FusedLinears stacks bias-free linears only")
        self.linears = linears
        # the modules' parameter dicts: reading a weight through them skips nn.Module.__getattr__, whose
        # Python lookups dominated the per-step pointer check of a small model's decode step
        self._params = [lin._parameters for lin in linears]
        self.sizes = [lin.out_features for lin in linears]
        # [sum of out_features, in], a transposed view of an input-major buffer; the sources are views of it
        self.weight: torch.Tensor | None = None
        self._ptrs: tuple[int, ...] = ()

    @property
    def pointers(self) -> tuple[int, ...]:
        """Addresses of the source weights at the last rebuild."""
        return self._ptrs

    def current(self) -> bool:
        """Whether every source weight is still its view of `weight` (no rebuild needed)."""
        return self.weight is not None and tuple(p["weight"].data_ptr() for p in self._params) == self._ptrs

    def refresh(self) -> torch.Tensor:
        """The stacked weight, rebuilt (and the sources re-pointed at it) when a source moved."""
        if self.current():
            return self.weight  # type: ignore[return-value]
        weights = [lin.weight for lin in self.linears]
        # a normal tensor even when called under inference_mode: training may use these weights later
        with torch.inference_mode(False), torch.no_grad():
            stacked = torch.cat([w.detach().t() for w in weights], dim=1).contiguous().t()
            offset = 0
            for lin, n in zip(self.linears, self.sizes):
                lin.weight.data = stacked[offset: offset + n]
                offset += n
        if stacked.is_cuda:  # a CUDA graph reads it in place: keep its address
            torch._dynamo.mark_static_address(stacked)
        self.weight = stacked
        self._ptrs = tuple(lin.weight.data_ptr() for lin in self.linears)
        return stacked

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor] | tuple[torch.Tensor, ...]:
        """x [..., in] -> one output per linear, in order (views of one matmul's output)."""
        if torch.is_grad_enabled():
            return [lin(x) for lin in self.linears]
        # inside a compiled step the stack is read as is: `refresh_fused` ran on the host before it
        weight = self.weight if torch.compiler.is_compiling() else self.refresh()
        if weight is None:  # traced before any refresh: the separate matmuls
            return [lin(x) for lin in self.linears]
        return F.linear(x, weight).split(self.sizes, dim=-1)


def fused_groups(model: nn.Module) -> list[FusedLinears]:
    """Every `FusedLinears` held by a module of `model` (as a plain attribute)."""
    return [v for m in model.modules() for v in vars(m).values() if isinstance(v, FusedLinears)]


def refresh_fused(groups: list[FusedLinears]) -> None:
    """Rebuild the stacks whose sources moved (a pointer check each: cheap enough per step)."""
    for group in groups:
        group.refresh()
