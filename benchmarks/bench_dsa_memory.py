"""Peak memory of a DSA prefill grows linearly with the sequence length.

For each T (default 8K, 16K, 32K) a fresh subprocess loads `preset:demo` (K3.1 layout, DSA top-k
256), resets the kernel's peak-RSS mark (`/proc/self/clear_refs`; `ru_maxrss` where unsupported)
and runs one full causal forward over T random ids. It reports the RSS before the forward, the
peak during it and their difference (the forward's own memory: activations, KV/indexer keys,
logits). Linear memory doubles the increment when T doubles; a [T, T] score matrix would
quadruple it (at 32K one fp32 [T, T] matrix alone is 4 GiB).

    python benchmarks/bench_dsa_memory.py
    python benchmarks/bench_dsa_memory.py --tokens 4096 8192 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from measure import peak_kb, print_memory_growth, reset_peak, status_kb


def worker(model_path: str, tokens: int, threads: int) -> dict:
    import torch

    from engine import load_model

    torch.set_num_threads(threads)
    model = load_model(model_path)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    rss_before = status_kb("VmRSS")
    reset = reset_peak()  # peak RSS := current RSS
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = model(ids)
    seconds = time.perf_counter() - t0
    peak = peak_kb(reset)
    assert logits.shape == (1, tokens, model.config.vocab_size) and bool(torch.isfinite(logits[0, -1]).all())
    return {"tokens": tokens, "rss_before_kb": rss_before, "peak_kb": peak, "seconds": seconds, "peak_reset": reset,
            "topk": model.config.dsa.topk if model.config.dsa else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="preset:demo")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    # one thread by default: steadier on a shared machine; memory does not depend on it
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.model, args.worker, args.threads)))
        return

    rows = []
    for tokens in args.tokens:
        cmd = [sys.executable, __file__, "--model", args.model, "--threads", str(args.threads), "--worker", str(tokens)]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        proc = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env,
                              cwd=Path(__file__).resolve().parents[1])
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"T={tokens}: forward {r['seconds']:.1f} s, peak {r['peak_kb'] / 1024:.0f} MB", flush=True)

    print(f"\nDSA prefill memory, {args.model} (top-k {rows[0]['topk']}), full causal forward, "
          f"{args.threads} thread(s), fresh process per length")
    print(f"{'T':>7} {'RSS before MB':>14} {'peak MB':>9} {'forward +MB':>12} {'KB/token':>9} "
          f"{'x prev':>7} {'T x prev':>9} {'forward s':>10}")
    prev = None
    for r in rows:
        extra = r["peak_kb"] - r["rss_before_kb"]
        grow = f"{extra / prev[1]:.2f}" if prev else "-"
        t_grow = f"{r['tokens'] / prev[0]:.2f}" if prev else "-"
        print(f"{r['tokens']:>7} {r['rss_before_kb'] / 1024:>14.0f} {r['peak_kb'] / 1024:>9.0f} {extra / 1024:>12.0f} "
              f"{extra / r['tokens']:>9.1f} {grow:>7} {t_grow:>9} {r['seconds']:>10.1f}")
        prev = (r["tokens"], extra)
    print_memory_growth(rows, "tokens", "tokens", "[T, T]")


if __name__ == "__main__":
    main()
