"""Input-major weights for the decode step's one-row matmuls.

A decode step multiplies one row by each weight. With the weight stored `[out, in]` (nn.Linear's
layout) BLAS runs a transposed matrix-vector product; stored input-major (`[in, out]` in memory,
read through a transposed view, as `engine.layers.fused` stores its stacks) it runs a plain
`x @ W` over rows in order: faster for the lm_head and for projections with at least as many outputs
as inputs, slower for a wide-input down projection (figures in docs/benchmarks.md), hence the rule
below: only weights with at least as many outputs as inputs.

`InputMajorWeights(model)` picks the lm_head and the projections that only their own `forward`
reads (`NAMES`: output, gate and down projections; not `kv_b_proj`, whose weight MLA splits per
head) and re-lays them before the compiled step reads them. The parameters keep their names,
shapes and values (`state_dict()` unchanged, a non-contiguous view as the fused stacks' are), so
the eager forward computes the same function; `pointers` joins the step's guard key, so a weight
replaced afterwards (`model.to`, `load_state_dict(assign=True)`) is re-laid and its graph's
guards run again.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.fused import fused_groups

# projections read only through their module's forward (MLA's kv_b_proj is split per head: not here)
NAMES = ("o_proj", "f_b_proj", "g_b_proj", "down_proj")


class InputMajorWeights:
    """The decode step's one-row linears whose weights it keeps input-major (module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        fused = {id(lin) for group in fused_groups(model) for lin in group.linears}
        counts: dict[int, int] = {}
        for _, p in model.named_parameters(remove_duplicate=False):
            counts[id(p)] = counts.get(id(p), 0) + 1
        candidates = []
        head = getattr(model, "lm_head", None)
        if isinstance(head, nn.Linear):
            candidates.append(head)
        text = getattr(model, "model", None)
        if isinstance(text, nn.Module):
            candidates += [m for name, m in text.named_modules() if isinstance(m, nn.Linear)
                           and name.rsplit(".", 1)[-1] in NAMES]
        self._params = [lin._parameters for lin in candidates
                        if id(lin) not in fused and lin.in_features <= lin.out_features
                        and counts.get(id(lin.weight), 0) == 1]  # a tied weight stays as it is
        self._ptrs: tuple[int, ...] = ()

    @property
    def pointers(self) -> tuple[int, ...]:
        """Addresses of the weights as last laid out (part of the decode step's guard key)."""
        return self._ptrs

    def refresh(self) -> tuple[int, ...]:
        """Re-lay every weight not input-major yet (CPU only); the weights' addresses."""
        ptrs = tuple(p["weight"].data_ptr() for p in self._params)
        if ptrs == self._ptrs:
            return ptrs
        for params in self._params:
            w = params["weight"]
            if w.device.type != "cpu" or w.dim() != 2 or w.stride() == (1, w.shape[0]):
                continue
            # a normal tensor even under inference_mode, as engine.layers.fused's stacks: training may follow
            with torch.inference_mode(False), torch.no_grad():
                w.data = w.detach().t().contiguous().t()
        self._ptrs = tuple(p["weight"].data_ptr() for p in self._params)
        return self._ptrs

    def __len__(self) -> int:
        return len(self._params)
