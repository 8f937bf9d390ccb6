"""Vision tower speed and memory: time and tokens/s at 896x896, peak memory linear in patches.

Speed: one 896x896 image (64 x 64 patches = 4096, 1024 merged tokens) through the `demo` tower
(random weights, fp32): preprocessing, tower + merge + projector, best of `--repeats`.

Memory: for each size (default 1024x1024, 2048x2048, 3840x2160) a fresh subprocess builds the
tower (one block by default: blocks run one after another, so the peak is one block's; the
attention at 43K patches is quadratic in time even when it is linear in memory), preprocesses the image, resets the kernel's peak-RSS mark and runs the tower once. The
increment over the RSS before the forward is the forward's own memory; attention is blockwise,
so it must grow about linearly in patches (a [P, P] fp32 score matrix per head at 3840x2160,
43,056 patches, would alone be 7.4 GB).

    python benchmarks/bench_vision.py
    python benchmarks/bench_vision.py --sizes 1024x1024 2048x2048 --threads 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from measure import peak_kb, print_memory_growth, reset_peak, status_kb


def _image(width: int, height: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def _model(preset: str, layers: int | None = None):
    import torch

    from engine.presets import get_preset
    from engine.vision import VisionModel
    from engine.weights.names import checkpoint_tensors
    from engine.weights.random_init import RandomSource

    config = get_preset(preset)
    if layers is not None:
        config = config.replace(vision=dataclasses.replace(config.vision, num_layers=layers))
    source = RandomSource(config, seed=0, float_dtype=torch.float32)
    model = VisionModel(config.vision)
    model.load_state_dict({s.name: source.get(s) for s in checkpoint_tensors(config) if s.target is None})
    return model.eval()


def memory_worker(preset: str, width: int, height: int, threads: int, layers: int | None) -> dict:
    import torch

    from engine.vision import preprocess_image

    torch.set_num_threads(threads)
    model = _model(preset, layers)
    image = preprocess_image(_image(width, height), name=f"{width}x{height}")
    rss_before = status_kb("VmRSS")
    reset = reset_peak()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model(image.pixel_values, image.grid)
    seconds = time.perf_counter() - t0
    peak = peak_kb(reset)
    assert bool(torch.isfinite(out).all())
    return {"size": f"{width}x{height}", "patches": image.num_patches, "tokens": out.shape[0],
            "rss_before_kb": rss_before, "peak_kb": peak, "seconds": seconds, "peak_reset": reset}


def speed(preset: str, repeats: int, threads: int) -> None:
    import torch

    from engine.vision import preprocess_image

    torch.set_num_threads(threads)
    model = _model(preset)
    img = _image(896, 896)
    t0 = time.perf_counter()
    image = preprocess_image(img)
    prep = time.perf_counter() - t0
    times = {}
    with torch.no_grad():
        for label, reference in (("sdpa", False), ("reference", True)):
            model.set_reference_attention(reference)
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                out = model(image.pixel_values, image.grid)
                best = min(best, time.perf_counter() - t0)
            times[label] = best
    c = model.config
    print(f"896x896 on preset {preset} (tower width {c.hidden_size}, {c.num_layers} blocks, {c.num_heads} heads), "
          f"{threads} thread(s), fp32: grid {image.grid[0]}x{image.grid[1]} = {image.num_patches} patches -> "
          f"{out.shape[0]} tokens")
    print(f"  preprocessing {prep * 1e3:.0f} ms")
    for label, s in times.items():
        print(f"  tower+merge+projector ({label} attention): {s * 1e3:.0f} ms, {out.shape[0] / s:.0f} tokens/s, "
              f"{image.num_patches / s:.0f} patches/s")
    print(f"  reference / sdpa time: {times['reference'] / times['sdpa']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--sizes", nargs="+", default=["1024x1024", "2048x2048", "3840x2160"])
    ap.add_argument("--repeats", type=int, default=2)
    # blocks run one after another, so one block has the whole tower's peak; fewer blocks = shorter run
    ap.add_argument("--memory-layers", type=int, default=1, help="tower blocks in the memory runs (0: the preset's)")
    ap.add_argument("--threads", type=int, default=1)  # steadier on a shared machine
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        w, h = map(int, args.worker.split("x"))
        print(json.dumps(memory_worker(args.preset, w, h, args.threads, args.memory_layers or None)))
        return

    speed(args.preset, args.repeats, args.threads)
    rows = []
    for size in args.sizes:
        cmd = [sys.executable, __file__, "--preset", args.preset, "--threads", str(args.threads), "--worker", size,
               "--memory-layers", str(args.memory_layers)]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        proc = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env,
                              cwd=Path(__file__).resolve().parents[1])
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))

    blocks = args.memory_layers or "all"
    print(f"\npeak memory of one tower forward (+ merge + projector), preset {args.preset} with {blocks} block(s), "
          f"fresh process per size")
    print(f"{'size':>10} {'patches':>8} {'tokens':>7} {'RSS before MB':>14} {'peak MB':>8} {'forward +MB':>12} "
          f"{'KB/patch':>9} {'x prev':>7} {'P x prev':>9} {'forward s':>10}")
    prev = None
    for r in rows:
        extra = r["peak_kb"] - r["rss_before_kb"]
        grow = f"{extra / prev[1]:.2f}" if prev else "-"
        p_grow = f"{r['patches'] / prev[0]:.2f}" if prev else "-"
        print(f"{r['size']:>10} {r['patches']:>8} {r['tokens']:>7} {r['rss_before_kb'] / 1024:>14.0f} "
              f"{r['peak_kb'] / 1024:>8.0f} {extra / 1024:>12.0f} {extra / r['patches']:>9.1f} {grow:>7} "
              f"{p_grow:>9} {r['seconds']:>10.1f}")
        prev = (r["patches"], extra)
    print_memory_growth(rows, "patches", "patches", "[P, P] score")


if __name__ == "__main__":
    main()
