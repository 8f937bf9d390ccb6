"""Routed experts without a Python loop over experts: two shapes of one computation.

- `gathered_experts` (decode: few routes): gather the selected experts' matrices (dequantising only
  those when they are MXFP4) and run one batched matmul per matrix. No sort, no host sync, static
  shapes: routes to experts held elsewhere (slot -1) compute against slot 0 and are masked out.
  Eager on the CPU with dense weights and no gradient, it instead reads each selected expert's
  matrices in place (the slots read on the host): the gather's copy cost more than the matmuls.
- `grouped_experts` (prefill: many routes): sort the routes by local slot once, then one grouped
  GEMM per matrix (`torch.nn.functional.grouped_mm`, offsets = cumulative route counts). Routes to
  experts held elsewhere sort after every local group, so the GEMM never computes them. MXFP4
  experts are dequantised in chunks of experts whose dense size fits `chunk_bytes`; one chunk
  (the usual case at demo size, and always for dense experts) needs no host sync, several need one
  (the chunk boundaries in rows) per call.

Both are differentiable for dense experts (gather, bmm and grouped_mm have autograd), so training
runs through the same code.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.ops.moe.weights import MXFP4, ExpertMatrix, num_experts, take, take_range
from engine.ops.mxfp4 import reference as mxfp4

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def sort_routes(ids: torch.Tensor, slot_of: torch.Tensor, num_local: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Order routes by local slot, experts held elsewhere last.

    Args:
        ids (torch.Tensor): global expert ids `[N, k]`.
        slot_of (torch.Tensor): global id -> local slot `[E_global]`, -1 when held elsewhere.
        num_local (int): experts held here (slots 0 .. num_local - 1).

    Returns:
        order `[N * k]` (flat route index of each sorted row), ends `[num_local]` int32 (cumulative
        route counts per slot: the grouped GEMM's offsets) and local `[N * k]` bool (sorted row
        belongs to a local expert).
    """
    slots = slot_of[ids.flatten()]
    key = torch.where(slots < 0, num_local, slots)  # [R]; num_local = "held elsewhere"
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, key, torch.ones_like(key))
    ends = counts.cumsum(0)[:num_local].to(torch.int32)
    return order, ends, key[order] < num_local


def _aligned(width: int, t: torch.Tensor) -> bool:
    """grouped_mm needs 16-byte aligned row strides (K and N of every operand)."""
    return width * t.element_size() % 16 == 0 and t.shape[-1] * t.element_size() % 16 == 0


