"""Host overhead of one decode token per layer at TRUE K3.1 Pro widths, projected to 93 layers.

A model slice of the `k3.1-pro` preset (hidden 7168, 96 heads, latent MoE 3584 -> 3 x 3072) with 3
layers and 16 experts (16 routes per token, as in K3.1 Pro; random weights, MXFP4 experts) is
built layer by layer; one KDA layer (index 1) and one gated-MLA + DSA layer (index 2), both with
the latent MoE, each run single-token decode steps from a state (the DSA layer at `--context`
cached tokens). Per layer it prints:

- ops: aten operations dispatched per decode token (a `TorchDispatchMode` counts them);
- CPU us: the eager layer step on this CPU at true widths (compute included, an upper bound);
- host us: ops x the per-op host cost measured on the demo preset's layers of the same kind
  (same code path, negligible compute: there the step's time is host time);
Times are CPU seconds of this single-threaded process (a shared machine inflates wall time).
- compiled us: the same layer's static-shape step (`engine.decode.step`'s form: device-tensor
  position, cache read whole at its capacity) under `torch.compile(fullgraph=True)`, CPU us per
  token; its compile time is printed too. Inductor's kernels do not pass the dispatcher, so no op
  count is printed for it. `--no-compiled` skips it.

The projection to 93 layers (69 KDA + 24 DSA; layer 0's dense MLP counted as a KDA layer) is
printed beside the weight-streaming bound: bytes read per token (104 B active parameters: routed
experts MXFP4 at 4.25 bits/weight, everything else bf16; the input embedding is one row) divided
by the aggregate HBM bandwidth of 8 GPUs, using the published figures H200 4.8 TB/s and B300
8 TB/s per GPU.

    python benchmarks/bench_layer_overhead.py                 # bf16 slice, about 3 GB of RAM
    python benchmarks/bench_layer_overhead.py --demo-only     # per-op host cost only (runs on base code too)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import load_model
from engine.cache import KDAState, MLACache
from engine.weights.census import census
from engine.config import ModelConfig
from engine.model import DecoderLayer
from engine.presets import get_preset
from engine.runtime import RuntimeOptions

HBM_TBPS = {"8 x H200": 4.8, "8 x B300": 8.0}  # published per-GPU HBM bandwidth, TB/s
GPUS = 8
MXFP4_BITS = 4.25  # 4-bit elements + one 8-bit scale per 32


class CountOps(TorchDispatchMode):
    """Counts every aten op that reaches the dispatcher (what a GPU would launch, before fusion)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def slice_config(experts: int) -> ModelConfig:
    pro = get_preset("k3.1-pro")
    return pro.replace(num_hidden_layers=3, kda_layers=(0, 1), mla_layers=(2,), num_experts=experts,
                       dsa=dataclasses.replace(pro.dsa, layers=(2,)), vision=None)


def build_layer(config: ModelConfig, idx: int, dtype: torch.dtype, seed: int) -> DecoderLayer:
    """One decoder layer at the config's widths with random weights (built on meta, then filled)."""
    with torch.device("meta"):
        layer = DecoderLayer(config, idx, RuntimeOptions(kernels="reference"))
    layer = layer.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
        with torch.no_grad():
            if t.dtype == torch.uint8:
                if name.endswith("_scale"):
                    t.copy_(torch.randint(118, 123, t.shape, dtype=torch.uint8, generator=g))
                else:
                    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
            elif "norm" in name or name.endswith("A_log"):
                t.fill_(1.0 if "norm" in name else 0.0)
            else:
                t.normal_(0.0, 0.02, generator=g)
    return layer.to(dtype) if dtype != torch.float32 else layer


def layer_state(config: ModelConfig, idx: int, context: int, dtype: torch.dtype):
    if config.is_kda_layer(idx):
        s = KDAState.zeros(config, 1)
        s.recurrent.normal_(0.0, 0.1)
        return s
    s = MLACache.empty(config, idx, 1, capacity=context + 64, dtype=dtype)
    for t in (s.latent, s.k_rope, s.index_keys):
        if t is not None:
            t[:, :context].normal_()
    return s


def time_layer(layer: DecoderLayer, state, start: int, hidden: int, dtype: torch.dtype, steps: int
               ) -> tuple[int, float, Counter]:
    """(ops per token, median CPU us per token, op histogram) of single-token steps.

    CPU time of this single-threaded process, not wall time: on a shared machine wall time mostly
    measures the neighbours."""
    g = torch.Generator().manual_seed(1)
    blocks = [torch.randn(1, 1, hidden, generator=g).to(dtype)]  # one earlier AttnRes block
    x = torch.randn(1, 1, hidden, generator=g).to(dtype)
    walls = []
    with torch.no_grad():
        layer(x, list(blocks), state, start)  # warm-up
        counter = CountOps()
        with counter:
            layer(x, list(blocks), state, start + 1)
        for i in range(steps):
            t0 = time.process_time()
            layer(x, list(blocks), state, start + 2 + i)
            walls.append(time.process_time() - t0)
    return sum(counter.counts.values()), 1e6 * statistics.median(walls), counter.counts


def _static_layer_step(layer, x, blocks, state, start):
    return layer(x, blocks, state, start)


