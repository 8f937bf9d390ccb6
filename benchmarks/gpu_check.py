"""GPU check: every Triton kernel against its pure-torch reference at real K3.1 Pro shapes, timed side
by side, plus a demo-preset session with kernels on and off, and the compiled decode step
(`engine.decode.step`, CUDA graph): demo-preset greedy decode compiled vs eager (same tokens), and
one KDA and one DSA layer at true K3.1 Pro widths (16 experts) in ms per token against the memory
roofline (the layer's weight and cache bytes over the copy bandwidth measured in the same run).
Exits 1 on any mismatch. `--skip-compiled` leaves the compiled part out.

    bash benchmarks/gpu_check.sh            # on a machine with a CUDA GPU (writes $OUT/gpu_check.json)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch


def timed(fn, repeat: int = 10) -> tuple[object, float]:
    """Result and median seconds of `fn()` (CUDA-synchronised)."""
    out = fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return out, sorted(times)[len(times) // 2]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--keys", type=int, default=65536, help="indexer keys (context) for the DSA check")
    ap.add_argument("--skip-compiled", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "gpu_check.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    from engine.ops.dsa import reference as dsa_ref
    from engine.ops.dsa.triton_scores import indexer_scores
    from engine.ops.kda.reference import kda_recurrent as kda_ref
    from engine.ops.kda.triton_recurrent import kda_recurrent as kda_triton
    from engine.ops.mxfp4.triton_dequant import dequantize as dequant_triton
    from engine.ops.mxfp4 import reference as mxfp4

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows, ok = [], True

    # MXFP4: one routed expert's w1 at K3.1 dims [3072, 3584]
    packed = torch.randint(0, 256, (3072, 1792), dtype=torch.uint8, device=dev, generator=g)
    scale = torch.randint(110, 140, (3072, 112), dtype=torch.uint8, device=dev, generator=g)
    got, t_k = timed(lambda: dequant_triton(packed, scale, torch.bfloat16))
    ref, t_r = timed(lambda: mxfp4.dequantize(packed, scale, torch.bfloat16))
    same = bool(torch.equal(got, ref))
    ok &= same
    rows.append({"op": "mxfp4 dequant [3072, 3584] -> bf16", "exact": same, "triton_ms": t_k * 1e3,
                 "torch_ms": t_r * 1e3})

    # DSA index scores: 64 queries x context keys, 32 heads x 128 (one prefill block / a decode batch)
    q = torch.randn(1, 64, 32, 128, device=dev, generator=g)
    w = torch.randn(1, 64, 32, device=dev, generator=g)
    k = torch.randn(1, args.keys, 128, device=dev, generator=g)
    got, t_k = timed(lambda: indexer_scores(q, w, k))
    ref, t_r = timed(lambda: dsa_ref.indexer_scores(q, w, k))
    err = rel(got, ref)
    pos = torch.arange(args.keys - 64, args.keys, device=dev)
    same_sets = bool(torch.equal(dsa_ref.indexer_topk(q, w, k, pos, 2048, scorer=indexer_scores)[0],
                                 dsa_ref.indexer_topk(q, w, k, pos, 2048)[0]))
    ok &= err <= 1e-5 and same_sets
    rows.append({"op": f"DSA scores 64 x {args.keys} x 32 heads", "rel_error": err, "same_topk": same_sets,
                 "triton_ms": t_k * 1e3, "torch_ms": t_r * 1e3})

    # KDA decode step: 96 heads x 128 x 128 state, one token
    norm = torch.nn.functional.normalize
    qk = [norm(torch.randn(1, 1, 96, 128, device=dev, generator=g), dim=-1) for _ in range(2)]
    v = torch.randn(1, 1, 96, 128, device=dev, generator=g)
    gate = -5 * torch.sigmoid(torch.randn(1, 1, 96, 128, device=dev, generator=g))
    beta = torch.rand(1, 1, 96, device=dev, generator=g)
    state = torch.randn(1, 96, 128, 128, device=dev, generator=g)
    (o, s), t_k = timed(lambda: kda_triton(qk[0], qk[1], v, gate, beta, state))
    (o_r, s_r), t_r = timed(lambda: kda_ref(qk[0], qk[1], v, gate, beta, state))
    err = max(rel(o, o_r), rel(s, s_r))
    ok &= err <= 1e-5
    rows.append({"op": "KDA decode step 96 x 128 x 128", "rel_error": err, "triton_ms": t_k * 1e3,
                 "torch_ms": t_r * 1e3})

    # the demo model end to end: kernels on vs the pure-torch reference, same logits
    from engine import load_model

    model = load_model("preset:demo", device=dev)
    ids = torch.randint(0, 256, (1, 4096), device=dev, generator=g)
    with torch.inference_mode():
        on, t_on = timed(lambda: model(ids), repeat=3)
        model.runtime.kernels = "reference"
        off, t_off = timed(lambda: model(ids), repeat=3)
    err = rel(on, off)
    ok &= err <= 1e-4
    rows.append({"op": "demo forward T=4096 (kernels vs reference)", "rel_error": err, "triton_ms": t_on * 1e3,
                 "torch_ms": t_off * 1e3})

    if not args.skip_compiled:
        ok &= compiled_decode_rows(model, rows, dev)

    for r in rows:
        speed = r["torch_ms"] / r["triton_ms"] if r["triton_ms"] else float("nan")
        print(f"{r['op']:<48} triton {r['triton_ms']:9.3f} ms   torch {r['torch_ms']:9.3f} ms   {speed:6.2f}x   "
              + ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("op", "triton_ms", "torch_ms")))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "ok": ok, "rows": rows}, indent=1))
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


def compiled_decode_rows(model, rows: list, dev: torch.device) -> bool:
    """Compiled decode step vs eager: the demo session, then true-width layers against the roofline
    ("triton_ms" holds the compiled figure, "torch_ms" the eager one)."""
    from engine.session import Session

    ok = True
    model.runtime.kernels = "auto"
    tokens = {}
    ms = {}
    for mode in (False, True):
        model.runtime.compile = mode
        s = Session(model)
        s.append(ids=list(range(1, 1025)))
        tokens[mode] = [t.id for t in s.generate(8, temperature=0, stop_ids=())]  # includes the compile
        n0, t0 = s.deployment.decode_steps, s.deployment.decode_seconds
        list(s.generate(32, temperature=0, stop_ids=()))
        ms[mode] = 1e3 * (s.deployment.decode_seconds - t0) / max(1, s.deployment.decode_steps - n0)
    same = tokens[False] == tokens[True]
    ok &= same
    rows.append({"op": "demo decode at 1K, ms/token (compiled vs eager)", "same_tokens": same,
                 "triton_ms": ms[True], "torch_ms": ms[False]})

    # recorded (default policy): listeners collect inside the CUDA graph; each step's payloads are copied
    # off its outputs (one buffer per dtype, cloned) onto the probe tape
    import tempfile

    import workbench

    s = Session(model)
    s.append(ids=list(range(1, 1025)))
    with tempfile.TemporaryDirectory() as tmp, workbench.record(s, trace=Path(tmp) / "trace"):
        recorded = [t.id for t in s.generate(8, temperature=0, stop_ids=())]  # compiles the listening graph
        n0, t0 = s.deployment.decode_steps, s.deployment.decode_seconds
        list(s.generate(32, temperature=0, stop_ids=()))
        rec_ms = 1e3 * (s.deployment.decode_seconds - t0) / max(1, s.deployment.decode_steps - n0)
    same = recorded == tokens[True]
    ok &= same
    rows.append({"op": "demo decode at 1K recorded (default policy), ms/token (recorded vs not, compiled)",
                 "same_tokens": same, "triton_ms": rec_ms, "torch_ms": ms[True]})

    # memory roofline of this GPU: a 2 GiB device copy
    src = torch.empty(2**30, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    _, t_copy = timed(lambda: dst.copy_(src), repeat=5)
    bandwidth = 2 * src.numel() * src.element_size() / t_copy
    del src, dst
    rows.append({"op": "device copy 2 GiB (memory roofline)", "GB_per_s": round(bandwidth / 1e9, 1),
                 "triton_ms": t_copy * 1e3, "torch_ms": t_copy * 1e3})

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_layer_overhead import build_layer, layer_state, slice_config
    from engine.cache import MLACache
    from engine.decode.step import static_capacity

    config = slice_config(16)
    context = 4096
    for kind, idx in (("KDA", 1), ("DSA", 2)):
        layer = build_layer(config, idx, torch.bfloat16, seed=idx).to(dev)
        state = layer_state(config, idx, context, torch.bfloat16)
        if isinstance(state, MLACache):
            state.reserve(static_capacity(context + 64, 2048))
            state = MLACache(*(t.to(dev) if t is not None else None
                               for t in (state.latent, state.k_rope, state.index_keys)))
            for t in (state.latent, state.k_rope, state.index_keys):
                torch._dynamo.mark_static_address(t)
            state_bytes = sum(t.numel() * t.element_size() for t in (state.latent, state.k_rope, state.index_keys))
        else:
            state.recurrent, state.conv = state.recurrent.to(dev), state.conv.to(dev)
            state_bytes = 2 * (state.recurrent.numel() + state.conv.numel()) * 4  # read + written
        weight_bytes = sum(t.numel() * t.element_size() for t in list(layer.parameters()) + list(layer.buffers()))
        x = torch.randn(1, 1, config.hidden_size, device=dev, dtype=torch.bfloat16)
        blocks = [torch.randn_like(x)]
        pos = torch.tensor(context, device=dev)
        fn = torch.compile(lambda layer, x, blocks, state, pos: layer(x, blocks, state, pos), fullgraph=True,
                           dynamic=False, mode="reduce-overhead")
        with torch.inference_mode():
            for _ in range(3):
                fn(layer, x, list(blocks), state, pos)  # compile, record, replay
            _, t_c = timed(lambda: fn(layer, x, list(blocks), state, pos))
            _, t_e = timed(lambda: layer(x, list(blocks), state, context))
        roofline = (weight_bytes + state_bytes) / bandwidth
        rows.append({"op": f"{kind} layer decode at K3.1 widths, ms/token", "roofline_ms": round(roofline * 1e3, 3),
                     "compiled_over_roofline": round(t_c / roofline, 2), "triton_ms": t_c * 1e3,
                     "torch_ms": t_e * 1e3})
        del layer, state
        torch.cuda.empty_cache()
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