def _grouped_mm_runs(x: torch.Tensor) -> bool:
    """torch's grouped GEMM: fp32/bf16/fp16 on CPU (not float64); bf16 on CUDA with SM >= 80 (its documented scope)."""
    if _grouped_mm is None:
        return False
    if x.is_cuda:
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 8
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _segment_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x [R, in] rows grouped by expert, w [E, out, in], ends [E] -> [R, out]; rows past ends[-1] unset."""
    if _grouped_mm_runs(x) and _aligned(x.shape[-1], x) and _aligned(w.shape[-2], w):
        return _grouped_mm(x, w.transpose(-2, -1), offs=ends)
    # other devices and dtypes, or rows that are not 16-byte multiples (odd test shapes): one host sync
    bounds = [0] + ends.tolist()
    out = x.new_zeros(x.shape[0], w.shape[-2])
    for e in range(w.shape[0]):
        out[bounds[e]:bounds[e + 1]] = x[bounds[e]:bounds[e + 1]] @ w[e].t()
    return out


def _mlp(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, ends: torch.Tensor,
         act: Activation, mxfp8: bool) -> torch.Tensor:
    inner = act(_segment_mm(x, w1, ends), _segment_mm(x, w3, ends))  # [R, F]
    if mxfp8:
        inner = mxfp4.fake_quantize_mxfp8(inner)
    return _segment_mm(inner, w2, ends)  # [R, D]


def _expert_dense_bytes(w: ExpertMatrix, dtype: torch.dtype) -> int:
    if isinstance(w, MXFP4):
        return w.packed[0].numel() * 2 * torch.empty((), dtype=dtype).element_size()
    return 0  # dense stacks are read in place


def grouped_experts(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor,
                    w1: ExpertMatrix, w3: ExpertMatrix, w2: ExpertMatrix, act: Activation,
                    mxfp8: bool = False, chunk_bytes: int = 256 * 2**20) -> torch.Tensor:
    """Sort once, grouped GEMMs. Same contract as `routed_experts_reference`."""
    N, k = ids.shape
    E = num_experts(w1)
    order, ends, local = sort_routes(ids, slot_of, E)
    # one process holds every expert (a shape fact, no sync): no route is remote, nothing to mask
    all_local = E == slot_of.numel()
    # [R, D] rows in expert order; the rows of remote experts are masked so that the GEMMs'
    # backward, which leaves their gradient rows unset, never reaches h
    token = order // k  # [R] token of each sorted row
    x = h.index_select(0, token)
    if not all_local:
        x = torch.where(local.unsqueeze(-1), x, 0)
    if mxfp8:
        x = mxfp4.fake_quantize_mxfp8(x)
    per_expert = sum(_expert_dense_bytes(w, h.dtype) for w in (w1, w3, w2))
    step = E if per_expert == 0 else max(1, min(E, chunk_bytes // per_expert))
    if step >= E:
        y = _mlp(x, take_range(w1, 0, E, h.dtype), take_range(w3, 0, E, h.dtype), take_range(w2, 0, E, h.dtype),
                 ends, act, mxfp8)
        if not all_local:
            y = torch.where(local.unsqueeze(-1), y, 0)  # rows of experts held elsewhere were never computed
    else:
        bounds = [0] + ends.tolist()  # one host sync: the rows of each chunk of experts
        parts = []
        for a in range(0, E, step):
            b = min(E, a + step)
            rows = slice(bounds[a], bounds[b])
            parts.append(_mlp(x[rows], take_range(w1, a, b, h.dtype), take_range(w3, a, b, h.dtype),
                              take_range(w2, a, b, h.dtype), ends[a:b] - bounds[a], act, mxfp8))
        parts.append(x.new_zeros(x.shape[0] - bounds[E], parts[0].shape[-1]))
        y = torch.cat(parts)
    del x  # the gathered inputs ([N * k, D], as large as y): not held while the rows are combined
    if h.device.type == "cpu":
        return add_into_tokens(y, order, weights, overwrite=not y.requires_grad)
    return gather_back(y, order, weights)


def add_into_tokens(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor,
                    overwrite: bool = False) -> torch.Tensor:
    """Combine sorted expert rows `y [N * k, D]` (row r is route `order[r]`) into `[N, D]` fp32:
    each row weighted and added into its token's row, in a fixed order (CPU). No [N, k, D] copy back
    in route order: 3x faster than `gather_back` at prefill sizes. `overwrite`: `y` (fp32) is the
    caller's own scratch and is weighted in place instead of into a copy of its size."""
    N, k = weights.shape
    scale = weights.flatten()[order].float().unsqueeze(-1)
    weighted = y.mul_(scale) if overwrite and y.dtype == torch.float32 else y.float() * scale
    return torch.zeros(N, y.shape[-1], dtype=torch.float32, device=y.device).index_add_(0, order // k, weighted)


def gather_back(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`add_into_tokens` by a gather back to route order and a sum over k: on GPUs, where index_add
    accumulates with atomics in no fixed order, this keeps a token's sum in route order, so the
    result does not vary from run to run."""
    N, k = weights.shape
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    routed = y[inverse].float().view(N, k, -1)  # [N, k, D]
    return (routed * weights.float().unsqueeze(-1)).sum(1)


def _reads_in_place(h: torch.Tensor, w1: ExpertMatrix, w3: ExpertMatrix, w2: ExpertMatrix, mxfp8: bool) -> bool:
    """Whether `gathered_experts` may read each selected expert's matrices in place: eager (not traced),
    on the CPU, dense weights, no gradient wanted. The gather copies every selected matrix before its
    batched matmul reads it again; in an eager CPU decode step that copy was most of the step (a
    random Kimi-Linear checkpoint at 4K: 4 experts x 3 matrices x 0.5 MB in each of 7 layers, ~60% of
    the step's CPU time). A compiled step fuses the gather into its matmul, and a GPU step must not
    read the slots on the host, so both keep the gather."""
    return (h.device.type == "cpu" and not mxfp8 and not torch.compiler.is_compiling()
            and all(isinstance(w, torch.Tensor) for w in (w1, w3, w2))
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (h, w1, w3, w2))))  # type: ignore[union-attr]


def _experts_in_place(h: torch.Tensor, k: int, slots: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                      w2: torch.Tensor, act: Activation) -> torch.Tensor:
    """`[R, D]` outputs of each route (row r is token r // k through expert slots[r]; zeros where the
    slot is -1), each expert's matrices read as views of its stack, once per expert over its rows."""
    routes: dict[int, list[int]] = {}
    for r, slot in enumerate(slots.tolist()):  # a host read: eager CPU only (`_reads_in_place`)
        if slot >= 0:
            routes.setdefault(slot, []).append(r)
    y = h.new_zeros(slots.shape[0], w2.shape[1])
    for slot, rows in routes.items():
        x = h[[r // k for r in rows]]  # [n, D]
        gate = torch.nn.functional.linear(x, w1[slot].to(h.dtype))
        up = torch.nn.functional.linear(x, w3[slot].to(h.dtype))
        y[rows] = torch.nn.functional.linear(act(gate, up), w2[slot].to(h.dtype))
    return y


def gathered_experts(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor,
                     w1: ExpertMatrix, w3: ExpertMatrix, w2: ExpertMatrix, act: Activation,
                     mxfp8: bool = False) -> torch.Tensor:
    """Gather only the selected experts, batched matmuls. Same contract as `routed_experts_reference`."""
    N, k = ids.shape
    slots = slot_of[ids.flatten()]  # [R]
    local = slots >= 0
    safe = slots.clamp_min(0)
    if mxfp8:
        h = mxfp4.fake_quantize_mxfp8(h)
    if _reads_in_place(h, w1, w3, w2, mxfp8):
        y = _experts_in_place(h, k, slots, w1, w3, w2, act).float()  # type: ignore[arg-type]
    else:
        x = h.unsqueeze(1).expand(N, k, h.shape[-1]).reshape(N * k, h.shape[-1], 1)  # [R, D, 1]
        inner = act(torch.bmm(take(w1, safe, h.dtype), x), torch.bmm(take(w3, safe, h.dtype), x))  # [R, F, 1]
        if mxfp8:
            inner = mxfp4.fake_quantize_mxfp8(inner.squeeze(-1)).unsqueeze(-1)
        y = torch.bmm(take(w2, safe, h.dtype), inner).squeeze(-1).float()  # [R, D]
    y = torch.where(local.unsqueeze(-1), y * weights.flatten().float().unsqueeze(-1), 0)
    return y.view(N, k, -1).sum(1)


def routed_experts(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor,
                   w1: ExpertMatrix, w3: ExpertMatrix, w2: ExpertMatrix, act: Activation,
                   mxfp8: bool = False, chunk_bytes: int = 256 * 2**20) -> torch.Tensor:
    """The routed-expert sum `[N, D]` fp32; gathers when there are fewer routes than local experts
    (reads only the selected experts), else sorts and runs grouped GEMMs. The choice depends on
    shapes only, so a compiled decode step never branches on data."""
    if ids.numel() < num_experts(w1):
        return gathered_experts(h, ids, weights, slot_of, w1, w3, w2, act, mxfp8)
    return grouped_experts(h, ids, weights, slot_of, w1, w3, w2, act, mxfp8, chunk_bytes)