def time_compiled(layer: DecoderLayer, state, start: int, hidden: int, dtype: torch.dtype, steps: int
                  ) -> tuple[float, float]:
    """(median CPU us per token, compile seconds) of the layer's compiled static-shape step."""
    from engine.decode.step import static_capacity

    if isinstance(state, MLACache):
        state.reserve(static_capacity(start + steps + 4, 2048))
    g = torch.Generator().manual_seed(1)
    blocks = [torch.randn(1, 1, hidden, generator=g).to(dtype)]
    x = torch.randn(1, 1, hidden, generator=g).to(dtype)
    fn = torch.compile(_static_layer_step, fullgraph=True, dynamic=False)
    times = []
    with torch.no_grad():
        t0 = time.perf_counter()
        fn(layer, x, list(blocks), state, torch.tensor(start))
        compile_s = time.perf_counter() - t0
        for i in range(steps):
            t0 = time.process_time()
            fn(layer, x, list(blocks), state, torch.tensor(start + 1 + i))
            times.append(time.process_time() - t0)
    return 1e6 * statistics.median(times), compile_s


def demo_costs(steps: int, context: int, compiled: bool = False) -> dict[str, tuple]:
    """Per layer kind: (ops, host us[, compiled us, compile s]) on the demo preset, whose compute is negligible."""
    model = load_model("preset:demo")
    c = model.config
    kda = next(i for i in c.kda_layers if c.is_moe_layer(i))
    dsa = next(i for i in c.mla_layers if c.is_dsa_layer(i))
    out = {}
    for kind, idx in (("KDA", kda), ("DSA", dsa)):
        layer = model.model.layers[idx]
        ops, wall, _ = time_layer(layer, layer_state(c, idx, context, torch.float32), context, c.hidden_size,
                                  torch.float32, steps)
        out[kind] = (ops, wall)
        if compiled:
            out[kind] += time_compiled(layer, layer_state(c, idx, context, torch.float32), context, c.hidden_size,
                                       torch.float32, steps)
    return out


def streaming_bound() -> tuple[float, str]:
    """Bytes read per decode token for K3.1 Pro's active weights at the engine's storage formats."""
    config = get_preset("k3.1-pro")
    counts = census(config)
    routed = counts.by_component["routed_experts"] * config.num_experts_per_token / config.num_experts
    other = counts.active - routed
    per_token = routed * MXFP4_BITS / 8 + other * 2 + config.hidden_size * 2  # + one embedding row
    note = (f"{counts.active / 1e9:.1f} B active = {routed / 1e9:.1f} B routed (MXFP4) + {other / 1e9:.1f} B "
            f"bf16 -> {per_token / 1e9:.1f} GB per token")
    return per_token, note


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5, help="timed decode steps per layer")
    ap.add_argument("--context", type=int, default=2048, help="cached tokens before the step (DSA layer)")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--demo-only", action="store_true", help="skip the true-width slice")
    ap.add_argument("--no-compiled", action="store_true", help="skip the compiled column")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    compiled = not args.no_compiled
    demo = demo_costs(args.steps * 4, min(args.context, 1024), compiled)
    print(f"demo preset, per decode token and layer ({args.threads} thread(s)):")
    for kind, (ops, wall, *comp) in demo.items():
        print(f"  {kind}: eager {ops} ops, {wall:.0f} us host, {wall / ops:.1f} us per op"
              + (f"; compiled {comp[0]:.0f} us (compile {comp[1]:.0f} s)" if comp else ""))
    if args.demo_only:
        return

    config = slice_config(args.experts)
    rows = {}
    for kind, idx in (("KDA", 1), ("DSA", 2)):
        layer = build_layer(config, idx, dtype, seed=idx)
        state = layer_state(config, idx, args.context, dtype)
        ops, wall, hist = time_layer(layer, state, args.context, config.hidden_size, dtype, args.steps)
        comp = time_compiled(layer, state, args.context, config.hidden_size, dtype, args.steps) if compiled else None
        rows[kind] = (ops, wall, ops * demo[kind][1] / demo[kind][0], hist, comp)
        del layer, state
    print(f"\nK3.1 Pro widths (hidden {config.hidden_size}, {config.num_experts} experts top-"
          f"{config.num_experts_per_token}, {args.dtype}, DSA context {args.context}), per decode token:")
    print(f"{'layer':<6} {'ops':>6} {'CPU us':>14} {'host us':>9} {'compiled':>9}  top ops")
    for kind, (ops, wall, host, hist, comp) in rows.items():
        top = ", ".join(f"{n.split('.')[-1]} {c}" for n, c in hist.most_common(6))
        print(f"{kind:<6} {ops:>6} {wall:>14.0f} {host:>9.0f} {comp[0] if comp else float('nan'):>9.0f}  {top}")

    n_kda, n_dsa = len(get_preset("k3.1-pro").kda_layers), len(get_preset("k3.1-pro").mla_layers)
    host_ms = (n_kda * rows["KDA"][2] + n_dsa * rows["DSA"][2]) / 1000
    ops_total = n_kda * rows["KDA"][0] + n_dsa * rows["DSA"][0]
    per_token, note = streaming_bound()
    print(f"\nprojection to 93 layers ({n_kda} KDA + {n_dsa} DSA): {ops_total} ops, host {host_ms:.1f} ms per token "
          f"-> at most {1000 / host_ms:.0f} tokens/s from host overhead alone (eager)")
    if compiled:
        comp_ms = (n_kda * demo["KDA"][2] + n_dsa * demo["DSA"][2]) / 1000
        print(f"compiled, from the demo layers' compiled step time (host + negligible compute): "
              f"{comp_ms:.1f} ms per token -> at most {1000 / comp_ms:.0f} tokens/s (CPU inductor; a CUDA "
              f"graph replays the whole step in one launch)")
    print(f"weight-streaming bound: {note}")
    for name, tbps in HBM_TBPS.items():
        ms = per_token / (GPUS * tbps * 1e12) * 1000
        print(f"  {name} ({tbps} TB/s each): {ms:.2f} ms per token = {1000 / ms:.0f} tokens/s; "
              f"host overhead / bound = {host_ms / ms:.1f}x")


if __name__ == "__main__":
    main()
