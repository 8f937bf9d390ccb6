"""The decode step as one pure function with static shapes, and its compiled form.

`decode_forward(model, input_ids, state, start)` is the model forward for one token per row with
the first position `start` given as a device tensor: every MLA cache is read whole at its
capacity with invisible slots masked (`engine.ops.dsa.masked`, `engine.ops.mla.masked`), rows are
written in place at `start`, and nothing reads a device value on the host. So the step has the
same shapes at every token and `torch.compile(fullgraph=True)` traces it into one graph; on CUDA
it is captured as a CUDA graph (`mode="reduce-overhead"`).

`DecodeStep` owns what stays outside the step: the capacity (MLA caches grow in large steps, by
doubling from `MIN_CAPACITY`, before a step that would overflow; each new capacity is one
recompile), the input-id check, and the non-finite check on the logits (one reduction, read after
the step; sampling reads the logits anyway). The session uses it for decode when
`model.runtime.compile` resolves on and no probe listener is attached: probes are emitted by the
eager forward, whose selections are the same (tested), so a recorded session decodes eagerly.
Before each step it also rebuilds any stacked projection weight whose sources moved
(`engine.layers.fused`: the graph reads the stacks as they are). `BACKEND` is the compiler
(tests trace with "aot_eager" in seconds instead of inductor's minutes).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from engine.cache import MLACache, ModelState
from engine.errors import InputError
from engine.layers.fused import fused_groups, refresh_fused
from engine.numerics import nonfinite_error
from engine.parallel import comm
from engine.probes import probe_points

MIN_CAPACITY = 1024
# each (model, capacity) is one compiled graph of the same function: allow many before dynamo gives up
_RECOMPILE_LIMIT = 64


def decode_forward(model: torch.nn.Module, input_ids: torch.Tensor, state: ModelState,
                   start: torch.Tensor) -> torch.Tensor:
    """input_ids `[B, 1]` at position `start` (0-d int64 device tensor) -> logits `[B, 1, vocab]`.

    Writes the token's cache rows and rebinds the KDA states in `state`; `state.length` is left
    for the caller. Static shapes, no host synchronisation (see the module docstring).
    """
    hidden = model.model(input_ids, state, start=start)
    return comm.all_gather(model.lm_head(hidden), model.parallel, dim=-1, tag="lm_head")


def static_capacity(needed: int, topk: int = 0) -> int:
    """The capacity a decode step at `needed` rows runs with: doubling from MIN_CAPACITY, above top-k."""
    cap = MIN_CAPACITY
    while cap < needed or cap <= topk:
        cap *= 2
    return cap


# the compiler behind runtime.compile; tests swap in "aot_eager" (dynamo's and AOT autograd's
# tracing, no code generation: seconds instead of an inductor compile's minutes on a small CPU)
BACKEND = "inductor"


def compile_options(device: torch.device) -> dict:
    """Inductor options of the decode step. The generated wrapper's size, stride and alignment
    asserts on every input (~400: each weight, cache and state) cost ~1 ms per CPU step and
    check what dynamo's guards on the same tensors already checked. On CPU the wrapper that calls
    the step's ~300 kernels is generated as C++ (`cpp_wrapper`) instead of Python: measured on the
    demo preset at 1K, 13.3 -> 10.2 ms per token. On CUDA the step is a CUDA graph (what
    `mode="reduce-overhead"` sets), which replays the kernels without any wrapper."""
    options: dict = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
    if device.type == "cuda":
        options["triton.cudagraphs"] = True
    else:
        options["cpp_wrapper"] = True
    return options


def decode_mode(setting: bool | str, device: torch.device) -> str:
    """Resolve `runtime.compile` to "compiled", "static" (the static step, eager) or "off"."""
    if setting == "auto":
        return "compiled" if device.type == "cuda" else "off"
    if setting == "static":
        return "static"
    if not isinstance(setting, bool):
        raise ValueError(f"runtime.compile must be True, False, 'auto' or 'static', got {setting!r}")
    return "compiled" if setting else "off"


class DecodeStep:
    """The compiled decode step of one model (shared by its sessions: `DecodeStep.of(model)`).

    Attributes:
        compile_seconds: wall time of the calls that compiled (first step at each capacity).
        compiles: how many capacities were compiled.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._points = list(probe_points(model))
        self._fused = fused_groups(model)
        self._fns: dict[str, Callable] = {}  # compiled step per backend (BACKEND)
        self._capacities: set[tuple] = set()
        self.compile_seconds = 0.0
        self.compiles = 0

    @classmethod
    def of(cls, model: torch.nn.Module) -> "DecodeStep":
        step = getattr(model, "_decode_step", None)
        if step is None:
            step = cls(model)
            model._decode_step = step  # type: ignore[attr-defined]
        return step

    def mode(self, device: torch.device) -> str:
        """"compiled" or "static" when the step applies (switched on, no probe listener, no
        cross-rank debug checks), else "off" (the eager forward)."""
        model = self.model
        mode = decode_mode(model.runtime.compile, device)
        if mode == "off" or model.parallel.debug_checks or any(p.sink is not None for p in self._points):
            return "off"
        return mode

    def reserve(self, state: ModelState, needed: int) -> None:
        """Grow every MLA cache (outside the step) so that rows [0, needed) exist."""
        dsa = self.model.config.dsa
        cap = static_capacity(needed, dsa.topk if dsa is not None else 0)
        for layer in state.layers:
            if isinstance(layer, MLACache) and layer.capacity < cap:
                layer.reserve(cap)
                if layer.latent.is_cuda:  # the CUDA graph writes these in place: keep their addresses
                    for t in (layer.latent, layer.k_rope, layer.index_keys):
                        if t is not None:
                            torch._dynamo.mark_static_address(t)

    def _compiled(self, device: torch.device) -> Callable:
        fn = self._fns.get(BACKEND)
        if fn is None:
            import torch._dynamo

            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
            options = compile_options(device) if BACKEND == "inductor" else None
            fn = self._fns[BACKEND] = torch.compile(decode_forward, fullgraph=True, dynamic=False, backend=BACKEND,
                                                    options=options)
        return fn

    def __call__(self, ids: list[int], state: ModelState, device: torch.device, *, compiled: bool = True) -> torch.Tensor:
        """One decode step of token `ids` (one per row) at `state.length` -> logits `[B, 1, vocab]`;
        `compiled=False` runs the same static-shape function eagerly."""
        vocab = self.model.config.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise InputError(f"token ids {[i for i in ids if not 0 <= i < vocab][:8]} are outside the "
                             f"vocabulary [0, {vocab})")
        self.reserve(state, state.length + 1)
        x = torch.tensor(ids, dtype=torch.long).view(-1, 1).to(device)
        start = torch.tensor(state.length, dtype=torch.long).to(device)
        key = tuple(layer.capacity for layer in state.layers if isinstance(layer, MLACache)) + (x.shape[0],)
        fn = self._compiled(device) if compiled else decode_forward
        refresh_fused(self._fused)  # the compiled graph reads the stacked weights as they are
        t0 = time.perf_counter()
        logits = fn(self.model, x, state, start)
        if compiled and key not in self._capacities:
            self._capacities.add(key)
            self.compiles += 1
            self.compile_seconds += time.perf_counter() - t0
        if not bool(torch.isfinite(logits).all()):
            raise nonfinite_error(self.model, x, logits, state)
        return logits
