"""The decode step as one pure function with static shapes, and its compiled form.

`decode_forward(model, input_ids, state, start)` is the model forward for one token per row with
the first position `start` given as a device tensor: every MLA cache is read whole at its
capacity with invisible slots masked (`engine.ops.dsa.masked`, `engine.ops.mla.masked`), rows are
written in place at `start`, and nothing reads a device value on the host. So the step has the
same shapes at every token and `torch.compile(fullgraph=True)` traces it into one graph; on CUDA
it is captured as a CUDA graph (`mode="reduce-overhead"`).

`DecodeStep` owns what stays outside the step: the capacity (MLA caches grow before a step that
would overflow, in steps of an eighth of the power of two below the context, so the indexer scans
at most 12.5% of slots beyond it; by doubling on CUDA; the capacity dimension is compiled
symbolic, so growing does not recompile), the input-id check, and the non-finite check on the
logits (one reduction, read after the step; sampling reads the logits anyway). Dynamo's guards on
the step's ~400 inputs cost about a millisecond per token on a CPU; they run in full for every new
`DecodeStep._guard_key` (capacity, batch, dtypes, devices, runtime switches, grad mode, listeners,
fused and kept expert stacks) until a step of that key compiles nothing new, and are skipped after
it (`skip_guard_eval_unsafe`): the key names everything the step's inputs can change in. The
session uses it for decode when
`model.runtime.compile` resolves on. Listening probe points collect inside the step
(`ProbePoint.collecting`: their tensors become graph outputs, packed into one buffer per dtype with a
constant layout, `decode_forward_probed`) and are kept after it, with positions known on the host, on the model's
`ProbeTape` (one record per step, delivered in bulk to each point's sink: `engine.decode.probe_tape`);
a step whose listener asks for a field declared `eager` (measured with host decisions inside the
layer: the KDA effective rank, half-lives) runs the eager forward.
Before each step it also rebuilds any stacked projection weight whose sources moved
(`engine.layers.fused`: the graph reads the stacks as they are) and keeps the lm_head and the
one-row output projections input-major (`engine.decode.layouts`). `BACKEND` is the compiler
(tests trace with "aot_eager" in seconds instead of inductor's minutes).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from engine.cache import KDAState, MLACache, ModelState
from engine.errors import InputError
from engine.heap import release_free_heap
from engine.hooks import any_attached, hook_points
from engine.layers.fused import fused_groups, refresh_fused
from engine.layers.moe import RoutedExperts
from engine.numerics import all_finite, nonfinite_error
from engine.parallel import comm
from engine.decode.layouts import InputMajorWeights
from engine.decode.probe_tape import Layout, ProbeTape, collected_payloads
from engine.probes import ProbePoint

MIN_CAPACITY = 1024
# each (model, batch, dtype, listener set) is one compiled graph of the same function: allow many
_RECOMPILE_LIMIT = 64


def _inference_states(state: ModelState) -> None:
    """Make every KDA state an inference tensor (the step rebinds them to ones it made under
    `inference_mode`): a state set from outside (a loaded snapshot, a test) would otherwise differ in
    its dispatch keys from the step's own and compile the step a second time."""
    for layer in state.layers:
        if isinstance(layer, KDAState) and not (layer.recurrent.is_inference() and layer.conv.is_inference()):
            with torch.inference_mode():
                layer.recurrent, layer.conv = layer.recurrent.clone(), layer.conv.clone()


def _compiled_frames() -> int:
    """Frames dynamo compiled so far in this process (a step that raised it compiled)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def decode_forward(model: torch.nn.Module, input_ids: torch.Tensor, state: ModelState,
                   start: torch.Tensor) -> torch.Tensor:
    """input_ids `[B, 1]` at position `start` (0-d int64 device tensor) -> logits `[B, 1, vocab]`.

    Writes the token's cache rows and rebinds the KDA states in `state`; `state.length` is left
    for the caller. Static shapes, no host synchronisation (see the module docstring).
    """
    hidden = model.model(input_ids, state, start=start)
    return comm.all_gather(model.lm_head(hidden), model.parallel, dim=-1, tag="lm_head")


def decode_forward_probed(model: torch.nn.Module, input_ids: torch.Tensor, state: ModelState, start: torch.Tensor,
                          points: tuple[ProbePoint, ...]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], Layout]:
    """`decode_forward`, and what the collecting `points` kept, packed into one buffer per dtype with its
    layout (`engine.decode.probe_tape.collected_payloads`; a constant of the compiled graph)."""
    logits = decode_forward(model, input_ids, state, start)
    buffers, layout = collected_payloads(points)
    return logits, buffers, layout


def static_capacity(needed: int, topk: int = 0, *, doubling: bool = False) -> int:
    """The capacity a decode step at `needed` rows runs with: above top-k, at least MIN_CAPACITY, a
    multiple of an eighth of the power of two at or below it (131,073 rows -> 147,456 slots), or with
    `doubling` the next power of two (CUDA: each capacity is one more recorded CUDA graph and its
    memory pool, so there capacities are few rather than tight)."""
    need = max(needed, topk + 1, MIN_CAPACITY)
    if doubling:
        return max(MIN_CAPACITY, 1 << (need - 1).bit_length())
    step = max(MIN_CAPACITY, 1 << (need.bit_length() - 4))
    return -(-need // step) * step


# the compiler behind runtime.compile; tests swap in "aot_eager" (dynamo's and AOT autograd's
# tracing, no code generation: seconds instead of an inductor compile's minutes on a small CPU)
BACKEND = "inductor"


def compile_options(device: torch.device) -> dict:
    """Inductor options of the decode step. The generated wrapper's size, stride and alignment
    asserts on every input (each weight, cache and state) cost a visible share of a CPU step and
    check what dynamo's guards on the same tensors already checked. On CPU the wrapper that calls
    the step's ~300 kernels is generated as C++ (`cpp_wrapper`) instead of Python, a quarter less
    time per token on the demo preset (docs/benchmarks.md). On CUDA the step is a CUDA graph (what
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
        compile_seconds: wall time of the calls that compiled.
        compiles: how many graphs were compiled (one for every capacity, unless batch or dtypes change).
        steps: decode steps run (compiled or static).
        copy_out: copy what listeners collected off the step's outputs before handing it on (always on
            CUDA, where the next CUDA graph replay overwrites them; tests set it on the CPU).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._points = tuple(p for m in model.modules() for p in vars(m).values() if isinstance(p, ProbePoint))
        # points whose collected tensors their module completes on the host (`host_finished_probes`)
        finishers = {p: m.finish_probe for m in model.modules() for p in getattr(m, "host_finished_probes", ())}
        self.tape = ProbeTape(self._points, finishers)
        self._listener_sets: dict[tuple[int, ...], tuple[ProbePoint, ...]] = {}  # ids -> the tuple passed
        self._fused = fused_groups(model)
        self._input_major = InputMajorWeights(model)  # one-row matmuls over input-major weights
        self._experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
        self._hook_points = tuple(hook_points(model).values())  # a hooked step runs eagerly (engine.hooks)
        self._fns: dict[str, Callable] = {}  # compiled step per backend (BACKEND)
        self._checked: set[tuple] = set()  # guard keys whose first step ran with every guard
        self.compile_seconds = 0.0
        self.compiles = 0
        self.steps = 0
        self.copy_out = False

    @classmethod
    def of(cls, model: torch.nn.Module) -> "DecodeStep":
        step = getattr(model, "_decode_step", None)
        if step is None:
            step = cls(model)
            model._decode_step = step  # type: ignore[attr-defined]
        return step

    def mode(self, device: torch.device) -> str:
        """"compiled" or "static" when the step applies (switched on, no cross-rank debug checks, every
        listener's request collectable), else "off" (the eager forward)."""
        model = self.model
        mode = decode_mode(model.runtime.compile, device)
        if mode == "off" or model.parallel.debug_checks:
            return "off"
        if any(p.sink is not None and p.request.optional & p.signal.eager for p in self._points):
            return "off"  # a listener asks for a field only the eager forward measures (`Field.eager`)
        if any_attached(self._hook_points):
            return "off"  # hooks are plain PyTorch hooks: they run in the eager forward, never in a graph
        return mode

    def reserve(self, state: ModelState, needed: int) -> None:
        """Grow every MLA cache (outside the step) so that rows [0, needed) exist."""
        dsa = self.model.config.dsa
        cuda = any(isinstance(layer, MLACache) and layer.latent.is_cuda for layer in state.layers)
        cap = static_capacity(needed, dsa.topk if dsa is not None else 0, doubling=cuda)
        for layer in state.layers:
            if not isinstance(layer, MLACache):
                continue
            layer.grow_to(cap)
            for t in (layer.latent, layer.k_rope, layer.index_keys):
                # marks are attributes of the tensor: only a buffer new since the last step (grown, or
                # set from a snapshot) needs them, and marking again every step is measurable at demo size
                if t is None or 1 in getattr(t, "_dynamo_dynamic_indices", ()):
                    continue
                torch._dynamo.mark_dynamic(t, 1)  # one graph for every capacity (a flag on the tensor)
                if t.is_cuda:  # the CUDA graph writes these in place: keep their addresses
                    torch._dynamo.mark_static_address(t)

    def _guard_key(self, state: ModelState, batch: int, listening: tuple[ProbePoint, ...]) -> tuple:
        """What the step's guards check that can change between steps of one model: a step whose key was
        seen before runs without guard evaluation."""
        runtime = self.model.runtime
        caches = tuple((t.shape, t.stride(), t.dtype, t.device) for layer in state.layers if isinstance(layer, MLACache)
                       for t in (layer.latent, layer.k_rope, layer.index_keys) if t is not None)
        kda = tuple((layer.recurrent.dtype, layer.recurrent.shape) for layer in state.layers
                    if not isinstance(layer, MLACache))
        stacks = (tuple(group.pointers for group in self._fused), tuple(m.kept() for m in self._experts),
                  self._input_major.pointers)
        # interventions: which rules exist and their table sizes (positions and factors are the graph's inputs)
        plan = runtime.interventions
        options = (runtime.dsa_force_dense, runtime.dsa_dense_layers, runtime.mxfp8_activations, runtime.kernels,
                   runtime.expert_cache_mib, runtime.kda_chunk_size, runtime.kda_recurrent_max_tokens,
                   None if plan is None else plan.signature)
        params = next(self.model.parameters())
        # the points listening at this step (a finisher's only at its measured steps), and what each asks
        listeners = (tuple(map(id, listening)), tuple((p.sink is not None, p.request) for p in self._points))
        # BACKEND: each compiler has its own compiled function, whose first step must run its guards
        return (batch, caches, kda, stacks, options, listeners, params.dtype, params.device, state.key_start is None,
                torch.is_grad_enabled(), torch.is_inference_mode_enabled(), id(self.model.parallel), BACKEND)

    def _compiled(self, device: torch.device) -> Callable:
        fn = self._fns.get(BACKEND)
        if fn is None:
            # the compiler's imports and its work land on top of whatever heap the prefill left (engine.heap)
            release_free_heap()
            import torch._dynamo

            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
            options = compile_options(device) if BACKEND == "inductor" else None
            fn = self._fns[BACKEND] = torch.compile(decode_forward_probed, fullgraph=True, backend=BACKEND,
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
        _inference_states(state)
        x = torch.tensor(ids, dtype=torch.long).view(-1, 1).to(device)
        start = torch.tensor(state.length, dtype=torch.long).to(device)
        refresh_fused(self._fused)  # the compiled graph reads the stacked weights as they are
        self._input_major.refresh()  # and these weights input-major (`engine.decode.layouts`)
        listening = self._listeners()
        for point in listening:
            point.collecting = True
        finite = False
        try:
            logits, buffers, layout = self._run(x, state, start, listening, compiled)
            finite = all_finite(logits)
        finally:
            for point in listening:
                point.collecting = False
                if not finite:  # the step raised, or its logits are not finite: it emits nothing
                    point.collected.clear()
        if not finite:
            raise nonfinite_error(self.model, x, logits, state)
        if layout:
            # CUDA: a CUDA graph replay's outputs are overwritten by the next replay, while the tape keeps
            # them until its delivery, so they are copied first
            if device.type == "cuda" or self.copy_out:
                buffers = tuple(b.clone() for b in buffers)
            self.tape.record(state.length, buffers, layout, listening, state.layers)
        self.steps += 1
        return logits

    def _listeners(self) -> tuple[ProbePoint, ...]:
        """The points that listen at this step, as the same tuple object whenever the set recurs.

        A point a module finishes on the host (`host_finished_probes`, e.g. MLA's dense mass) listens
        only at the steps its request measures (`ProbeRequest.measures_step`, every 64th by default):
        collecting its query and selection at every other step only to drop them cost ~3% of a demo
        decode step. A recorded session so alternates between two graphs, told apart by the tuple."""
        finishers = self.tape.finishers
        listening = tuple(p for p in self._points if p.sink is not None
                          and (p not in finishers or p.request.measures_step(p.context.step)))
        # the points live as long as this step holds them, so their ids name the set
        return self._listener_sets.setdefault(tuple(map(id, listening)), listening)

    def _run(self, x: torch.Tensor, state: ModelState, start: torch.Tensor, listening: tuple[ProbePoint, ...],
             compiled: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], Layout]:
        # only the listening points are passed: with none, the step's input is an empty tuple, which tells
        # its graph from the listening ones by one length check (passing every point made dynamo tell
        # them apart by full guard evaluation, a large share of an unrecorded step once a recorded graph existed)
        if not compiled:
            return decode_forward_probed(self.model, x, state, start, listening)
        fn = self._compiled(x.device)
        key = self._guard_key(state, x.shape[0], listening)
        if key in self._checked:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return fn(self.model, x, state, start, listening)
        dtype = next(self.model.parameters()).dtype
        for experts in self._experts:  # what they keep is made now, not as a side effect of the first trace
            experts.prepare(dtype, x.device)
        key = self._guard_key(state, x.shape[0], listening)  # the kept stacks are part of it
        frames, t0 = _compiled_frames(), time.perf_counter()
        out = fn(self.model, x, state, start, listening)
        if _compiled_frames() > frames:
            self.compiles += 1
            self.compile_seconds += time.perf_counter() - t0
        else:  # guards passed on an existing graph: its first trace's side effects are settled
            self._checked.add(key)
        return out

    def deliver(self) -> None:
        """Hand every listening point's undelivered decode steps to its sink (`ProbeTape.deliver`)."""
        if self.tape.steps:
            self.tape.deliver()
